"""The statistics of a layer's values on the host: the nine columns each value adds to its
layer, what a masking constant is, and how much accuracy an operation loses in the target
dtype."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from jmp_policy._core import jaxpr as _jaxpr
from jmp_policy._reports.debugger.names import _hoisted
from jmp_policy._reports.debugger.report import LayerStats
from jmp_policy.policy import is_floating_array

_MASK_MAGNITUDE = 1e30
_FLOAT16_LARGEST = 65504.0


def _masks(magnitude: Any, dtype: Any) -> Any:
    """Where `magnitude` (|x|, finite) is a masking constant for values of `dtype`.

    A heuristic, by magnitude: 1e30 or more, the dtype's largest value or float16's. What it
    cannot tell: a smaller mask (`-1e9`, as older attention code writes) is taken for an
    activation, so against float16 it is reported as an overflow and the ops that carry it are
    advised into float32 (`test_a_mask_below_1e30_is_taken_for_an_overflow`); a true activation
    of 1e30 or more would be taken for a mask.
    """
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


def _finfo(dtype: Any) -> tuple[float, float, float]:
    """(largest, smallest normal, unit roundoff) of a floating dtype."""
    finfo = jnp.finfo(dtype)
    return float(finfo.max), float(finfo.smallest_normal), float(finfo.eps) / 2


class _Accumulator:
    """Per-layer statistics of the values `debug_precision` reads.

    `dtype` is what every value is judged against in `stats` (all values, float32 ones
    included); `held` (under a policy) the dtypes the policy holds values in, each value of
    one of them judged against its own dtype in `target_stats`, keyed `(layer, direction,
    dtype name)`. Gradients arrive at the loss scale: the program ran with it."""

    def __init__(self, dtype: np.dtype, loss_scale: float, held: frozenset = frozenset()):
        self.max, self.tiny, self.unit_roundoff = _finfo(dtype)
        self.dtype = dtype
        self.loss_scale = loss_scale
        self.held = held
        self.under_policy = bool(held)
        self.stats: dict[tuple, Columns] = {}
        self.target_stats: dict[tuple, Columns] = {}  # values held in the policy's dtypes
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
        if not floating_out or eqn.primitive is _jaxpr.CONVERT:
            return None  # a cast only rounds (an overflow shows as an inf it made)
        if self.under_policy:
            change = [is_floating_array(v) and jnp.dtype(v.dtype) in self.held for v in invals]
            if not any(jnp.dtype(o.dtype) in self.held for o in floating_out):
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
        # Under a policy the operation ran in its output's dtype: its error is in that dtype's
        # roundings, and a mask near that dtype's edge is a mask.
        floating = [o for o in outs if is_floating_array(o)]
        judged_in = jnp.dtype(floating[0].dtype) if self.under_policy else self.dtype
        largest, _, unit_roundoff = _finfo(judged_in)
        # A float16 mask (its lowest value) carried on by `x - max` overflows to -inf there:
        # near the target's edge, values derived from a mask are masks too.
        edge = largest if _carries_mask(invals) else None
        key = (layer, eqn.primitive.name)
        error = _relative_error(full, low, unit_roundoff, edge)
        self.op_errors[key] = max(self.op_errors.get(key, 0.0), error)

    def add(
        self,
        key: tuple[str, str],
        value: np.ndarray,
        island: str | None = None,
        from_mask: bool = False,
    ) -> None:
        """Counts `value`; `from_mask`: its operation's inputs held a mask."""
        self._add(self.stats, key, value, from_mask, self.max, self.tiny)
        held = jnp.dtype(value.dtype)
        if island is None and held in self.held:
            largest, tiny, _ = _finfo(held)
            self._add(self.target_stats, (*key, held.name), value, from_mask, largest, tiny)

    def _add(
        self,
        stats: dict,
        key: tuple,
        value: np.ndarray,
        from_mask: bool,
        largest: float,
        tiny: float,
    ) -> None:
        x = np.abs(np.asarray(value, np.float64)).ravel()
        finite = np.isfinite(x)
        # A masking constant (Flax's `jnp.finfo(jnp.float32).min` for -inf, a model's -2.38e38)
        # is not data: it would count as an overflow that compute-dtype masking never makes.
        # An infinity the model wrote (`where(mask, x, -inf)`) is a mask too; NaN is not.
        masked = (finite & _masks(x, value.dtype)) | np.isinf(x)
        if from_mask:
            masked |= finite & (x >= largest / 2)
        xf = x[finite & ~masked]
        nonzero = xf[xf > 0]  # gradients at the loss scale, as the program computed them
        new = Columns(
            count=x.size - int(masked.sum()),
            amax=float(xf.max()) if xf.size else 0.0,
            min_nonzero=float(nonzero.min()) if nonzero.size else math.inf,
            underflow=int((nonzero < tiny).sum()),
            overflow=int((nonzero > largest).sum()),
            nonzero=int(nonzero.size),
            nonfinite=int((~finite & ~masked).sum()),
            underflow_magnitude=float(nonzero[nonzero < tiny].sum()),
            magnitude=float(nonzero.sum()),
        )
        stats[key] = stats[key].combined(new) if key in stats else new

    def layers(self, target: bool = False) -> tuple[LayerStats, ...]:
        if target:
            return _layer_stats(self.target_stats, self.max, self.loss_scale)
        return _layer_stats(self.stats, self.max, self.loss_scale, self.dtype.name)


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


