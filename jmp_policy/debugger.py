"""A precision debugger: per-layer statistics of a loss's forward and backward pass.

`debug_precision(loss_fn, *args)` traces the loss's value and gradient and runs them as one
program that returns every intermediate value (on the default device: a debugging tool, not a
train step), then reads them operation by operation on the host.
For every layer (a Linen module path, an NNX attribute path or an Equinox field path under the
root module's class name, a `jax.named_scope`; "(top level)" outside any) and direction (forward:
activations, backward: the values that carry the gradient) it records how close the values come
to the edges of a target dtype at a given loss scale, and it names the first operation that made
an inf or NaN out of finite inputs. Under a policy, only what the policy runs in the target dtype
is judged."""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import eval_jaxpr
from jax.extend import core as jcore
from jax.typing import DTypeLike

from jmp_policy import _jaxpr, _naming
from jmp_policy._compat import jaxprs_in_params
from jmp_policy._pytree import is_traced_leaf, register_state, split_traced
from jmp_policy._validation import is_library_file
from jmp_policy.overrides import FLOAT32_ISLAND, FULL_PRECISION_REGION
from jmp_policy.policy import is_floating_array

TOP_LEVEL = _jaxpr.TOP_LEVEL


@dataclasses.dataclass(frozen=True)
class LayerStats:
    """How the values of one layer and direction sit in the target dtype.

    Attributes:
      layer: the module path ("Classifier/Dense_0"), or "(top level)".
      direction: "forward" (activations) or "backward" (gradients).
      count: how many floating values the layer's operations produced.
      amax: the largest finite magnitude (0.0 when there is none).
      min_nonzero: the smallest nonzero finite magnitude (inf when there is none).
      dynamic_range: log2(amax / min_nonzero), in binades (0 when undefined).
      underflow: the fraction of nonzero values that become zero or subnormal in the target
        dtype (after the loss scale, for gradients).
      overflow: the fraction of finite values that exceed the target dtype's largest value.
      headroom: how many doublings of the loss scale are left before the largest value
        overflows (negative: it already does); forward values are not scaled, so for them it
        is the margin of the activations.
      nonfinite: the fraction of values that are inf or NaN.
      underflow_mass: the share of the values' total magnitude held by the ones that
        underflow: what flushing them to zero loses (tiny tails, such as GELU's far left,
        count in `underflow` but lose almost nothing).
    """

    layer: str
    direction: str
    count: int
    amax: float
    min_nonzero: float
    dynamic_range: float
    underflow: float
    overflow: float
    headroom: float
    nonfinite: float
    underflow_mass: float = 0.0


@dataclasses.dataclass(frozen=True)
class OpError:
    """How much accuracy one operation loses when it runs in the target dtype.

    Attributes:
      layer: its module path.
      primitive: the operation, e.g. "reduce_sum".
      error: the relative error (L2) of its result when its float32 inputs are rounded to
        the target dtype and it runs there, against float32, in units of the target's unit
        roundoff u (eps / 2): about 1 for an operation that only rounds, more for one that
        amplifies rounding (long sums, cancellation, powers); inf if it overflows.
    """

    layer: str
    primitive: str
    error: float


@dataclasses.dataclass(frozen=True)
class NonFiniteOrigin:
    """Where the first inf/NaN was made from finite inputs.

    Attributes:
      primitive: the operation, e.g. "log".
      layer: its module path.
      direction: "forward" or "backward".
      source: "file:line" of the user code that traced it.
      passed_on: how many later operations only passed a non-finite value on.
    """

    primitive: str
    layer: str
    direction: str
    source: str
    passed_on: int


