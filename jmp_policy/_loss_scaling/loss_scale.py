"""Loss scales as pure pytree state: no-op, static and dynamic.

Multiply the loss by S before differentiating so small float16 gradients do
not flush to zero, divide the gradients by the same S, check them, and adjust
S: grow it after `period` clean steps, shrink it when a step overflows.

Every class is a frozen dataclass whose pytree registration comes from its
fields (`jmp_policy._core.pytree.register_state`): values that change per step are
leaves, configuration is static metadata, so everything survives `jit`, any
`tree_map` (to bools, None, `ShapeDtypeStruct`, ...) and checkpoints with no
hand-written flatten. Only a user's own construction is validated.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from jmp_policy._core.pytree import leaf_names, new_unchecked, register_state
from jmp_policy._core.validation import (
    check_bool,
    check_flag,
    int_leaf,
    positive_number,
    scale_leaf,
    whole_number,
)
from jmp_policy.policy import is_floating_array

T = TypeVar("T")

# The floor below which a scale may never go, whatever `min_loss_scale` says:
# a zero scale would turn every unscaled gradient into inf or NaN.
_TINY = float(np.finfo(np.float32).tiny)


def _at_least_float32(x: jax.Array) -> jax.Array:
    # float16 * 2**16 overflows and float16 / 2**16 underflows; float64 stays.
    # (Not `promote_types`: it refuses float16 -> float32 under strict promotion.)
    return x.astype(jnp.float32) if jnp.finfo(x.dtype).bits < 32 else x


def _scaled_leaf(x: Any) -> Any:
    """`x` as the array a scale applies to (in at least float32), or None where it applies to
    nothing. Floating arrays, and Python numbers as jmp scales them (a loss of `2.0` scaled by
    1024 is 2048.0); integer and bool arrays, bools, keys and objects pass through."""
    if is_floating_array(x):
        return _at_least_float32(x)
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        return jnp.asarray(x, jnp.float32)
    return None


def _scale_floating(tree: T, scale: ArrayLike) -> T:
    def scale_leaf(x):
        y = _scaled_leaf(x)
        return x if y is None else y * scale

    return jax.tree.map(scale_leaf, tree)


def _unscale_floating(tree: T, scale: ArrayLike) -> T:
    # Division rather than multiplication by 1/S: exactly rounded, and 1/S can
    # be a denormal that CPUs flush to zero.
    def unscale_leaf(x):
        y = _scaled_leaf(x)
        return x if y is None else y / scale

    return jax.tree.map(unscale_leaf, tree)


@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
    """A loss scale that does nothing: for float32 and bfloat16 training.

    Examples:
      >>> import jmp_policy as jmp
      >>> loss_scale = jmp.NoOpLossScale()
      >>> loss_scale.scale(2.0)
      2.0
    """

    @property
    def loss_scale(self) -> np.ndarray:
        return np.asarray(1.0, np.float32)

    def scale(self, tree: T) -> T:
        """Returns `tree` unchanged."""
        return tree

    def unscale(self, tree: T) -> T:
        """Returns `tree` unchanged."""
        return tree

    def adjust(self, grads_finite: ArrayLike) -> NoOpLossScale:
        """Returns `self` (the flag is checked, then ignored)."""
        check_flag(grads_finite)
        return self


@dataclasses.dataclass(frozen=True)
class StaticLossScale:
    """Scales and unscales by a fixed constant.

    The constant is static configuration (a Python float), so this state has no
    array leaves; a different constant compiles a different program.

    Attributes:
      loss_scale: the constant S > 0. Python numbers and NumPy scalars are
        accepted; powers of two keep scaling exact.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jmp_policy as jmp
      >>> loss_scale = jmp.StaticLossScale(2**10)
      >>> loss_scale.scale(jnp.float16(60_000.0)).dtype  # scaled in float32
      dtype('float32')
    """

    loss_scale: float = dataclasses.field(metadata=dict(static=True))

    def __post_init__(self):
        object.__setattr__(self, "loss_scale", positive_number(self.loss_scale, "loss_scale"))

    def scale(self, tree: T) -> T:
        """Multiplies the floating leaves of `tree` by S, in at least float32."""
        return _scale_floating(tree, np.float32(self.loss_scale))

    def unscale(self, tree: T) -> T:
        """Divides the floating leaves of `tree` by S, in at least float32."""
        return _unscale_floating(tree, np.float32(self.loss_scale))

    def adjust(self, grads_finite: ArrayLike) -> StaticLossScale:
        """Returns `self` (the flag is checked, then ignored)."""
        check_flag(grads_finite)
        return self


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """A loss scale that grows while gradients stay finite and shrinks when not.

    The rule (torch.amp's GradScaler and jmp, for a scale S and counter c):

        if grads_finite:
            c += 1
            if c == period (or every step while warming up):
                S = min(S * factor, max_loss_scale) unless that is inf; c = 0
        else:
            c = 0
            if this is the `hysteresis`-th consecutive non-finite step or later:
                S = max(S * backoff_factor, min_loss_scale)

    The caller skips the parameter update on every non-finite step.

    Attributes:
      loss_scale: the current scale S (float32 leaf). Python numbers are
        converted; `2**15` (jmp) or `2**16` (torch.amp) are usual.
      counter: consecutive finite steps since the last change (int32 leaf).
      period: grow S on the `period`-th consecutive finite step.
      factor: the growth factor (> 1).
      min_loss_scale: the floor for S (>= 0; S never goes below float32's
        smallest normal number either).
      backoff_factor: multiplies S on a non-finite step, in (0, 1); default
        `1 / factor`.
      max_loss_scale: the cap for S; default none (S still never becomes inf).
        `2**24` is a common choice (Apex's cap).
      hysteresis: back off only from the `hysteresis`-th consecutive non-finite
        step on (Megatron's and Apex's option); every non-finite step is still
        skipped. 1 backs off at once.
      warmup: grow S after every finite step until the first non-finite one,
        then follow `period`. Start low (e.g. `DynamicLossScale(1.0,
        warmup=True)`) and the safe scale is found in log2(S_safe) steps with a
        single skipped step, instead of many skipped steps backing off from
        2**16.
      nonfinite_run: consecutive non-finite steps, saturating at `hysteresis`
        (int32 leaf; None when `hysteresis == 1`).
      warming_up: whether warm-up is still on (bool leaf; None without warm-up).

    Examples:
      >>> import jax.numpy as jnp
      >>> import jmp_policy as jmp
      >>> loss_scale = jmp.DynamicLossScale(8.0, period=3)
      >>> for finite in [True, True, True, False]:
      ...     loss_scale = loss_scale.adjust(jnp.asarray(finite))
      ...     print(float(loss_scale.loss_scale))
      8.0
      8.0
      16.0
      8.0
    """

    loss_scale: ArrayLike
    counter: ArrayLike = 0
    period: int = dataclasses.field(default=2000, metadata=dict(static=True))
    factor: float = dataclasses.field(default=2.0, metadata=dict(static=True))
    min_loss_scale: float = dataclasses.field(default=1.0, metadata=dict(static=True))
    _: dataclasses.KW_ONLY
    backoff_factor: float | None = dataclasses.field(default=None, metadata=dict(static=True))
    max_loss_scale: float | None = dataclasses.field(default=None, metadata=dict(static=True))
    hysteresis: int = dataclasses.field(default=1, metadata=dict(static=True))
    warmup: bool = dataclasses.field(default=False, metadata=dict(static=True))
    nonfinite_run: ArrayLike | None = None
    warming_up: ArrayLike | None = None

    def __post_init__(self):
        setattr_ = functools.partial(object.__setattr__, self)
        initial = self.loss_scale  # a Python or NumPy number is checked against the limits
        setattr_("loss_scale", scale_leaf(self.loss_scale, "loss_scale"))
        setattr_("counter", int_leaf(self.counter, "counter"))
        setattr_("period", whole_number(self.period, "period", low=1))
        setattr_("factor", positive_number(self.factor, "factor"))
        if self.factor <= 1:
            raise ValueError(f"Expected a number > 1 for `factor`, got {self.factor}.")
        setattr_(
            "min_loss_scale",
            positive_number(self.min_loss_scale, "min_loss_scale", allow_zero=True),
        )
        backoff = 1.0 / self.factor if self.backoff_factor is None else self.backoff_factor
        backoff = positive_number(backoff, "backoff_factor")
        if not backoff < 1:
            raise ValueError(f"Expected a number in (0, 1) for `backoff_factor`, got {backoff}.")
        setattr_("backoff_factor", backoff)
        cap = math.inf if self.max_loss_scale is None else self.max_loss_scale
        if cap != math.inf:
            cap = positive_number(cap, "max_loss_scale")
        if cap < self.min_loss_scale:
            raise ValueError(
                f"Expected `min_loss_scale` <= `max_loss_scale`, got {self.min_loss_scale} > {cap}."
            )
        setattr_("max_loss_scale", cap)
        if isinstance(initial, (numbers.Real, np.ndarray, np.generic)) and not (
            self.min_loss_scale <= float(initial) <= cap
        ):
            # A scale outside its limits leaves them at its first adjust: a back-off would
            # raise it to the floor, a growth step cut it to the cap.
            raise ValueError(
                f"Expected `min_loss_scale` <= `loss_scale` <= `max_loss_scale`, got "
                f"{self.min_loss_scale!r} <= {float(initial)!r} <= {cap!r}. Lower "
                "`min_loss_scale` (e.g. min_loss_scale=1.0 / 2**10) or raise `max_loss_scale`."
            )
        setattr_("hysteresis", whole_number(self.hysteresis, "hysteresis", low=1))
        setattr_("warmup", check_bool(self.warmup, "warmup"))
        if self.warming_up is not None and not (
            isinstance(self.warming_up, (bool, np.bool_))
            or getattr(self.warming_up, "dtype", None) == jnp.bool_
        ):
            raise TypeError(
                f"Expected True, False or a bool array for `warming_up`, got {self.warming_up!r}."
            )
        # Optional leaves exist only when their feature is on, so the default
        # state has exactly jmp's leaves (loss_scale, counter). A value given
        # for them is kept (checked, if it is a number).
        if self.hysteresis > 1 and self.nonfinite_run is None:
            setattr_("nonfinite_run", jnp.zeros((), jnp.int32))
        else:
            setattr_("nonfinite_run", int_leaf(self.nonfinite_run, "nonfinite_run"))
        if self.warmup and self.warming_up is None:
            setattr_("warming_up", jnp.asarray(True))

    @property
    def floor(self) -> float:
        """The lowest S can go: `min_loss_scale`, but never below float32's smallest normal."""
        return max(self.min_loss_scale, _TINY)

    def scale(self, tree: T) -> T:
        """Multiplies the floating leaves of `tree` by S, in at least float32."""
        return _scale_floating(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        """Divides the floating leaves of `tree` by S, in at least float32."""
        return _unscale_floating(tree, self.loss_scale)

    def adjust(self, grads_finite: ArrayLike) -> DynamicLossScale:
        """Returns the next state given whether this step's gradients were finite.

        Args:
          grads_finite: a scalar bool, e.g. `all_finite(grads)`.

        Returns:
          The adjusted `DynamicLossScale`; pure, so it runs under `jit`.
        """
        finite = check_flag(grads_finite)
        scale = jnp.asarray(self.loss_scale, jnp.float32)
        counter = jnp.asarray(self.counter, jnp.int32) + 1
        grow = counter >= self.period
        if self.warmup:
            grow = grow | cast(jax.Array, self.warming_up)
        grown = scale * self.factor
        # __post_init__ made the optional configuration numbers (inf: no cap).
        cap, backoff_factor = cast(float, self.max_loss_scale), cast(float, self.backoff_factor)
        grown = jnp.where(jnp.isfinite(grown), jnp.minimum(grown, cap), scale)

        backoff = ~finite
        run = None
        if self.hysteresis > 1:
            run = jnp.where(
                finite, 0, jnp.minimum(cast(jax.Array, self.nonfinite_run) + 1, self.hysteresis)
            )
            backoff = backoff & (run >= self.hysteresis)
        floor = self.floor
        shrunk = jnp.maximum(scale * backoff_factor, floor)

        new_scale = jnp.where(finite & grow, grown, jnp.where(backoff, shrunk, scale))
        new_counter = jnp.where(finite & ~grow, counter, 0)
        changes: dict[str, Any] = dict(loss_scale=new_scale, counter=new_counter)
        if self.hysteresis > 1:
            changes["nonfinite_run"] = run
        if self.warmup:
            changes["warming_up"] = cast(jax.Array, self.warming_up) & finite
        return rebuild(self, **changes)


def rebuild(state: Any, **changes) -> Any:
    """A copy of the loss scale `state` with `changes`, not validated again.

    For values valid by construction (`adjust`'s, a restored checkpoint's): skipping
    `__post_init__` means an eager step never waits on the device to validate them.
    """
    fields = {
        f.name: changes.get(f.name, getattr(state, f.name)) for f in dataclasses.fields(state)
    }
    return new_unchecked(type(state), fields)


def leaf_fields(state) -> list[str]:
    """The names of the per-step (array) fields of the loss scale `state`."""
    return list(leaf_names(type(state)))


for _cls in (NoOpLossScale, StaticLossScale, DynamicLossScale):
    register_state(_cls)

LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale


def select_tree(pred: ArrayLike, a: T, b: T) -> T:
    """Returns `a` where the scalar bool `pred` is True, else `b`, leaf by leaf.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jmp_policy as jmp
      >>> jmp.select_tree(jnp.asarray(False), {"x": jnp.ones(2)}, {"x": jnp.zeros(2)})
      {'x': Array([0., 0.], dtype=float32)}
    """
    pred = check_flag(pred, "pred")
    return jax.tree.map(functools.partial(lax.select, pred), a, b)