class Columns(NamedTuple):
    """The nine statistics of a layer's values, the one record both paths keep: the host's
    (`debug_precision`, numbers) and the program's (`value_and_grad_with_stats`, arrays, the
    fields of `PrecisionStats`). Counts and magnitudes add up; amax and min>0 take the
    larger and the smaller (`combined`)."""

    count: Any  # values, masking constants left out
    amax: Any  # the largest finite magnitude
    min_nonzero: Any  # the smallest nonzero finite magnitude (inf if none)
    underflow: Any  # nonzero values below the target's smallest normal (at the loss scale)
    overflow: Any  # finite values above the target's largest (at the loss scale)
    nonzero: Any  # nonzero finite values
    nonfinite: Any  # inf or NaN values that are not masks
    underflow_magnitude: Any  # the summed magnitude of the values that underflow
    magnitude: Any  # the summed magnitude of the nonzero finite values

    def combined(self, other: Columns, xp: Any = np) -> Columns:
        """Both records as one (`xp`: NumPy on the host, jax.numpy inside a program)."""
        combine = (xp.add, xp.maximum, xp.minimum) + (xp.add,) * 6
        return Columns(*(f(a, b) for f, a, b in zip(combine, self, other, strict=True)))


def _layer_stats(
    raw: dict, largest: float, loss_scale: float, dtype: str = ""
) -> tuple[LayerStats, ...]:
    """`LayerStats` from each `(layer, direction)`'s `Columns` (or `(layer, direction, dtype)`'s,
    each judged against its dtype), a layer named relative to a loop counted in its full name
    (`_hoisted`). Gradients were counted at `loss_scale`: their amax and smallest value are
    given for the unscaled loss, as the headroom's doublings are counted from the scale."""
    hoisted = _hoisted(key[0] for key in raw)
    merged: dict[tuple, Columns] = {}
    for (layer, *rest), columns in raw.items():
        key = (hoisted[layer] if layer in hoisted else layer, *rest)
        merged[key] = merged[key].combined(columns) if key in merged else Columns(*columns)
    out = []
    for (layer, direction, *held), columns in merged.items():
        count, amax, low, under, over, nonzero, bad, lost, mass = (float(c) for c in columns)
        top = _finfo(held[0])[0] if held else largest
        headroom = math.log2(top / amax) if amax > 0 else math.inf
        scale = loss_scale if direction == "backward" else 1.0
        finite_count = count - bad
        out.append(
            LayerStats(
                layer=layer,
                direction=direction,
                count=int(count),
                amax=amax / scale,
                min_nonzero=low / scale,
                dynamic_range=math.log2(amax / low) if amax > 0 and low < math.inf else 0.0,
                underflow=under / nonzero if nonzero else 0.0,
                overflow=over / finite_count if finite_count else 0.0,
                headroom=math.floor(headroom) if math.isfinite(headroom) else headroom,
                nonfinite=bad / count if count else 0.0,
                underflow_mass=lost / mass if mass > 0 else 0.0,
                dtype=held[0] if held else dtype,
            )
        )
    return tuple(out)


def _all_finite(values: Sequence[Any]) -> bool:
    # Python floats too: a literal -inf (a mask the model wrote) is an inf passed on, not made.
    return all(
        bool(np.isfinite(np.asarray(v, np.float64)).all()) for v in values if _is_float_value(v)
    )