@dataclasses.dataclass(frozen=True)
class PrecisionDebugReport:
    """What `debug_precision` found. `print(report)` shows the table.

    Attributes:
      dtype: the target dtype's name.
      loss_scale: the loss scale the gradients were judged at.
      layers: one `LayerStats` per layer and direction, in the order first seen.
      origin: the first operation that made an inf/NaN from finite inputs, or None.
      nonfinite_inputs: argument paths that already held inf/NaN (passed through from the input).
      loss: the loss value (NaN when not given, as to `PrecisionStats.report()`).
      op_errors: per layer and operation of the forward pass, the accuracy it loses in the
        target dtype (`OpError`), largest first; `debug_precision` measures them, in-program
        statistics do not.
      matmul_layers: the layers whose own operations include a matmul or convolution.
      judged: "all" when the loss ran in float32 (every operation is judged as if it ran in
        the target dtype), "target" when it already ran under a policy or `autocast` (some
        operation computed in the target dtype): then only what the policy runs in the target
        dtype is judged, and what it keeps in float32 is not.
      target_layers: with judged "target", the statistics of the values held in the target
        dtype (`layers` has all values); `advice` reads these.
      float32_layers: the layers a policy override or a `full_precision` region keeps in
        float32 (not judged; `advice` keeps them in its overrides).
    """

    dtype: str
    loss_scale: float
    layers: tuple[LayerStats, ...]
    origin: NonFiniteOrigin | None
    nonfinite_inputs: tuple[str, ...]
    loss: float
    op_errors: tuple[OpError, ...] = ()
    matmul_layers: tuple[str, ...] = ()
    judged: str = "all"
    target_layers: tuple[LayerStats, ...] = ()
    float32_layers: tuple[str, ...] = ()

    def __str__(self) -> str:
        loss = "" if math.isnan(self.loss) else f" (loss {self.loss:.6g})"
        lines = [
            f"precision of the loss's values in {self.dtype}, gradients at loss scale "
            f"{self.loss_scale:g}{loss}",
            "",
            f"{'layer':<44}{'dir':<5}{'amax':>10}{'min>0':>10}{'range':>7}"
            f"{'under%':>8}{'over%':>7}{'headroom':>9}{'nan/inf%':>9}",
        ]
        if self.judged == "target":  # what the policy keeps in float32 cannot overflow it
            lines.insert(1, f"(values the policy holds in {self.dtype}; `layers` has them all)")
        for s in self.shown_layers:
            lines.append(
                f"{s.layer[-43:]:<44}{s.direction[:3]:<5}{s.amax:>10.3g}{s.min_nonzero:>10.3g}"
                f"{s.dynamic_range:>7.1f}{100 * s.underflow:>8.2f}{100 * s.overflow:>7.2f}"
                f"{s.headroom:>9.1f}{100 * s.nonfinite:>9.1f}"
            )
        lines.append("")
        if self.origin is not None:
            o = self.origin
            lines.append(
                f"first inf/NaN: {o.primitive} in {o.layer} ({o.direction}) at {o.source}; "
                f"{o.passed_on} later operations only passed it on"
            )
        elif self.nonfinite_inputs:
            lines.append(
                "inf/NaN passed through from the input: " + ", ".join(self.nonfinite_inputs)
            )
        else:
            lines.append("no inf/NaN")
        worse = [e for e in self.op_errors if e.error > 1.0]
        if worse:
            shown = ", ".join(f"{e.primitive} in {e.layer} {e.error:.1f}u" for e in worse[:6])
            more = f" and {len(worse) - 6} more" if len(worse) > 6 else ""
            lines.append(f"ops less accurate than one rounding in {self.dtype}: {shown}{more}")
        advice = self.advice()
        lines.append(
            f"advice: overrides {advice['overrides']}, float32 islands {advice['islands']}, "
            f"loss scale {advice['loss_scale']}"
        )
        return "\n".join(lines)

    @property
    def shown_layers(self) -> tuple[LayerStats, ...]:
        """What is judged, as the table and the plot show it: `target_layers` under a policy,
        else `layers`."""
        return self.target_layers if self.judged == "target" else self.layers

    def advice(self) -> dict[str, Any]:
        """Overrides, float32 islands and a loss-scale range, from the statistics.

        Returns:
          `{"overrides": {module path: "float32"}, "islands": {module path: [operations]},
          "loss_scale": {...}}`.

          What is judged is what the policy runs in the target dtype: when the loss already
          runs under a policy (`judged == "target"`), the values and operations in the target
          dtype only; an operation the policy keeps in float32 (a norm's statistics under
          `NORMS_IN_FLOAT32`, Flax attention's softmax) is not judged in it.

          - overrides: the layers the policy already keeps in float32 (`float32_layers`) stay
            there; a layer whose activations do not fit the target dtype (an overflow,
            or more than 0.1% of their magnitude lost to underflow) goes to float32; so does
            a layer without matmuls (its own or its children's) whose values span more
            binades than the target dtype's normal range or whose operations lose more than
            one rounding there (`op_errors`): normalisation statistics, at no cost in
            half-precision matmul FLOPs. Pass the dict as it is to
            `linen.mixed_precision(..., overrides=...)` (it replaces `NORMS_IN_FLOAT32`).
          - islands: operations that lose more than one rounding (`OpError.error` > 1 u) in
            the target dtype, inside layers that also hold matmuls (or at the top level, the
            loss): they need float32 without moving the layer's matmuls out of half
            precision. `linen.mixed_precision` already runs Flax attention's softmax in
            float32; `autocast` runs sums, exp and log there; a model output cast to
            float32 (`output_dtype`) keeps the loss there.
          - loss_scale: `initial`, the largest power of two that keeps one doubling of
            headroom on every gradient the policy holds in the target dtype once these
            overrides are applied (a layer they move to float32 is not judged; where dynamic
            loss scaling settles, within a doubling or two: scaled float32 gradients do not
            overflow), and `hysteresis` 2 when the gradients span more
            binades than the target dtype can hold (some will underflow at any scale, so
            single overflows should not halve it).
        """
        finfo = jnp.finfo(self.dtype)
        normal_range = math.log2(float(finfo.max) / float(finfo.smallest_normal))

        def holds_matmuls(layer: str) -> bool:
            return any(m == layer or m.startswith(layer + "/") for m in self.matmul_layers)

        lossy: dict[str, set[str]] = {}  # layer -> operations losing more than one rounding
        for e in self.op_errors:
            if e.error > 1.0 and e.primitive not in _jaxpr.matmul_names():
                lossy.setdefault(e.layer, set()).add(e.primitive)
        judged = self.shown_layers
        overrides = {
            _module_path(layer): "float32" for layer in self.float32_layers if layer != TOP_LEVEL
        }
        for s in judged:
            if s.direction != "forward" or s.layer == TOP_LEVEL:
                continue
            does_not_fit = s.overflow > 0 or s.underflow_mass > 1e-3
            free = not holds_matmuls(s.layer) and (
                s.dynamic_range > normal_range or s.layer in lossy
            )
            if does_not_fit or free:
                overrides[_module_path(s.layer)] = "float32"
        islands = {
            (layer if layer == TOP_LEVEL else _module_path(layer)): sorted(ops)
            for layer, ops in lossy.items()
            if (layer == TOP_LEVEL or holds_matmuls(layer)) and _module_path(layer) not in overrides
        }

        def overridden(layer: str) -> bool:
            path = _module_path(layer)
            return any(path == o or path.startswith(o + "/") for o in overrides)

        # The gradients that stay in the target dtype once these overrides are applied.
        backward = [
            s
            for s in judged
            if s.direction == "backward"
            and s.amax > 0
            and (s.layer == TOP_LEVEL or not overridden(s.layer))
        ]
        if backward:
            amax = max(s.amax for s in backward)  # gradients of the unscaled loss
            initial = 2.0 ** math.floor(math.log2(float(finfo.max) / 2 / amax))
            span = max(s.dynamic_range for s in backward)
            scale = {"initial": initial, "hysteresis": 2 if span > normal_range - 1 else 1}
        else:
            scale = {"initial": 1.0, "hysteresis": 1}
        return {"overrides": overrides, "islands": islands, "loss_scale": scale}

    def plot(self, path: str | pathlib.Path) -> pathlib.Path:
        """Writes a heat map (layers x statistics) to `path` (a PNG); needs matplotlib."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        columns = ("underflow %", "overflow %", "non-finite %", "headroom", "range")
        rows = [
            [
                100 * s.underflow,
                100 * s.overflow,
                100 * s.nonfinite,
                s.headroom,
                s.dynamic_range,
            ]
            for s in self.shown_layers
        ]
        data = np.asarray(rows, np.float64).reshape(len(rows), len(columns))
        shown = data / np.maximum(np.abs(data).max(axis=0, keepdims=True), 1e-12)
        fig, ax = plt.subplots(figsize=(8, 0.3 * len(rows) + 1.5))
        ax.imshow(shown, aspect="auto", cmap="magma")
        ax.set_xticks(range(len(columns)), columns)
        labels = [
            f"{(s.layer if s.layer == TOP_LEVEL else _module_path(s.layer))[-44:]} "
            f"({s.direction[:3]})"
            for s in self.shown_layers
        ]  # without the root module's name, which every row shares
        ax.set_yticks(range(len(rows)), labels)
        for (i, j), value in np.ndenumerate(data):
            ax.text(j, i, f"{value:.3g}", ha="center", va="center", fontsize=7, color="grey")
        ax.set_title(f"{self.dtype}, gradients at loss scale {self.loss_scale:g}")
        fig.tight_layout()
        path = pathlib.Path(path)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


_module_path = _jaxpr.relative
# Name-stack parts that are not modules (JAX names a remat's recomputation `rematted_computation`).
_MARKERS = (FLOAT32_ISLAND, FULL_PRECISION_REGION, "rematted_computation")
_WRAPPERS = re.compile(r"^(?:[a-z_]+\()+")  # transpose(, jvp(, vmap(: transforms, not modules


def _layer_and_direction(name_stack: str, gradient: bool | None = None) -> tuple[str, str]:
    backward = "transpose(" in name_stack if gradient is None else gradient
    return _jaxpr.module_path(name_stack, _MARKERS), ("backward" if backward else "forward")


def _once(name_stack: str) -> str:
    """An operation's own name stack with JAX's repetition around a remat's backward pass
    taken out: `transpose(jvp(ckpt))/jvp(ckpt)`, or `ckpt/ckpt` under autocast, is `ckpt`.
    (A module inside a module of the same name, its whole own stack `a/a`, is named `a`
    too: the price of reading the name stack alone.)"""
    parts = name_stack.split("/")
    half = len(parts) // 2
    bare = [_WRAPPERS.sub("", p).rstrip(")") for p in parts]
    if len(parts) % 2 == 0 and half > 0 and bare[:half] == bare[half:]:
        return "/".join(parts[:half])
    return name_stack


def _float32_island(name_stack: str) -> str | None:
    """The layer an override keeps in float32 around this operation; "" inside a
    `full_precision` region (kept there by the region, not by an override); None outside."""
    if FLOAT32_ISLAND in name_stack:
        return _layer_and_direction(name_stack[: name_stack.index(FLOAT32_ISLAND)])[0]
    return "" if FULL_PRECISION_REGION in name_stack else None


def _source(eqn: Any) -> str:
    tb = eqn.source_info.traceback
    if tb is None:
        return "(unknown)"
    for frame in tb.frames:
        name = frame.file_name.replace("\\", "/")
        if not is_library_file(name):
            return f"{frame.file_name}:{frame.line_num}"
    return "(library code)"


# A masking constant, not data: what models write where attention may not look (float32's
# lowest value as Flax does, -2.38e38, -1e30, -1e9 * 1e30, -inf...) is 1e30 or more in
# magnitude, or exactly its dtype's largest value (float16's -65504, in float16 or cast up to
# float32 for a softmax). Left out of every statistic and op error, and so are the values an
# operation derives from one near the target dtype's edge (-65504 minus the row maximum).
_MASK_MAGNITUDE = 1e30
_FLOAT16_LARGEST = 65504.0


def _masks(magnitude: Any, dtype: Any) -> Any:
    """Where `magnitude` (|x|, finite) is a masking constant for values of `dtype`."""
    largest = float(jnp.finfo(dtype).max) if jnp.issubdtype(dtype, jnp.floating) else math.inf
    return (magnitude >= _MASK_MAGNITUDE) | (magnitude == largest) | (magnitude == _FLOAT16_LARGEST)


def _is_float_value(v: Any) -> bool:
    """A floating array, NumPy scalar or Python float, or a literal's value (JAX 0.8 keeps
    those in an array type of its own)."""
    if isinstance(v, float) or is_floating_array(v):
        return True
    dtype = getattr(v, "dtype", None)
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.floating))


def _carries_mask(values: Sequence[Any]) -> bool:
    """Whether some floating value (a literal too) holds a masking constant or an infinity."""
    return any(
        bool((np.isinf(m) | _masks(m, np.asarray(v).dtype)).any())
        for v in values
        if _is_float_value(v)
        for m in [np.abs(np.asarray(v, np.float64))]
    )


class _Accumulator:
    def __init__(self, dtype: np.dtype, loss_scale: float, under_policy: bool = False):
        finfo = jnp.finfo(dtype)
        self.max, self.tiny = float(finfo.max), float(finfo.smallest_normal)
        self.dtype, self.unit_roundoff = dtype, float(finfo.eps) / 2
        self.loss_scale = loss_scale
        self.under_policy = under_policy
        self.stats: dict[tuple[str, str], list] = {}
        self.target_stats: dict[tuple[str, str], list] = {}  # values held in the target dtype
        self.op_errors: dict[tuple[str, str], float] = {}
        self.matmul_layers: set[str] = set()
        self.float32_layers: set[str] = set()

    def rerun(self, eqn: Any, invals: list, outs: list) -> list | None:
        """`eqn` run again in the other precision (None: it is not judged).

        Under a policy, an operation that computed in the target dtype runs again with its
        inputs widened to float32; otherwise an operation on wider inputs runs again with them
        rounded to the target dtype. Works on traced values (`_Collector`).
        """
        floating_out = [o for o in outs if is_floating_array(o)]
        if not floating_out or eqn.primitive.name == "convert_element_type":
            return None  # a cast only rounds (an overflow shows as an inf it made)
        if self.under_policy:
            change = [is_floating_array(v) and jnp.dtype(v.dtype) == self.dtype for v in invals]
            if not any(o.dtype == self.dtype for o in floating_out):
                return None  # computed in float32 by the policy
            into = jnp.dtype(jnp.float32)
        else:
            change = [
                is_floating_array(v) and jnp.dtype(v.dtype).itemsize > self.dtype.itemsize
                for v in invals
            ]
            into = self.dtype
        if not any(change):
            return None
        updates = {}
        if eqn.params.get("preferred_element_type") is not None:
            updates["preferred_element_type"] = into
        cast = [
            jnp.asarray(v).astype(into) if c else v for v, c in zip(invals, change, strict=True)
        ]
        try:
            return _jaxpr.bind(eqn, cast, **updates)
        except (TypeError, ValueError, NotImplementedError):
            return None  # no kernel in the target dtype: autocast runs such ops in float32

    def op_error(
        self,
        layer: str,
        eqn: Any,
        invals: list,
        outs: list,
        island: str | None,
        rerun: list | None,
    ) -> None:
        """How much accuracy `eqn` loses in the target dtype, against float32, from `rerun`
        (`self.rerun`'s result). Inside a float32 island nothing is judged."""
        if _jaxpr.is_matmul(eqn):
            self.matmul_layers.add(layer)
        if island is not None:
            if island:
                self.float32_layers.add(island)
            return
        if rerun is None:
            return
        full, low = (rerun, outs) if self.under_policy else (outs, rerun)
        # A float16 mask (its lowest value) carried on by `x - max` overflows to -inf there:
        # near the target's edge, values derived from a mask are masks too.
        edge = self.max if _carries_mask(invals) else None
        key = (layer, eqn.primitive.name)
        error = _relative_error(full, low, self.unit_roundoff, edge)
        self.op_errors[key] = max(self.op_errors.get(key, 0.0), error)

    def add(
        self,
        key: tuple[str, str],
        value: np.ndarray,
        island: str | None = None,
        from_mask: bool = False,
    ) -> None:
        """Counts `value`; `from_mask`: its operation's inputs held a mask."""
        self._add(self.stats, key, value, from_mask)
        if self.under_policy and island is None and jnp.dtype(value.dtype) == self.dtype:
            self._add(self.target_stats, key, value, from_mask)

    def _add(self, stats: dict, key: tuple[str, str], value: np.ndarray, from_mask: bool) -> None:
        x = np.abs(np.asarray(value, np.float64)).ravel()
        finite = np.isfinite(x)
        # A masking constant (Flax's `jnp.finfo(jnp.float32).min` for -inf, a model's -2.38e38)
        # is not data: it would count as an overflow that compute-dtype masking never makes.
        # An infinity the model wrote (`where(mask, x, -inf)`) is a mask too; NaN is not.
        masked = (finite & _masks(x, value.dtype)) | np.isinf(x)
        if from_mask:
            masked |= finite & (x >= self.max / 2)
        xf = x[finite & ~masked]
        nonzero = xf[xf > 0]
        scaled = nonzero * (self.loss_scale if key[1] == "backward" else 1.0)
        s = stats.setdefault(key, [0, 0.0, math.inf, 0, 0, 0, 0, 0.0, 0.0])
        s[0] += x.size - int(masked.sum())
        s[7] += float(nonzero[scaled < self.tiny].sum())
        s[8] += float(nonzero.sum())
        s[1] = max(s[1], float(xf.max()) if xf.size else 0.0)
        s[2] = min(s[2], float(nonzero.min()) if nonzero.size else math.inf)
        s[3] += int((scaled < self.tiny).sum())
        s[4] += int((scaled > self.max).sum())
        s[5] += int(nonzero.size)
        s[6] += int((~finite & ~masked).sum())

    def layers(self, target: bool = False) -> tuple[LayerStats, ...]:
        return _layer_stats(self.target_stats if target else self.stats, self.max, self.loss_scale)


def _relative_error(full: list, low: list, unit_roundoff: float, mask_edge: float | None) -> float:
    """The largest relative L2 error of `low` against `full`, in unit roundoffs (inf: overflow).

    Masking constants in `full` are left out, and with `mask_edge` (the inputs carried a mask)
    so is any value within a doubling of it.
    """
    error = 0.0
    for f_out, l_out in zip(full, low, strict=True):
        if not is_floating_array(f_out):
            continue
        f = np.asarray(f_out, np.float64)
        h = np.asarray(l_out, np.float64)
        kept = np.isfinite(f) & ~_masks(np.abs(f), f_out.dtype)
        if mask_edge is not None:
            kept &= (np.abs(f) < mask_edge / 2) & (np.abs(h) < mask_edge / 2)
        if not kept.any():
            continue
        diff = h[kept] - f[kept]
        norm = float(np.linalg.norm(f[kept]))
        if not np.isfinite(diff).all():
            error = math.inf
        elif norm > 0:
            error = max(error, float(np.linalg.norm(diff)) / norm / unit_roundoff)
    return error


def _hoisted(layers: Iterable[str]) -> dict[str, str]:
    """{name: full name} for the layers named relative to a loop: JAX moves a loop body's
    operations that do not depend on the loop (e.g. a weight's transpose) out of it, keeping
    their names relative to the loop (`cell` for `RNN/cell`). Each is the one layer whose
    name ends with it; where there is none, or more than one, it keeps its name."""
    names = set(layers) - {TOP_LEVEL}
    found = {}
    for name in names:
        holders = [n for n in names if n.endswith("/" + name)]
        if len(holders) == 1:
            found[name] = holders[0]
    return found


def _renamed(layers: Iterable[str], hoisted: dict[str, str]) -> tuple[str, ...]:
    return tuple(sorted({hoisted.get(layer, layer) for layer in layers}))


# How each column of the raw statistics combines: counts and magnitudes add, amax and min>0
# take the larger and the smaller.
_COLUMNS = (sum, max, min) + (sum,) * 6


def _layer_stats(raw: dict, largest: float, loss_scale: float) -> tuple[LayerStats, ...]:
    """`LayerStats` from accumulated
    `[count, amax, min>0, under, over, nonzero, non-finite, underflowing magnitude, magnitude]`,
    a layer named relative to a loop counted in its full name (`_hoisted`)."""
    hoisted = _hoisted(layer for layer, _ in raw)
    merged: dict[tuple[str, str], list] = {}
    for (layer, direction), columns in raw.items():
        key: tuple[str, str] = (hoisted[layer] if layer in hoisted else layer, direction)
        if key in merged:
            columns = [f((a, b)) for f, a, b in zip(_COLUMNS, merged[key], columns, strict=True)]
        merged[key] = list(columns)
    out = []
    for (layer, direction), columns in merged.items():
        count, amax, low, under, over, nonzero, bad, lost, mass = columns
        scale = loss_scale if direction == "backward" else 1.0
        headroom = math.log2(largest / (amax * scale)) if amax > 0 else math.inf
        finite_count = count - bad
        out.append(
            LayerStats(
                layer=layer,
                direction=direction,
                count=int(count),
                amax=amax,
                min_nonzero=low,
                dynamic_range=math.log2(amax / low) if amax > 0 and low < math.inf else 0.0,
                underflow=under / nonzero if nonzero else 0.0,
                overflow=over / finite_count if finite_count else 0.0,
                headroom=math.floor(headroom) if math.isfinite(headroom) else headroom,
                nonfinite=bad / count if count else 0.0,
                underflow_mass=lost / mass if mass > 0 else 0.0,
            )
        )
    return tuple(out)


def _all_finite(values: Sequence[Any]) -> bool:
    # Python floats too: a literal -inf (a mask the model wrote) is an inf passed on, not made.
    return all(
        bool(np.isfinite(np.asarray(v, np.float64)).all()) for v in values if _is_float_value(v)
    )


class _Interpreter:
    """Runs a jaxpr equation by equation (calls inlined); `_record` sees each operation."""

    def run(
        self,
        jaxpr: Any,
        consts: Sequence[Any],
        args: Sequence[Any],
        stack: str,
        cotangent: Sequence[bool] | None = None,
        literal: Sequence[bool] | None = None,
    ) -> list:
        """Runs `jaxpr`, recording every operation on data.

        With `cotangent` (which `args` carry the pullback's seed), an operation is backward when
        its inputs carry it (a gradient), forward otherwise, whatever its name stack says (a
        weight cast again for the backward pass is not a gradient). An operation on literals
        alone (a mask or a placeholder the program builds from constants) is left out of the
        statistics; an inf/NaN it makes from finite values is still one.
        `literal` says which `args` come from literals alone. `self.flags_out` says, for each
        output, (carries the seed, comes from literals alone).
        """
        seeded: set = set()  # variables that carry the pullback's seed
        constant: set = set()  # variables computed from literals alone

        def flags(v) -> tuple[bool, bool]:
            if isinstance(v, jcore.Literal):
                return False, True
            return v in seeded, v in constant

        def mark(variables, marks):
            for v, (seed, const) in zip(variables, marks, strict=True):
                if seed:
                    seeded.add(v)
                if const:
                    constant.add(v)

        mark(
            jaxpr.invars,
            zip(cotangent or [False] * len(args), literal or [False] * len(args), strict=True),
        )

        def rule(eqn: Any, invals: list) -> list:
            in_flags = [flags(v) for v in eqn.invars]
            gradient = any(f[0] for f in in_flags) if cotangent is not None else None
            from_literals = all(f[1] for f in in_flags)
            own = _once(str(eqn.source_info.name_stack))
            here = "/".join(p for p in (stack, own) if p)
            sub = _jaxpr.inlined_body(eqn)
            if sub is not None:
                if eqn.params.get("name") == FULL_PRECISION_REGION:
                    here = f"{here}/{FULL_PRECISION_REGION}"  # `autocast.full_precision`
                n = len(getattr(sub, "jaxpr", sub).invars)
                outs = self.call(sub, invals[:n], in_flags[:n], here, cotangent is not None)
                mark(eqn.outvars, self.flags_out)
                return outs
            structured = self._structured(eqn, invals, in_flags, here, cotangent is not None)
            if structured is not None:
                mark(eqn.outvars, self.flags_out)
                return structured
            outs = _jaxpr.bind(eqn, invals)
            self._record(eqn, here, invals, outs, gradient, from_literals)
            mark(eqn.outvars, [(bool(gradient), from_literals)] * len(eqn.outvars))
            return outs

        outs = _jaxpr.evaluate(jaxpr, consts, args, rule)
        self.flags_out = [flags(v) for v in jaxpr.outvars]
        return outs

    def call(
        self,
        sub: Any,
        args: Sequence[Any],
        flags: Sequence[tuple[bool, bool]],
        here: str,
        seeded: bool,
    ) -> list:
        """Runs the (closed) jaxpr `sub` on `args` whose `(seeded, literal)` flags are `flags`;
        `self.flags_out` then holds its outputs' flags."""
        inner = getattr(sub, "jaxpr", sub)
        consts = list(getattr(sub, "consts", []))
        cotangent = [f[0] for f in flags] if seeded else None
        return self.run(inner, consts, list(args), here, cotangent, [f[1] for f in flags])

    def _structured(
        self, eqn: Any, invals: list, in_flags: list, here: str, seeded: bool
    ) -> list | None:
        """A loop or branch (`scan`, `while`, `cond`) run by the interpreter, its body's operations
        recorded one by one; None: bound as one operation."""
        return None

    def _record(
        self,
        eqn: Any,
        stack: str,
        invals: list,
        outs: list,
        gradient: bool | None = None,
        from_literals: bool = False,
    ) -> None:
        raise NotImplementedError


class _Host:
    """Records operations with their values on the host: statistics, op errors, the first
    inf/NaN."""

    def __init__(self, acc: _Accumulator):
        self.acc = acc
        self.origin: NonFiniteOrigin | None = None
        self.passed_on = 0

    def record(
        self,
        eqn: Any,
        key: tuple[str, str],
        island: str | None,
        from_literals: bool,
        invals: list,
        outs: list,
        rerun: list | None,
    ) -> None:
        floats = [o for o in outs if is_floating_array(o)]
        from_mask = _carries_mask(invals)
        if not from_literals:
            for value in floats:
                self.acc.add(key, value, island, from_mask)
            if key[1] == "forward":
                self.acc.op_error(key[0], eqn, invals, outs, island, rerun)
        if not floats or _all_finite(floats):
            return
        # A mask (1e30 or more, or its dtype's largest value) cast to or carried into a dtype
        # that cannot hold it becomes -inf: still a mask, not an overflow. A NaN is never one.
        mask_carried = from_mask and not any(
            np.isnan(np.asarray(o, np.float64)).any() for o in floats
        )
        if _all_finite(invals) and not mask_carried:
            if self.origin is None:
                self.origin = NonFiniteOrigin(eqn.primitive.name, key[0], key[1], _source(eqn), 0)
        else:
            self.passed_on += 1


def _merge_flags(runs: Sequence[Sequence[tuple[bool, bool]]]) -> list[tuple[bool, bool]]:
    """The flags of values that may come from any of `runs` (loop iterations, branches): seeded
    if any run's is, from literals alone if every run's is."""
    return [(any(f[0] for f in fs), all(f[1] for f in fs)) for fs in zip(*runs, strict=True)]


class _Collector(_Interpreter):
    """Runs the program once under `jax.jit`, keeping what `_Interpreter._record` reads (every
    recorded operation's inputs, outputs and re-run outputs) as outputs of that one program;
    `replay` then records them on the host. One compile instead of one per operation.

    Loops and branches are descended into, so the layers inside them are named and judged
    operation by operation, and a loop's carry is never cast: a `scan` is unrolled; a `cond`
    runs every branch, and only the taken one's operations are recorded; a `while` loop runs
    as many times as it ran in the program, which a first run with a counter tells
    (`trip_counts`, keyed by where the loop sits; `pending` lists those still unknown)."""

    def __init__(self, acc: _Accumulator, trip_counts: dict | None = None):
        self.acc = acc
        self.records: list = []
        self.kept: list = []
        self._index: dict[int, int] = {}
        self.trip_counts = trip_counts or {}
        self.pending: dict[tuple, int] = {}  # a while loop's place -> its counter in `kept`
        self._guards: list[tuple[int, int]] = []  # (branch index in `kept`, this branch)
        self._place: list[tuple] = []  # the loop iterations and branches around this point
        self._seen: dict[tuple, int] = {}

    def _where(self, eqn: Any) -> tuple:
        """Where this run of `eqn` sits: the same in every run of the program."""
        key = (*self._place, id(eqn))
        self._seen[key] = self._seen.get(key, -1) + 1
        return (*key, self._seen[key])

    def _structured(
        self, eqn: Any, invals: list, in_flags: list, here: str, seeded: bool
    ) -> list | None:
        name = eqn.primitive.name
        if name not in ("scan", "while", "cond"):
            return None
        p, where = eqn.params, self._where(eqn)
        if name == "cond":
            index, runs, flags = invals[0], [], []
            if not isinstance(index, jax.Array):  # a literal: only that branch can run
                taken = int(np.clip(int(index), 0, len(p["branches"]) - 1))
                return self.call(p["branches"][taken], invals[1:], in_flags[1:], here, seeded)
            for b, branch in enumerate(p["branches"]):
                self._guards.append((self._keep(index)[1], b))
                self._place.append((where, b))
                runs.append(self.call(branch, invals[1:], in_flags[1:], here, seeded))
                flags.append(self.flags_out)
                self._place.pop()
                self._guards.pop()
            self.flags_out = _merge_flags(flags)
            if len(runs) == 1:
                return runs[0]
            return [jax.lax.select_n(index, *values) for values in zip(*runs, strict=True)]
        if name == "scan":
            nc, nk, length = p["num_consts"], p["num_carry"], p["length"]
            consts, carry, xs = invals[:nc], invals[nc : nc + nk], invals[nc + nk :]
            carry_flags, xs_flags = in_flags[nc : nc + nk], in_flags[nc + nk :]
            ys, ys_flags = [], []
            for i in reversed(range(length)) if p["reverse"] else range(length):
                self._place.append((where, i))
                outs = self.call(
                    p["jaxpr"],
                    [*consts, *carry, *(x[i] for x in xs)],
                    [*in_flags[:nc], *carry_flags, *xs_flags],
                    here,
                    seeded,
                )
                self._place.pop()
                carry, carry_flags = outs[:nk], self.flags_out[:nk]
                ys.append(outs[nk:])
                ys_flags.append(self.flags_out[nk:])
            if p["reverse"]:
                ys.reverse()
            empty = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in eqn.outvars[nk:]]
            stacked = [jnp.stack(y) for y in zip(*ys, strict=True)] if ys else empty
            self.flags_out = [
                *carry_flags,
                *(_merge_flags(ys_flags) if ys else in_flags[nc + nk :]),
            ]
            return [*carry, *stacked]
        # while: cond_consts, body_consts, carry.
        cc, bc = p["cond_nconsts"], p["body_nconsts"]
        cond_consts, body_consts, carry = invals[:cc], invals[cc : cc + bc], invals[cc + bc :]
        if where not in self.trip_counts:
            # Not known yet: run it whole, with a counter, for the next run of the program.
            outs = _jaxpr.bind(eqn, invals)
            self.pending[where] = self._keep(_trip_count(p, cond_consts, body_consts, carry))[1]
            self.flags_out = list(in_flags[cc + bc :])  # this run is not recorded
            return list(outs)
        carry_flags = in_flags[cc + bc :]
        for i in range(self.trip_counts[where]):
            self._place.append((where, i))
            carry = self.call(
                p["body_jaxpr"],
                [*body_consts, *carry],
                [*in_flags[cc : cc + bc], *carry_flags],
                here,
                seeded,
            )
            self._place.pop()
            carry_flags = self.flags_out
        self.flags_out = carry_flags
        return list(carry)

    def _keep(self, value: Any) -> tuple[bool, Any]:
        if isinstance(value, jax.Array):  # traced (or a constant): an output of the program
            if id(value) not in self._index:
                self._index[id(value)] = len(self.kept)
                self.kept.append(value)  # kept alive: ids stay unique
            return True, self._index[id(value)]
        return False, value

    def _record(
        self,
        eqn: Any,
        stack: str,
        invals: list,
        outs: list,
        gradient: bool | None = None,
        from_literals: bool = False,
    ) -> None:
        key = _layer_and_direction(stack, gradient)
        island = _float32_island(stack)
        judged = not from_literals and key[1] == "forward" and island is None
        rerun = self.acc.rerun(eqn, invals, outs) if judged else None
        self.records.append(
            (
                tuple(self._guards),
                eqn,
                key,
                island,
                from_literals,
                [self._keep(v) for v in invals],
                [self._keep(o) for o in outs],
                None if rerun is None else [self._keep(r) for r in rerun],
            )
        )

    def replay(self, kept: Sequence[Any]) -> _Host:
        """Records every operation with the program's values, in program order."""
        host = _Host(self.acc)

        def get(refs: list) -> list:
            return [kept[v] if traced else v for traced, v in refs]

        for guards, eqn, key, island, from_literals, invals, outs, rerun in self.records:
            if any(int(np.asarray(kept[index])) != branch for index, branch in guards):
                continue  # a branch the program did not take
            rerun = None if rerun is None else get(rerun)
            host.record(eqn, key, island, from_literals, get(invals), get(outs), rerun)
        return host


