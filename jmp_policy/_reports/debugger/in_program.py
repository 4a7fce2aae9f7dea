"""Precision statistics collected inside a jitted train step (`value_and_grad_with_stats`):
the same columns, accumulated with jnp, read on the host when wanted."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jmp_policy._core import jaxpr as _jaxpr
from jmp_policy._core.pytree import register_state
from jmp_policy._reports.debugger.interpreter import _Interpreter
from jmp_policy._reports.debugger.names import (
    _float32_island,
    _hoisted,
    _layer_and_direction,
    _renamed,
)
from jmp_policy._reports.debugger.report import PrecisionDebugReport
from jmp_policy._reports.debugger.run import _TARGETS, _computes_in, _target_dtype, _with_seed
from jmp_policy._reports.debugger.values import Columns, _layer_stats, _masks
from jmp_policy.policy import is_floating_array


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
        columns = Columns(
            *(np.asarray(jax.device_get(getattr(self, f)), np.float64) for f in Columns._fields)
        )
        raw = {key: Columns(*(float(c[i]) for c in columns)) for i, key in enumerate(self.keys)}
        largest = float(jnp.finfo(self.dtype).max)
        hoisted = _hoisted(k[0] for k in raw)
        return PrecisionDebugReport(
            dtype=self.dtype,
            loss_scale=1.0,
            layers=_layer_stats(
                {k: v for k, v in raw.items() if len(k) == 2}, largest, 1.0, self.dtype
            ),
            origin=None,
            nonfinite_inputs=(),
            loss=float(loss),
            matmul_layers=_renamed(self.matmul_layers, hoisted),
            judged=self.judged,
            target_layers=_layer_stats(
                {(*k[:2], self.dtype): v for k, v in raw.items() if len(k) == 3}, largest, 1.0
            ),
            float32_layers=_renamed(self.float32_layers, hoisted),
        )


# How each of the nine columns combines: counts and magnitudes add, amax and min>0 do not.


class _InProgram(_Interpreter):
    """Runs a jaxpr on traced values, accumulating `PrecisionStats` columns with jnp."""

    def __init__(self, dtype: np.dtype, under_policy: bool = False):
        finfo = jnp.finfo(dtype)
        self.tiny, self.max = float(finfo.smallest_normal), float(finfo.max)
        self.dtype = dtype
        self.under_policy = under_policy
        self.raw: dict[tuple, Columns] = {}
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

    def _columns(self, value: jax.Array) -> Columns:
        """The `Columns` of `value` (arrays)."""
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
        # docs' training example: 6.9 s against 10.5 s). Its first column counts the masks.
        operands = Columns(
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
        init = Columns(*(np.float32(v) for v in (0, 0, np.inf, 0, 0, 0, 0, 0, 0)))
        totals = Columns(
            *jax.lax.reduce(
                tuple(operands),
                tuple(init),
                lambda a, b: tuple(Columns(*a).combined(Columns(*b), jnp)),
                (0,),
            )
        )
        return totals._replace(count=jnp.float32(x.size) - totals.count)

    def _merge(self, key: tuple, new: Columns) -> None:
        old = self.raw.get(key)
        self.raw[key] = new if old is None else old.combined(new, jnp)

    def stats(self) -> PrecisionStats:
        keys = tuple(self.raw)
        columns = {
            field: jnp.stack([getattr(self.raw[k], field) for k in keys])
            if keys
            else jnp.zeros((0,), jnp.float32)
            for field in Columns._fields
        }
        return PrecisionStats(
            jnp.asarray(True),
            **columns,
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
      >>> f = jmp.reports.value_and_grad_with_stats(lambda w: jnp.sum(jnp.exp(w * 12.0)))
      >>> value, grads, stats = jax.jit(f)(jnp.ones(3))
      >>> [(s.direction, s.headroom) for s in stats.report().layers]  # exp(12) > 65504
      [('forward', -3), ('backward', -5)]
    """
    target = _target_dtype(dtype)
    if target is None:  # statistics kept in the program are of one dtype
        raise TypeError(
            f"Expected one of {_TARGETS} for `dtype` of value_and_grad_with_stats, got "
            f"{dtype!r}: the statistics it keeps in the program judge one dtype "
            "(`debug_precision` judges each value in the dtype a policy holds it in)."
        )
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
