"""Loss scales as pure pytree state: no-op, static and dynamic.

Multiply the loss by S before differentiating so small float16 gradients do
not flush to zero, divide the gradients by the same S, check them, and adjust
S: grow it after `period` clean steps, shrink it when a step overflows.

Every class is a frozen dataclass registered with
`jax.tree_util.register_dataclass`: values that change per step are leaves,
configuration is static metadata, so everything survives `jit`, `tree_map`
and checkpoints with no hand-written flatten.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, TypeVar

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_policy.policy import is_floating_array

T = TypeVar("T")

# The floor below which a scale may never go, whatever `min_loss_scale` says:
# a zero scale would turn every unscaled gradient into inf or NaN.
_TINY = float(np.finfo(np.float32).tiny)
# all_finite adds leaves smaller than this together before reducing them.
_GROUPED_LEAF_SIZE = 2**16


def _at_least_float32(x: jax.Array) -> jax.Array:
    # float16 * 2**16 overflows and float16 / 2**16 underflows; float64 stays.
    # (Not `promote_types`: it refuses float16 -> float32 under strict promotion.)
    return x.astype(jnp.float32) if jnp.finfo(x.dtype).bits < 32 else x


def _scale_floating(tree: T, scale: Any) -> T:
    return jax.tree.map(lambda x: _at_least_float32(x) * scale if is_floating_array(x) else x, tree)


def _unscale_floating(tree: T, scale: Any) -> T:
    # Division rather than multiplication by 1/S: exactly rounded, and 1/S can
    # be a denormal that CPUs flush to zero.
    return jax.tree.map(lambda x: _at_least_float32(x) / scale if is_floating_array(x) else x, tree)


def _positive_number(value: Any, argument: str, *, allow_zero: bool = False) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (numbers.Real, np.ndarray, np.generic, jax.Array)
    ):
        raise TypeError(f"Expected a positive finite number for `{argument}`, got {value!r}.")
    if isinstance(value, (np.ndarray, jax.Array)) and value.shape != ():
        raise TypeError(f"Expected a scalar for `{argument}`, got an array of shape {value.shape}.")
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"Expected a concrete number for `{argument}` (it is static configuration), "
            "got a traced value: build the loss scale outside `jit`."
        )
    if hasattr(value, "dtype") and not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(
            f"Expected a Python number or a floating scalar for `{argument}`, got dtype "
            f"{value.dtype}."
        )
    number = float(value)
    low_ok = number >= 0 if allow_zero else number > 0
    if not (low_ok and math.isfinite(number)):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"Expected a finite number {bound} for `{argument}`, got {number}.")
    return number


def _scale_leaf(value: Any, argument: str) -> Any:
    """Checks and converts a loss-scale leaf to float32.

    Leaves are also rebuilt by JAX itself (unflatten with tracers, abstract
    values or placeholder objects, batched or stacked arrays), so only Python
    and NumPy values, which only a user gives, are checked by value and shape;
    JAX arrays are checked by dtype alone, which never waits on the device and
    lets a state be batched (`vmap` of `init`) or stacked.
    """
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"Expected a positive float for `{argument}`, got {value!r}.")
    if isinstance(value, numbers.Real) or isinstance(value, (np.ndarray, np.generic)):
        if hasattr(value, "dtype") and not jnp.issubdtype(value.dtype, jnp.floating):
            raise TypeError(
                f"Expected a floating array (float32) or a Python number for `{argument}`, "
                f"got an array of dtype {value.dtype}. Python numbers are converted for you."
            )
        number = _positive_number(value, argument)
        # A JAX array from the start: a jitted step then sees the same argument
        # types on its first and later calls, and compiles once.
        return jnp.asarray(number, jnp.float32)
    dtype = getattr(value, "dtype", None)
    if dtype is None or not hasattr(value, "shape"):
        return value  # A placeholder JAX uses while rebuilding the tree.
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"Expected a floating array (float32) or a Python number for `{argument}`, "
            f"got an array of dtype {dtype}. Python numbers are converted for you."
        )
    if isinstance(value, jax.Array) and dtype != jnp.float32:
        return value.astype(jnp.float32)
    return value


def _int_leaf(value: Any, argument: str) -> Any:
    if isinstance(value, (numbers.Integral, np.integer)) and not isinstance(value, bool):
        return jnp.asarray(value, jnp.int32)
    if isinstance(value, (bool, numbers.Real)):
        raise TypeError(f"Expected an integer for `{argument}`, got {value!r}.")
    dtype = getattr(value, "dtype", None)
    if dtype is not None and not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"Expected an int32 scalar for `{argument}`, got dtype {dtype}.")
    return value


def _check_flag(grads_finite: Any, argument: str = "grads_finite") -> jax.Array:
    if isinstance(grads_finite, bool):
        return jnp.asarray(grads_finite)
    shape = getattr(grads_finite, "shape", None)
    dtype = getattr(grads_finite, "dtype", None)
    if shape != () or dtype != jnp.bool_:
        got = f"shape {shape}, dtype {dtype}" if dtype is not None else repr(grads_finite)
        raise TypeError(
            f"Expected a scalar boolean (e.g. from `all_finite`) for `{argument}`, got {got}."
        )
    return grads_finite


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

    def adjust(self, grads_finite: Any) -> NoOpLossScale:
        """Returns `self` (the flag is checked, then ignored)."""
        _check_flag(grads_finite)
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
        object.__setattr__(self, "loss_scale", _positive_number(self.loss_scale, "loss_scale"))

    def scale(self, tree: T) -> T:
        """Multiplies the floating leaves of `tree` by S, in at least float32."""
        return _scale_floating(tree, np.float32(self.loss_scale))

    def unscale(self, tree: T) -> T:
        """Divides the floating leaves of `tree` by S, in at least float32."""
        return _unscale_floating(tree, np.float32(self.loss_scale))

    def adjust(self, grads_finite: Any) -> StaticLossScale:
        """Returns `self` (the flag is checked, then ignored)."""
        _check_flag(grads_finite)
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

    loss_scale: Any
    counter: Any = 0
    period: int = dataclasses.field(default=2000, metadata=dict(static=True))
    factor: float = dataclasses.field(default=2.0, metadata=dict(static=True))
    min_loss_scale: float = dataclasses.field(default=1.0, metadata=dict(static=True))
    _: dataclasses.KW_ONLY
    backoff_factor: float | None = dataclasses.field(default=None, metadata=dict(static=True))
    max_loss_scale: float | None = dataclasses.field(default=None, metadata=dict(static=True))
    hysteresis: int = dataclasses.field(default=1, metadata=dict(static=True))
    warmup: bool = dataclasses.field(default=False, metadata=dict(static=True))
    nonfinite_run: Any = None
    warming_up: Any = None

    def __post_init__(self):
        setattr_ = functools.partial(object.__setattr__, self)
        setattr_("loss_scale", _scale_leaf(self.loss_scale, "loss_scale"))
        setattr_("counter", _int_leaf(self.counter, "counter"))
        setattr_("period", _whole_number(self.period, "period", low=1))
        setattr_("factor", _positive_number(self.factor, "factor"))
        if self.factor <= 1:
            raise ValueError(f"Expected a number > 1 for `factor`, got {self.factor}.")
        setattr_(
            "min_loss_scale",
            _positive_number(self.min_loss_scale, "min_loss_scale", allow_zero=True),
        )
        backoff = 1.0 / self.factor if self.backoff_factor is None else self.backoff_factor
        backoff = _positive_number(backoff, "backoff_factor")
        if not backoff < 1:
            raise ValueError(f"Expected a number in (0, 1) for `backoff_factor`, got {backoff}.")
        setattr_("backoff_factor", backoff)
        cap = math.inf if self.max_loss_scale is None else self.max_loss_scale
        if cap != math.inf:
            cap = _positive_number(cap, "max_loss_scale")
        if cap < self.min_loss_scale:
            raise ValueError(
                f"Expected `min_loss_scale` <= `max_loss_scale`, got {self.min_loss_scale} > {cap}."
            )
        setattr_("max_loss_scale", cap)
        setattr_("hysteresis", _whole_number(self.hysteresis, "hysteresis", low=1))
        if not isinstance(self.warmup, (bool, np.bool_)):
            raise TypeError(f"Expected True or False for `warmup`, got {self.warmup!r}.")
        setattr_("warmup", bool(self.warmup))
        # Optional leaves exist only when their feature is on, so the default
        # state has exactly jmp's leaves (loss_scale, counter). A value given
        # for them is kept as is: tree maps that treat None as a leaf (orbax
        # does) rebuild the state with other values there.
        if self.hysteresis > 1 and self.nonfinite_run is None:
            setattr_("nonfinite_run", jnp.zeros((), jnp.int32))
        else:
            setattr_("nonfinite_run", _int_leaf(self.nonfinite_run, "nonfinite_run"))
        if self.warmup and self.warming_up is None:
            setattr_("warming_up", jnp.asarray(True))

    def _floor(self) -> float:
        # The lowest S can go: `min_loss_scale`, but never 0.
        return max(self.min_loss_scale, _TINY)

    def scale(self, tree: T) -> T:
        """Multiplies the floating leaves of `tree` by S, in at least float32."""
        return _scale_floating(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        """Divides the floating leaves of `tree` by S, in at least float32."""
        return _unscale_floating(tree, self.loss_scale)

    def adjust(self, grads_finite: Any) -> DynamicLossScale:
        """Returns the next state given whether this step's gradients were finite.

        Args:
          grads_finite: a scalar bool, e.g. `all_finite(grads)`.

        Returns:
          The adjusted `DynamicLossScale`; pure, so it runs under `jit`.
        """
        finite = _check_flag(grads_finite)
        scale = jnp.asarray(self.loss_scale, jnp.float32)
        counter = jnp.asarray(self.counter, jnp.int32) + 1
        grow = counter >= self.period
        if self.warmup:
            grow = grow | self.warming_up
        grown = scale * self.factor
        grown = jnp.where(jnp.isfinite(grown), jnp.minimum(grown, self.max_loss_scale), scale)

        backoff = ~finite
        run = None
        if self.hysteresis > 1:
            run = jnp.where(finite, 0, jnp.minimum(self.nonfinite_run + 1, self.hysteresis))
            backoff = backoff & (run >= self.hysteresis)
        floor = self._floor()
        shrunk = jnp.maximum(scale * self.backoff_factor, floor)

        new_scale = jnp.where(finite & grow, grown, jnp.where(backoff, shrunk, scale))
        new_counter = jnp.where(finite & ~grow, counter, 0)
        changes = dict(loss_scale=new_scale, counter=new_counter)
        if self.hysteresis > 1:
            changes["nonfinite_run"] = run
        if self.warmup:
            changes["warming_up"] = self.warming_up & finite
        return _rebuild(self, **changes)


def _whole_number(value: Any, argument: str, *, low: int) -> int:
    integral = isinstance(value, (numbers.Integral, np.integer)) or (
        isinstance(value, float) and value.is_integer()
    )
    if isinstance(value, bool) or not integral:
        raise TypeError(f"Expected an integer >= {low} for `{argument}`, got {value!r}.")
    if int(value) < low:
        raise ValueError(f"Expected an integer >= {low} for `{argument}`, got {value}.")
    return int(value)


def _rebuild(state: T, **changes) -> T:
    # `adjust` makes values that are valid by construction: skip `__post_init__`
    # so an eager step never waits on the device to validate them.
    new = object.__new__(type(state))
    for field in dataclasses.fields(state):
        object.__setattr__(new, field.name, changes.get(field.name, getattr(state, field.name)))
    return new


def _leaf_fields(state) -> list[str]:
    return [f.name for f in dataclasses.fields(state) if not f.metadata.get("static")]


def _to_state_dict(state) -> dict[str, Any]:
    return {
        name: flax.serialization.to_state_dict(getattr(state, name))
        for name in _leaf_fields(state)
        if getattr(state, name) is not None
    }


def _from_state_dict(target: T, state_dict: dict[str, Any]) -> T:
    # Configuration comes from `target`; only per-step values are restored.
    restored = {
        name: flax.serialization.from_state_dict(getattr(target, name), state_dict[name], name)
        for name in _leaf_fields(target)
        if getattr(target, name) is not None
    }
    return _rebuild(target, **restored)


for _cls in (NoOpLossScale, StaticLossScale, DynamicLossScale):
    jax.tree_util.register_dataclass(_cls)
    flax.serialization.register_serialization_state(_cls, _to_state_dict, _from_state_dict)

LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale


def all_finite(tree: Any, axis_name: Any = None) -> jax.Array:
    """Returns a scalar bool: whether every floating leaf of `tree` is finite.

    `x - x` is NaN exactly where `x` is inf or NaN (a plain sum could overflow
    from finite values; `x * 0` is wrong under `jit`, where XLA folds
    `(y * 4) * 0` into `y * 0`, which is 0 for a `y * 4` that overflows). Small
    leaves of the same shape and dtype are added together element-wise first,
    so there is one reduction per distinct shape rather than one per leaf
    (kernel launches dominate for small leaves); large leaves are reduced one
    by one, which needs no temporary buffer. Non-floating leaves are ignored;
    an empty tree is finite.

    Args:
      tree: any pytree.
      axis_name: a mapped axis name (or tuple of names) of `pmap`/`shard_map`;
        when given, the result is True only if it is True on every device, so
        all replicas take the same decision.

    Returns:
      A scalar bool array.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jmp_policy as jmp
      >>> bool(jmp.all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
      False
      >>> bool(jmp.all_finite({"step": jnp.int32(3)}))
      True
    """
    leaves = jax.tree.leaves(tree)
    groups = _groups(leaves)
    if not groups:
        return _agree(jnp.asarray(True), axis_name)
    flags = []
    for positions in groups.values():
        nans = [leaves[i] - leaves[i] for i in positions]
        while len(nans) > 1:  # a balanced tree of adds: XLA fuses it into one loop
            pairs = range(0, len(nans) - 1, 2)
            nans = [nans[i] + nans[i + 1] for i in pairs] + nans[len(nans) - len(nans) % 2 :]
        flags.append(_sum_is_finite(nans[0]))
    return _agree(jnp.stack(flags).all(), axis_name)


def _groups(leaves: list) -> dict[Any, list[int]]:
    """Positions of the floating leaves, grouped: small leaves by shape and dtype, large alone."""
    groups: dict[Any, list[int]] = {}
    for i, x in enumerate(leaves):
        if is_floating_array(x):
            key = (x.shape, x.dtype) if x.size < _GROUPED_LEAF_SIZE else i
            groups.setdefault(key, []).append(i)
    return groups


def _sum_is_finite(nans: jax.Array) -> jax.Array:
    # `nans` holds only zeros and NaNs: the sum is NaN exactly when one is.
    return jnp.isfinite(jnp.sum(nans, dtype=jnp.float32))


def _agree(finite: jax.Array, axis_name: Any) -> jax.Array:
    if axis_name is None:
        return finite
    return lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)


def leaf_finite_vector(tree: Any, axis_name: Any = None) -> jax.Array:
    """Returns one bool per leaf of `tree`, packed in a vector: whether that leaf is finite.

    Leaves are in `jax.tree.leaves` order; non-floating leaves are True. With
    `axis_name` the flags are agreed across devices in one collective.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jmp_policy as jmp
      >>> jmp.leaf_finite_vector({"a": jnp.ones(2), "b": jnp.array([jnp.nan]), "n": 3})
      Array([ True, False,  True], dtype=bool)
    """
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.zeros((0,), jnp.bool_)
    # As in `all_finite`: small leaves of one shape and dtype are stacked and
    # reduced together (one reduction per shape, not per leaf: a transformer's
    # hundreds of leaves have a dozen shapes), large ones one by one. The flags
    # come back in leaf order through one static permutation.
    order: list[int] = []
    parts = []
    for positions in _groups(leaves).values():
        stacked = jnp.stack([leaves[i] for i in positions]).reshape(len(positions), -1)
        parts.append(jnp.isfinite(jnp.sum(stacked - stacked, axis=1, dtype=jnp.float32)))
        order += positions
    grouped = set(order)
    others = [i for i in range(len(leaves)) if i not in grouped]
    parts.append(jnp.ones(len(others), jnp.bool_))
    finite = jnp.concatenate(parts)[np.argsort(order + others)]
    return _agree(finite, axis_name)


def leaf_finite_flags(tree: T, axis_name: Any = None) -> T:
    """Returns `tree` with a scalar bool at every leaf: whether that leaf is finite.

    `leaf_finite_vector`, unpacked into the structure of `tree`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jmp_policy as jmp
      >>> jmp.leaf_finite_flags({"a": jnp.ones(2), "b": jnp.array([jnp.nan])})
      {'a': Array(True, dtype=bool), 'b': Array(False, dtype=bool)}
    """
    leaves, treedef = jax.tree.flatten(tree)
    flags = leaf_finite_vector(leaves, axis_name)
    return jax.tree.unflatten(treedef, [flags[i] for i in range(len(leaves))])


def select_tree(pred: Any, a: T, b: T) -> T:
    """Returns `a` where the scalar bool `pred` is True, else `b`, leaf by leaf.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jmp_policy as jmp
      >>> jmp.select_tree(jnp.asarray(False), {"x": jnp.ones(2)}, {"x": jnp.zeros(2)})
      {'x': Array([0., 0.], dtype=float32)}
    """
    pred = _check_flag(pred, "pred")
    return jax.tree.map(functools.partial(lax.select, pred), a, b)