def _trip_count(params: dict, cond_consts: list, body_consts: list, carry: list) -> jax.Array:
    """How many times the `while` loop of `params` runs from `carry`."""
    cond, body = params["cond_jaxpr"], params["body_jaxpr"]

    def go_on(state):
        return eval_jaxpr(cond.jaxpr, cond.consts, *cond_consts, *state[1])[0]

    def step(state):
        return state[0] + 1, eval_jaxpr(body.jaxpr, body.consts, *body_consts, *state[1])

    return jax.lax.while_loop(go_on, step, (jnp.zeros((), jnp.int32), list(carry)))[0]


def _target_dtype(dtype: DTypeLike) -> np.dtype:
    try:
        target = jnp.dtype(dtype)
    except TypeError:
        target = None
    allowed = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float32")
    if target is None or target.name not in allowed:
        raise TypeError(f"Expected one of {allowed} for `dtype`, got {dtype!r}.")
    return target


def _with_seed(
    fun: Callable[..., Any], args: Sequence[Any], argnums: int | Sequence[int], has_aux: bool
) -> tuple[Any, list, list[bool], Any]:
    """`jax.value_and_grad(fun, argnums, has_aux)(*args)` as a jaxpr whose last input is the
    pullback's seed (a one): what carries it is a gradient, the rest is forward.

    Returns the closed jaxpr, its inputs, which inputs are the seed, and the shapes of its
    outputs `(value, grads)` (`((value, aux), grads)` with `has_aux`)."""
    diff = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    def value_and_pullback(args, seed):
        def of_diff(*chosen):
            full = list(args)
            for i, value in zip(diff, chosen, strict=True):
                full[i] = value
            return fun(*full)

        value, pullback, *aux = jax.vjp(of_diff, *(args[i] for i in diff), has_aux=has_aux)
        if jnp.shape(value) != () or not jnp.issubdtype(jnp.result_type(value), jnp.floating):
            raise TypeError(f"Expected `loss_fn` to return a floating scalar, got {value}.")
        grads = pullback(seed.astype(jnp.result_type(value)))  # the cast carries the seed too
        return (value, *aux) if has_aux else value, grads[0] if isinstance(argnums, int) else grads

    seed = jnp.ones((), jnp.float32)
    with _naming.module_names():  # NNX and Equinox modules named by their paths
        closed, shapes = jax.make_jaxpr(value_and_pullback, return_shape=True)(list(args), seed)
    flat = [*jax.tree.leaves(list(args)), seed]
    return closed, flat, [False] * (len(flat) - 1) + [True], shapes


