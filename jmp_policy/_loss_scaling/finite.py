"""Finite checks of gradient pytrees: one answer, per-leaf flags, agreed across devices.

`all_finite` adds `x - x` (NaN exactly where `x` is inf or NaN) over small
leaves of one shape; per-leaf answers come from every leaf's largest
magnitude (`leaf_max_abs`). `unscaled_leaf_finite` is the check
`loss_scaling` runs on the gradients of a scaled loss.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, TypeVar

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_policy.policy import is_floating_array

if TYPE_CHECKING:
    from jmp_policy._loss_scaling.loss_scale import LossScale

T = TypeVar("T")

# Leaves smaller than this are added together (all_finite) or stacked
# (leaf_max_abs) with the others of their shape before reducing.
_GROUPED_LEAF_SIZE = 2**16


def all_finite(tree: chex.ArrayTree, axis_name: Hashable | None = None) -> jax.Array:
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
        return agree(jnp.asarray(True), axis_name)
    flags = []
    for positions in groups.values():
        nans = [leaves[i] - leaves[i] for i in positions]
        while len(nans) > 1:  # a balanced tree of adds: XLA fuses it into one loop
            pairs = range(0, len(nans) - 1, 2)
            nans = [nans[i] + nans[i + 1] for i in pairs] + nans[len(nans) - len(nans) % 2 :]
        flags.append(_sum_is_finite(nans[0]))
    return agree(jnp.stack(flags).all(), axis_name)


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


def agree(finite: jax.Array, axis_name: Hashable | None) -> jax.Array:
    """`finite` (bool), True only where it is True on every device of `axis_name` (None: as is)."""
    if axis_name is None:
        return finite
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if not names or any(not isinstance(n, str) for n in names):
        raise TypeError(
            "Expected a mapped axis name (a string, e.g. 'batch', or a tuple of them) or None "
            f"for `axis_name`, got {axis_name!r}."
        )
    return lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)


def leaf_max_abs(tree: chex.ArrayTree) -> jax.Array:
    """Returns the largest magnitude of every leaf of `tree`, packed in a vector.

    A NaN counts as inf, so an entry is finite exactly when its leaf is (a
    maximum reduction on CPU may drop NaNs, so they are never left to it); 0
    for non-floating leaves. Leaves are in `jax.tree.leaves` order, and the
    vector's dtype is float32, or the widest floating dtype of the leaves if
    that is wider; the maxima are exact (a maximum is one of the values).
    Small leaves of one shape and dtype are stacked and reduced together (one
    reduction per shape, not per leaf: a transformer's hundreds of leaves have
    a dozen shapes), large ones one by one. The results come back in leaf
    order through one static permutation.

    A function applied to every value that keeps their order, such as the
    division by a positive loss scale, is finite on every value exactly when
    it is finite on the maxima: `isfinite(loss_scale.unscale(leaf_max_abs(g)))`
    tells which leaves of `loss_scale.unscale(g)` are finite without
    computing it.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jmp_policy._loss_scaling.finite import leaf_max_abs
      >>> leaf_max_abs({"a": jnp.array([1.0, -3.0]), "b": jnp.array([jnp.nan]), "n": 3})
      Array([ 3., inf,  0.], dtype=float32)
    """
    leaves = jax.tree.leaves(tree)
    groups = _groups(leaves)
    dtype = max(
        (jnp.dtype(jnp.float32), *(leaves[p[0]].dtype for p in groups.values())),
        key=lambda d: d.itemsize,
    )
    order: list[int] = []
    parts = []
    for positions in groups.values():
        stacked = jnp.stack([leaves[i] for i in positions]).reshape(len(positions), -1)
        magnitudes = jnp.where(jnp.isnan(stacked), jnp.inf, jnp.abs(stacked))
        parts.append(jnp.max(magnitudes, axis=1, initial=0).astype(dtype))
        order += positions
    grouped = set(order)
    others = [i for i in range(len(leaves)) if i not in grouped]
    parts.append(jnp.zeros(len(others), dtype))
    return jnp.concatenate(parts)[np.argsort(order + others)]


def global_norm(tree: chex.ArrayTree) -> jax.Array:
    """`optax.tree.norm(tree)` (the L2 norm of every floating leaf together, in float32), with
    the leaves reduced as `leaf_max_abs` reduces them: small leaves of one shape and dtype
    stacked into one reduction, so a transformer's hundreds of leaves cost a dozen.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jmp_policy._loss_scaling.finite import global_norm
      >>> float(global_norm({"a": jnp.array([3.0]), "b": jnp.array([4.0]), "n": 3}))
      5.0
    """
    leaves = jax.tree.leaves(tree)
    total = jnp.zeros((), jnp.float32)
    for positions in _groups(leaves).values():
        stacked = jnp.stack([leaves[i] for i in positions]).astype(jnp.float32)
        total = total + jnp.sum(jnp.square(stacked))
    return jnp.sqrt(total)


def leaf_finite_vector(tree: chex.ArrayTree, axis_name: Hashable | None = None) -> jax.Array:
    """Returns one bool per leaf of `tree`, packed in a vector: whether that leaf is finite.

    Leaves are in `jax.tree.leaves` order; non-floating leaves are True. With
    `axis_name` the flags are agreed across devices in one collective.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jmp_policy._loss_scaling.finite import leaf_finite_vector
      >>> leaf_finite_vector({"a": jnp.ones(2), "b": jnp.array([jnp.nan]), "n": 3})
      Array([ True, False,  True], dtype=bool)
    """
    return agree(jnp.isfinite(leaf_max_abs(tree)), axis_name)


def leaf_finite_flags(tree: T, axis_name: Hashable | None = None) -> T:
    """Returns `tree` with a scalar bool at every leaf: whether that leaf is finite.

    `leaf_finite_vector`, unpacked into the structure of `tree`.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jmp_policy._loss_scaling.finite import leaf_finite_flags
      >>> leaf_finite_flags({"a": jnp.ones(2), "b": jnp.array([jnp.nan])})
      {'a': Array(True, dtype=bool), 'b': Array(False, dtype=bool)}
    """
    leaves, treedef = jax.tree.flatten(tree)
    flags = leaf_finite_vector(leaves, axis_name)
    return jax.tree.unflatten(treedef, [flags[i] for i in range(len(leaves))])


def unscaled_leaf_finite(
    scaled_grads: chex.ArrayTree, loss_scale: LossScale, axis_name: Hashable | None
) -> jax.Array:
    """One bool per leaf: whether `loss_scale.unscale(scaled_grads)` is finite there.

    Exact, and agreed across devices with `axis_name` (one collective). The
    unscaled gradients are never computed: unscaling divides by S > 0, which
    keeps the values' order, so only every leaf's largest magnitude is
    unscaled (`leaf_max_abs`). The check reads the scaled gradients once, in
    one reduction per distinct leaf shape.
    """
    return agree(jnp.isfinite(loss_scale.unscale(leaf_max_abs(scaled_grads))), axis_name)
