"""Per-leaf flags packed in one array (`LeafFlags`), and reading a value on the host."""

from __future__ import annotations

import dataclasses
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy._core.pytree import register_state


def host_value(x: Any) -> np.ndarray:
    """`x` on the host; for an array spread over processes, this process's replica."""
    # Replicated values may be spread over processes; every process holds a copy.
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0)
    return np.asarray(jax.device_get(x))


@dataclasses.dataclass(frozen=True)
class LeafFlags:
    """A packed bool per leaf of a pytree: one array, whatever the leaf count.

    Attributes:
      flags: bool array of shape `(number of leaves,)` (a leading batch axis
        when the state is batched with `vmap`).
      treedef: the structure the flags belong to (static), so they can be
        read back per leaf (`tree()`) or by path (`paths()`).
    """

    flags: jax.Array
    treedef: Any = dataclasses.field(metadata=dict(static=True))  # a jax.tree_util.PyTreeDef

    def tree(self) -> chex.ArrayTree:
        """The flags as a pytree of bool scalars with `treedef`'s structure."""
        return jax.tree.unflatten(self.treedef, list(jnp.moveaxis(self.flags, -1, 0)))

    def paths(self) -> tuple[str, ...]:
        """The paths (`jax.tree_util.keystr`) of the leaves whose flag is True (host-side)."""
        numbered = jax.tree.unflatten(self.treedef, range(self.treedef.num_leaves))
        on = np.asarray(host_value(self.flags).reshape(-1, self.treedef.num_leaves).any(axis=0))
        return tuple(
            jax.tree_util.keystr(path)
            for path, i in jax.tree_util.tree_leaves_with_path(numbered)
            if on[i]
        )


register_state(LeafFlags)