def debug_precision(
    loss_fn: Callable[..., Any],
    *args: Any,
    dtype: DTypeLike = "float16",
    loss_scale: float = 1.0,
    argnums: int | Sequence[int] = 0,
) -> PrecisionDebugReport:
    """Per-layer statistics of `loss_fn(*args)`'s forward and backward pass in a target dtype.

    Traces `jax.value_and_grad(loss_fn, argnums)` (with the pullback's seed as an input, so
    that what carries it is the backward pass) and runs it as one compiled program that
    returns every intermediate value, and each judged operation again in the other precision
    (use small example inputs: every value is kept). NNX and Equinox
    modules called while it traces are named by their paths (see `jmp_policy._naming`).

    Args:
      loss_fn: a scalar loss, e.g. `lambda p, x, y: loss(model.apply({"params": p}, x), y)`; it
        may already run under a policy or `autocast`: then only what runs in `dtype` is judged
        (`PrecisionDebugReport.judged`).
      *args: its example arguments: pytrees (NNX modules and states, Equinox modules); leaves
        that are not arrays (an activation function, a flag) are passed as they are.
      dtype: the dtype the values are judged against: "float16", "bfloat16",
        "float8_e4m3fn" or "float8_e5m2".
      loss_scale: the loss scale the gradients are judged at (forward values are not scaled).
      argnums: which arguments the gradients are taken of.

    Returns:
      A `PrecisionDebugReport`: `print` it, `.advice()`, `.plot(path)`.

    Raises:
      TypeError: `dtype` is not one of those, or `loss_fn` does not return a scalar.
      ValueError: `loss_scale` is not a positive finite number.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jmp_policy as jmp
      >>> # exp(12) = 162755 does not fit in float16 (largest 65504): 3 doublings too many.
      >>> report = jmp.debug_precision(lambda w, x: jnp.sum(jnp.exp(x * w)), 12.0, jnp.ones(3))
      >>> [(s.direction, round(s.amax), s.headroom) for s in report.layers]
      [('forward', 488264, -3), ('backward', 488264, -3)]
      >>> report.advice()["loss_scale"]
      {'initial': 0.0625, 'hysteresis': 1}
    """
    target = _target_dtype(dtype)
    if not (isinstance(loss_scale, (int, float)) and loss_scale > 0 and math.isfinite(loss_scale)):
        raise ValueError(f"Expected a positive finite number for `loss_scale`, got {loss_scale!r}.")
    # An argument that is a number is an array; inside a pytree, leaves that are not arrays (an
    # Equinox module's activation function, a flag) are passed as they are, as
    # `eqx.filter_jit` does.
    args = tuple(jnp.asarray(a) if isinstance(a, (int, float)) else a for a in args)
    leaves = jax.tree_util.tree_leaves_with_path(args)
    bad_inputs = tuple(
        f"args{jax.tree_util.keystr(path)}"
        for path, leaf in leaves
        if is_traced_leaf(leaf) and is_floating_array(leaf) and not _all_finite([leaf])
    )
    split = [split_traced(a) for a in args]

    def on_arrays(*arrays):
        return loss_fn(*(rebuild(a) for a, (_, rebuild) in zip(arrays, split, strict=True)))

    arrays = [traced for traced, _ in split]
    closed, flat, cotangent, _ = _with_seed(on_arrays, arrays, argnums, has_aux=False)
    under_policy = target != jnp.float32 and _computes_in(closed.jaxpr, target)
    acc = _Accumulator(target, float(loss_scale), under_policy)
    trip_counts: dict = {}
    while True:  # once, or again while `while` loops inside it have trip counts to learn
        collector = _Collector(acc, trip_counts)

        def program(flat, collector=collector):
            # Constants (a mask literal) are cast with NumPy while this traces: one beyond the
            # target dtype's range becomes inf there, as it does in the program, unwarned.
            with np.errstate(over="ignore"):
                outs = collector.run(closed.jaxpr, closed.consts, flat, "", cotangent)
            return outs, collector.kept

        # Inputs rounded to the target dtype must stay rounded inside the one program.
        compiled = jax.jit(program).lower(flat).compile({"xla_allow_excess_precision": False})
        outs, kept = compiled(flat)
        if not collector.pending:
            break
        trip_counts.update({k: int(kept[i]) for k, i in collector.pending.items()})
    host = collector.replay(kept)
    hoisted = _hoisted(layer for layer, _ in acc.stats)
    origin = host.origin
    if origin is not None:
        layer = hoisted.get(origin.layer, origin.layer)
        origin = dataclasses.replace(origin, layer=layer, passed_on=host.passed_on)
    errors: dict[tuple[str, str], float] = {}
    for (layer, op), error in acc.op_errors.items():
        key = (hoisted.get(layer, layer), op)
        errors[key] = max(error, errors.get(key, 0.0))
    measured = [OpError(layer, op, error) for (layer, op), error in errors.items()]
    op_errors = tuple(sorted(measured, key=lambda e: -e.error))
    return PrecisionDebugReport(
        dtype=target.name,
        loss_scale=float(loss_scale),
        layers=acc.layers(),
        origin=origin,
        nonfinite_inputs=bad_inputs,
        loss=float(np.asarray(outs[0])),
        op_errors=op_errors,
        matmul_layers=_renamed(acc.matmul_layers, hoisted),
        judged="target" if under_policy else "all",
        target_layers=acc.layers(target=True),
        float32_layers=_renamed(acc.float32_layers, hoisted),
    )


