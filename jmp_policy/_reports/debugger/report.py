"""The precision debugger's report: per-layer statistics, the first non-finite operation,
and the advice (`PrecisionDebugReport.advice`) they lead to."""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Any

import jax.numpy as jnp
import numpy as np

from jmp_policy._core import jaxpr as _jaxpr
from jmp_policy._core.text import format_scale as _power
from jmp_policy._core.text import short_dtype as _short
from jmp_policy._reports.debugger.names import TOP_LEVEL, _module_path


def _scaled(dtype: str) -> bool:
    """float8 and float4 values: held with a scale of their own."""
    return jnp.dtype(dtype).itemsize == 1


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
    dtype: str = ""


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
      held_dtypes: under a policy judged in its own dtypes (`debug_precision(dtype=None)`),
        the dtypes it holds values in; each row of `target_layers` is judged in its `dtype`.
      warmed_states: how many fresh float8 delayed-scaling states were judged with the scales
        one step gives them (an empty history's scale 1 is used only by a run's first steps).
      finite_scale: under a policy with float16 gradients, the largest power of two `S`, at
        most the statistics' advised initial scale (below `loss_scale` where the gradients
        overflowed there), at which the program run at `2 S` gave a finite loss and
        gradients: a doubling of headroom, checked (None: not run). `advice` takes the
        smaller of the two.
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
    held_dtypes: tuple[str, ...] = ()
    warmed_states: int = 0
    finite_scale: float | None = None

    def __str__(self) -> str:
        loss = "" if math.isnan(self.loss) else f" (loss {self.loss:.6g})"
        judged_in = ", ".join(self.held_dtypes) if self.held_dtypes else self.dtype
        lines = [
            f"precision of the loss's values in {judged_in}, gradients at loss scale "
            f"{_power(self.loss_scale)}{loss}",
            "",
        ]
        if self.judged == "target":  # what the policy keeps in float32 cannot overflow it
            lines.insert(1, f"(values the policy holds in {judged_in}; `layers` has them all)")
        if self.warmed_states:
            lines.insert(
                1,
                f"({self.warmed_states} fresh float8 delayed-scaling states judged with the "
                "scales one step on these arguments gives them)",
            )
        shown = self.shown_layers
        width = max([len("layer"), *(len(s.layer) for s in shown)]) + 2
        kinds = len({s.dtype for s in shown}) > 1
        lines.append(
            f"{'layer':<{width}}{'dir':<5}{'dtype    ' if kinds else ''}{'amax':>10}{'min>0':>10}"
            f"{'range':>7}{'under%':>8}{'over%':>7}{'headroom':>9}{'nan/inf%':>9}"
        )
        for s in shown:
            lines.append(
                f"{s.layer:<{width}}{s.direction[:3]:<5}"
                f"{_short(s.dtype) if kinds else '':<{9 if kinds else 0}}"
                f"{s.amax:>10.3g}{s.min_nonzero:>10.3g}"
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
            shown_errors = ", ".join(
                f"{e.primitive} in {e.layer} {e.error:.1f}u" for e in worse[:6]
            )
            more = f" and {len(worse) - 6} more" if len(worse) > 6 else ""
            lines.append(
                f"ops less accurate than one rounding in {judged_in}: {shown_errors}{more}"
            )
        advice = self.advice()
        scale = dict(advice["loss_scale"], initial=_power(advice["loss_scale"]["initial"]))
        lines.append(
            f"advice: overrides {advice['overrides']}, float32 islands {advice['islands']}, "
            f"loss scale {scale}"
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

          What is judged is what the policy holds in 16, 8 or 4 bits: when the loss already
          runs under a policy (`judged == "target"`), those values and operations only, each
          in its own dtype (`LayerStats.dtype`); an operation the policy keeps in float32 (a
          norm's statistics under `NORMS_IN_FLOAT32`, Flax attention's softmax) is not judged.

          - overrides: the layers the policy already keeps in float32 (`float32_layers`) stay
            there; a layer whose 16-bit activations do not fit their dtype (an overflow, or
            more than 0.1% of their magnitude lost to underflow) goes to float32; so does a
            layer without matmuls (its own or its children's) whose values span more binades
            than the dtype's normal range or whose operations lose more than one rounding
            there (`op_errors`): normalisation statistics, at no cost in half-precision matmul
            FLOPs. A layer holding float8 or float4 values (scaled per tensor, row or block) is
            moved only for an inf/NaN among them: their small values are the format's rounding.
            Pass the dict as it is to `linen.mixed_precision(..., overrides=...)` (it replaces
            `NORMS_IN_FLOAT32`).
          - islands: operations that lose more than one rounding (`OpError.error` > 1 u) in
            their dtype, inside layers that also hold matmuls (or at the top level, the
            loss): they need float32 without moving the layer's matmuls out of half
            precision. `linen.mixed_precision` already runs Flax attention's softmax in
            float32; `autocast` runs sums, exp and log there; a model output cast to
            float32 (`output_dtype`) keeps the loss there.
          - loss_scale: `initial`, the largest power of two that keeps one doubling of
            headroom on every float16 gradient once these overrides are applied (a layer they
            move to float32 is not judged; under a policy judged in its own dtypes, bfloat16
            and float8 gradients need no loss scale), at most `finite_scale` (the program run
            at twice it came out finite), and `hysteresis` 2 when the gradients span more
            binades than the dtype can hold (some will underflow at any scale, so single
            overflows should not halve it).
        """

        def normal_range(dtype: str) -> float:
            finfo = jnp.finfo(dtype or self.dtype)
            return math.log2(float(finfo.max) / float(finfo.smallest_normal))

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
            if _scaled(s.dtype or self.dtype):
                # float8/float4 values carry a scale of their own (per tensor, row or block)
                # set from their amax: a small value is the format's rounding, which its
                # scaling already minimised. The format fails only where it holds an inf/NaN.
                does_not_fit, free = s.nonfinite > 0, False
            else:
                does_not_fit = s.overflow > 0 or s.underflow_mass > 1e-3
                free = not holds_matmuls(s.layer) and (
                    s.dynamic_range > normal_range(s.dtype) or s.layer in lossy
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

        # The gradients that stay in a 16-bit dtype once these overrides are applied (a
        # float8 gradient is scaled per tensor: the loss scale does not move it in its range;
        # under a policy judged in its own dtypes, bfloat16 holds float32's exponents and
        # needs no loss scale).
        backward = [
            s
            for s in judged
            if s.direction == "backward"
            and s.amax > 0
            and not _scaled(s.dtype or self.dtype)
            and not (self.held_dtypes and s.dtype == "bfloat16")
            and (s.layer == TOP_LEVEL or not overridden(s.layer))
        ]
        if backward:
            # The largest power of two leaving a doubling on each (gradients of the unscaled
            # loss, each against its dtype's largest value).
            initial = min(
                2.0
                ** math.floor(math.log2(float(jnp.finfo(s.dtype or self.dtype).max) / 2 / s.amax))
                for s in backward
            )
            if self.finite_scale is not None:
                initial = min(initial, self.finite_scale)
            span = max(s.dynamic_range - normal_range(s.dtype) for s in backward)
            scale = {"initial": initial, "hysteresis": 2 if span > -1 else 1}
        elif self.finite_scale is not None:  # every gradient overflowed at `loss_scale`
            scale = {"initial": self.finite_scale, "hysteresis": 1}
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