def _computes_in(jaxpr: Any, dtype: np.dtype) -> bool:
    """Whether some operation of `jaxpr` (or of a program inside it) outputs `dtype` values."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "convert_element_type" and any(
            getattr(v.aval, "dtype", None) == dtype for v in eqn.outvars
        ):
            return True
        if any(
            _computes_in(getattr(sub, "jaxpr", sub), dtype) for sub in jaxprs_in_params(eqn.params)
        ):
            return True
    return False


@register_state
@dataclasses.dataclass(frozen=True)
class PrecisionStats:
    """Per-layer statistics of a loss's forward values and gradients, computed inside the program.

    Made by `value_and_grad_with_stats` (under `jit`, no host sync); `report()` reads them on
    the host as a `PrecisionDebugReport` (`print` it, `.advice()`, `.plot(path)`). One float32
    vector per statistic, one entry per `(layer, direction)` in `keys`.

    Attributes:
      collected: bool scalar: whether this call collected them (False: zeros).
      count: how many values (masking constants left out).
      amax: the largest finite magnitude.
      min_nonzero: the smallest nonzero finite magnitude (inf if none).
      underflow: how many nonzero values are below `dtype`'s smallest normal.
      overflow: how many finite values are above `dtype`'s largest value.
      nonzero: how many values are nonzero and finite.
      nonfinite: how many values are inf or NaN.
      underflow_magnitude: the summed magnitude of the values that underflow.
      magnitude: the summed magnitude of the nonzero finite values.
      keys: `((module path, "forward" | "backward"), ...)` (static); under a policy, also
        `(module path, direction, "target")` for the values held in the target dtype.
      dtype: the target dtype's name (static).
      matmul_layers: the layers whose own forward operations include a matmul or
        convolution (static; `PrecisionDebugReport.advice` keeps them out of its
        overrides unless their values do not fit).
      judged: "target" when the program already runs under a policy (static; see
        `PrecisionDebugReport.judged`), else "all".
      float32_layers: the layers a policy override keeps in float32 (static).
    """

    collected: jax.Array
    count: jax.Array
    amax: jax.Array
    min_nonzero: jax.Array
    underflow: jax.Array
    overflow: jax.Array
    nonzero: jax.Array
    nonfinite: jax.Array
    underflow_magnitude: jax.Array
    magnitude: jax.Array
    keys: tuple = dataclasses.field(metadata=dict(static=True))
    dtype: str = dataclasses.field(metadata=dict(static=True))
    matmul_layers: tuple = dataclasses.field(default=(), metadata=dict(static=True))
    judged: str = dataclasses.field(default="all", metadata=dict(static=True))
    float32_layers: tuple = dataclasses.field(default=(), metadata=dict(static=True))

    def report(self, loss: float = math.nan) -> PrecisionDebugReport:
        """The statistics as a `PrecisionDebugReport` (host-side; gradients judged as computed).

        Args:
          loss: the step's loss, shown in the report's heading.

        Raises:
          ValueError: these statistics were not collected (`collected` is False), or are
            batched.
        """
        if not bool(np.asarray(jax.device_get(self.collected)).all()):
            raise ValueError(
                "These PrecisionStats were not collected (`collected` is False): read the ones "
                "returned by a call with `collect=True`."
            )
        if np.shape(self.amax) != (len(self.keys),):
            raise ValueError(
                f"Expected one call's statistics (vectors of {len(self.keys)}), got shape "
                f"{np.shape(self.amax)}: index a batched or stacked PrecisionStats first."
            )
        columns = [
            np.asarray(jax.device_get(c), np.float64)
            for c in (
                self.count,
                self.amax,
                self.min_nonzero,
                self.underflow,
                self.overflow,
                self.nonzero,
                self.nonfinite,
                self.underflow_magnitude,
                self.magnitude,
            )
        ]
        raw = {key: [float(c[i]) for c in columns] for i, key in enumerate(self.keys)}
        largest = float(jnp.finfo(self.dtype).max)
        hoisted = _hoisted(k[0] for k in raw)
        return PrecisionDebugReport(
            dtype=self.dtype,
            loss_scale=1.0,
            layers=_layer_stats({k: v for k, v in raw.items() if len(k) == 2}, largest, 1.0),
            origin=None,
            nonfinite_inputs=(),
            loss=float(loss),
            matmul_layers=_renamed(self.matmul_layers, hoisted),
            judged=self.judged,
            target_layers=_layer_stats(
                {k[:2]: v for k, v in raw.items() if len(k) == 3}, largest, 1.0
            ),
            float32_layers=_renamed(self.float32_layers, hoisted),
        )


# How each of the nine columns combines: counts and magnitudes add, amax and min>0 do not.
_COMBINE = (jnp.add, jnp.maximum, jnp.minimum) + (jnp.add,) * 6


class _InProgram(_Interpreter):
    """Runs a jaxpr on traced values, accumulating `PrecisionStats` columns with jnp."""

    def __init__(self, dtype: np.dtype, under_policy: bool = False):
        finfo = jnp.finfo(dtype)
        self.tiny, self.max = float(finfo.smallest_normal), float(finfo.max)
        self.dtype = dtype
        self.under_policy = under_policy
        self.raw: dict[tuple, list[jax.Array]] = {}
        self.matmul_layers: set[str] = set()
        self.float32_layers: set[str] = set()

    def _record(
        self,
        eqn: Any,
        stack: str,
        invals: list,
        outs: list,
        gradient: bool | None = None,
        from_literals: bool = False,
    ) -> None:
        if from_literals:
            return
        key = _layer_and_direction(stack, gradient)
        island = _float32_island(stack)
        if island:
            self.float32_layers.add(island)
        if key[1] == "forward" and _jaxpr.is_matmul(eqn):
            self.matmul_layers.add(key[0])
        for value in outs:
            if is_floating_array(value) and value.size:
                new = self._columns(value)
                self._merge(key, new)
                if self.under_policy and island is None and value.dtype == self.dtype:
                    self._merge((*key, "target"), new)

    def _columns(self, value: jax.Array) -> list:
        """The nine columns for `value`."""
        x = jnp.abs(value.astype(jnp.float32)).ravel()
        is_finite = jnp.isfinite(x)
        # As `debug_precision` counts them: masking constants and infinities are masks. (Not
        # the values derived from a mask near the target's edge: telling them apart in the
        # program costs a third more compile time. Under a policy the advice reads the
        # target-dtype rows, which cannot hold them.)
        masked = (is_finite & _masks(x, value.dtype)) | jnp.isinf(x)
        finite = is_finite & ~masked
        nonzero = finite & (x > 0)
        under = nonzero & (x < self.tiny)

        def count(where):
            return where.astype(jnp.float32)

        # One variadic reduction, not nine: a third less compile time for the program (the
        # docs' training example: 6.9 s against 10.5 s).
        operands = (
            count(masked),
            jnp.where(finite, x, 0.0),
            jnp.where(nonzero, x, jnp.inf),
            count(under),
            count(finite & (x > self.max)),
            count(nonzero),
            count(jnp.isnan(x)),
            jnp.where(under, x, 0.0),
            jnp.where(nonzero, x, 0.0),
        )
        init = tuple(np.float32(v) for v in (0, 0, np.inf, 0, 0, 0, 0, 0, 0))
        totals = jax.lax.reduce(
            operands,
            init,
            lambda a, b: tuple(f(u, v) for f, u, v in zip(_COMBINE, a, b, strict=True)),
            (0,),
        )
        return [jnp.float32(x.size) - totals[0], *totals[1:]]

    def _merge(self, key: tuple, new: list) -> None:
        old = self.raw.get(key)
        if old is not None:
            new = [f(o, n) for f, o, n in zip(_COMBINE, old, new, strict=True)]
        self.raw[key] = new

    def stats(self) -> PrecisionStats:
        keys = tuple(self.raw)
        columns = [
            jnp.stack([self.raw[k][i] for k in keys]) if keys else jnp.zeros((0,), jnp.float32)
            for i in range(9)
        ]
        return PrecisionStats(
            jnp.asarray(True),
            *columns,
            keys=keys,
            dtype=self.dtype.name,
            matmul_layers=tuple(sorted(self.matmul_layers)),
            judged="target" if self.under_policy else "all",
            float32_layers=tuple(sorted(self.float32_layers)),
        )


def value_and_grad_with_stats(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    dtype: DTypeLike = "float16",
    has_aux: bool = False,
) -> Callable[..., Any]:
    """`jax.value_and_grad(fun)` that also returns `PrecisionStats`, computed in the program.

    The statistics of `debug_precision` (amax, smallest nonzero, underflow and overflow in
    `dtype`, non-finite values, per module path and direction) collected inside a jitted
    train step, with no host sync. The returned function takes `collect=`: True (the
    default) collects; a traced bool such as `step % 100 == 0` collects under a `lax.cond`,
    so the other steps compute only the value and gradients; False never collects. Code that
    does not call this function is unchanged. Gradients are judged as computed: differentiate
    the scaled loss to judge them at the loss scale.

    Args:
      fun: the loss, as for `jax.value_and_grad`.
      argnums: which arguments to differentiate.
      dtype: the dtype values are judged against ("float16", "bfloat16", "float8_e4m3fn",
        "float8_e5m2" or "float32").
      has_aux: as for `jax.value_and_grad`.

    Returns:
      `f(*args, collect=True) -> (value, grads, stats)` (`value` is `(loss, aux)` with
      `has_aux`); read `stats.report()` on the host when `stats.collected`.

    Raises:
      TypeError: an unknown `dtype`.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jmp_policy as jmp
      >>> f = jmp.value_and_grad_with_stats(lambda w: jnp.sum(jnp.exp(w * 12.0)))
      >>> value, grads, stats = jax.jit(f)(jnp.ones(3))
      >>> [(s.direction, s.headroom) for s in stats.report().layers]  # exp(12) > 65504
      [('forward', -3), ('backward', -5)]
    """
    target = _target_dtype(dtype)
    value_and_grad = jax.value_and_grad(fun, argnums, has_aux=has_aux)

    def collecting(*args):
        closed, flat, cotangent, shapes = _with_seed(fun, args, argnums, has_aux)
        under_policy = target != jnp.float32 and _computes_in(closed.jaxpr, target)
        interpreter = _InProgram(target, under_policy)
        outs = interpreter.run(closed.jaxpr, closed.consts, flat, "", cotangent)
        value, grads = jax.tree.unflatten(jax.tree.structure(shapes), outs)
        return value, grads, interpreter.stats()

    def plain(*args):
        value, grads = value_and_grad(*args)
        empty = jax.eval_shape(collecting, *args)[2]
        return value, grads, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), empty)

    def wrapped(*args, collect: Any = True):
        if collect is True:
            return collecting(*args)
        if collect is False:
            return plain(*args)
        return jax.lax.cond(collect, collecting, plain, *args)

    return wrapped


class GradientStats(NamedTuple):
    """Per-leaf statistics of the scaled gradients, collected inside a jitted step.

    Made by `loss_scaling(..., stats_every=N)` every N steps (the others keep the last ones),
    without a host sync; `loss_scaling_report` reads them. One float32 vector per statistic,
    one entry per gradient leaf, in `jax.tree.leaves` order.

    Attributes:
      step: the step (applied plus skipped, counted from 0) they were collected at; -1 before.
      amax: the largest finite magnitude.
      min_nonzero: the smallest nonzero finite magnitude (inf if none).
      underflow: the fraction of nonzero values below the target dtype's smallest normal.
      overflow: the fraction of finite values above the target dtype's largest value.
      largest: the target dtype's largest value (a scalar), to read the headroom:
        `log2(largest / amax)` doublings of the loss scale are left.
    """

    step: jax.Array
    amax: jax.Array
    min_nonzero: jax.Array
    underflow: jax.Array
    overflow: jax.Array
    largest: jax.Array


def empty_gradient_stats(leaves: int, dtype: DTypeLike) -> GradientStats:
    """The `GradientStats` before any collection (step -1); every field its own buffer, so the
    state can be donated."""
    return GradientStats(
        step=jnp.full((), -1, jnp.int32),
        amax=jnp.zeros((leaves,), jnp.float32),
        min_nonzero=jnp.full((leaves,), jnp.inf, jnp.float32),
        underflow=jnp.zeros((leaves,), jnp.float32),
        overflow=jnp.zeros((leaves,), jnp.float32),
        largest=jnp.asarray(float(jnp.finfo(dtype).max), jnp.float32),
    )


def gradient_stats(grads: Any, dtype: DTypeLike, step: jax.Array) -> GradientStats:
    """`GradientStats` of the gradient pytree `grads` against `dtype` (pure; runs under `jit`)."""
    finfo = jnp.finfo(dtype)
    tiny, largest = float(finfo.smallest_normal), float(finfo.max)
    columns: list[list[jax.Array]] = [[], [], [], []]
    for leaf in jax.tree.leaves(grads):
        x = jnp.abs(jnp.asarray(leaf, jnp.float32)).ravel()
        finite = jnp.isfinite(x)
        nonzero = finite & (x > 0)
        count_nonzero = jnp.maximum(nonzero.sum(), 1).astype(jnp.float32)
        count_finite = jnp.maximum(finite.sum(), 1).astype(jnp.float32)
        columns[0].append(jnp.max(jnp.where(finite, x, 0.0), initial=0.0))
        columns[1].append(jnp.min(jnp.where(nonzero, x, jnp.inf), initial=jnp.inf))
        columns[2].append((nonzero & (x < tiny)).sum(dtype=jnp.float32) / count_nonzero)
        columns[3].append((finite & (x > largest)).sum(dtype=jnp.float32) / count_finite)
    amax, min_nonzero, underflow, overflow = (
        jnp.stack(c).astype(jnp.float32) if c else jnp.zeros((0,), jnp.float32) for c in columns
    )
    return GradientStats(
        step=jnp.asarray(step, jnp.int32),
        amax=amax,
        min_nonzero=min_nonzero,
        underflow=underflow,
        overflow=overflow,
        largest=jnp.asarray(largest, jnp.float32),
    )
