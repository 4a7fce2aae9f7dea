"""`mixed_float8` with a `DelayedScaling` recipe, and `mixed_nvfp4` with NVIDIA's training
recipe (`nvfp4.Recipe`), in Flax's Dense/Linear layers: the `dot_general` each such layer
takes, holding its matmul's state as model state (`_fp8_state`): in Linen a variable of the
`"fp8_state"` collection, made at `init`; in NNX an `Fp8State` (an `nnx.Param`, so `nnx.grad`
and `nnx.Optimizer` see it) of a submodule. A matmul whose sizes the format's GEMM does not
take runs as `lax.dot_general` and leaves its state as it is. NVFP4's state is the key of the
layer's draws, from the recipe's seed and (Linen) the layer's `"params"` RNG or (NNX) its module
path."""

from __future__ import annotations

import math
import zlib
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core.scope import LazyRng
from jax import lax

from jmp_policy import nvfp4
from jmp_policy._fp8.delayed import DelayedScaling
from jmp_policy._fp8.state import (
    FP8_STATE,
    checked_scaling,
    fresh_state,
    state_dot_general,
    stateful,
)
from jmp_policy.fp8 import fp8_eligible

Recipe = DelayedScaling | nvfp4.Recipe


def _ineligible(lhs, rhs, dimension_numbers, recipe: Recipe) -> str | None:
    if isinstance(recipe, nvfp4.Recipe):
        return nvfp4.linear_ineligible(lhs.shape, rhs.shape, dimension_numbers, recipe)
    return fp8_eligible(lhs.shape, rhs.shape, dimension_numbers, recipe.fmt)


def _dot(lhs, rhs, dimension_numbers, state, recipe, precision, preferred, kwargs):
    placed = any(v is not None for v in kwargs.values())  # e.g. nnx's out_sharding
    if placed or _ineligible(lhs, rhs, dimension_numbers, recipe) is not None:
        return lax.dot_general(
            lhs, rhs, dimension_numbers, precision=precision,
            preferred_element_type=preferred, **kwargs,
        )  # fmt: skip
    return state_dot_general(lhs, rhs, dimension_numbers, state(), recipe, out_dtype=preferred)


def _first_state(recipe: Recipe, path: tuple[str, ...]) -> Any:
    """A layer's first state: NVFP4's key folded from the recipe's seed by the layer's module
    path (the same in every process: `zlib.crc32`, not Python's salted hash)."""
    if not isinstance(recipe, nvfp4.Recipe):
        return fresh_state(recipe)
    where = zlib.crc32("/".join(path).encode())
    return fresh_state(recipe, jax.random.fold_in(jax.random.key(recipe.seed), where))


def _stacked_first_state(recipe: Recipe, path: tuple[str, ...], stacked: tuple[int, ...]) -> Any:
    """`_first_state` stacked over `stacked` leading axes: NVFP4's keys split over them (no two
    layers of a stack draw alike), float8's the same for each."""
    first = _first_state(recipe, path)
    if not stacked:
        return first
    if isinstance(recipe, nvfp4.Recipe):
        keys = jax.random.split(first.random_key(), math.prod(stacked))
        states = jax.vmap(lambda k: fresh_state(recipe, k))(keys)
        return jax.tree.map(lambda x: x.reshape(*stacked, *x.shape[1:]), states)
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (*stacked, *x.shape)).copy(), first)


def stacked_shape(module: Any) -> tuple[int, ...]:
    """The leading axes an NNX `Linear`/`LinearGeneral`'s kernel has beyond its own (layers
    made under `nnx.vmap`, run one at a time under `nnx.scan`); () for any other module."""
    if isinstance(module, nnx.LinearGeneral):
        own = len(module.in_features) + len(module.out_features) + len(module.batch_axis)
    elif isinstance(module, nnx.Linear):
        own = 2
    else:
        return ()
    shape = np.shape(module.kernel.get_value())
    return tuple(shape[: len(shape) - own])


def _format(recipe: Recipe) -> str:
    return "nvfp4" if isinstance(recipe, nvfp4.Recipe) else recipe.fmt


class LinenDelayedDot:
    """The `dot_general` of one bound Linen layer (`linen.mixed_precision` sets it on the
    layer's per-call clone): its state is the layer's `"fp8_state"` variable
    `"matmul"`, made by `init`."""

    def __init__(self, module: nn.Module, recipe: Recipe):
        self.module = module
        self.recipe = recipe
        self.fmt = _format(recipe)

    def __call__(
        self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs
    ):
        def state():
            module = self.module
            if not module.has_variable(FP8_STATE, "matmul") and not module.is_initializing():
                raise ValueError(
                    f"The variables given to `apply` have no {FP8_STATE!r} collection for "
                    f"{'/'.join(module.scope.path) if module.scope else 'this layer'}: a "
                    "mixed_float8 model with delayed scaling keeps each matmul's scales there. "
                    "Make the variables with this wrapper's `init`, and pass them all to "
                    "`apply` (and to `jax.grad`: the collection's gradient is its next value)."
                )
            return module.variable(FP8_STATE, "matmul", self._first_state).value

        return _dot(
            lhs, rhs, dimension_numbers, state, self.recipe, precision, preferred_element_type,
            kwargs,
        )  # fmt: skip

    def _first_state(self) -> object:
        """At `init`: NVFP4's key from the layer's `"params"` RNG (split per layer by `nn.scan`
        and `nn.vmap` with `split_rngs={"params": True}`, as its parameters are), with the
        recipe's seed folded in; else as `_first_state`. The RNG is read, not drawn from
        (`make_rng` would count a draw, and the layer's parameters would change)."""
        scope = self.module.scope
        if isinstance(self.recipe, nvfp4.Recipe) and scope is not None and scope.has_rng("params"):
            rng = LazyRng.create(scope.rngs["params"], "jmp_policy.nvfp4").as_jax_rng()
            return fresh_state(self.recipe, jax.random.fold_in(rng, self.recipe.seed))
        return _first_state(self.recipe, tuple(scope.path) if scope is not None else ())


class Fp8State(nnx.Param):
    """An NNX layer's float8 delayed-scaling state (an `Fp8DotState`). A `Param`, so that
    `nnx.grad` differentiates it and `nnx.Optimizer` gives its gradient (its next value) to
    the `loss_scaling` optimizer, which writes it."""


class NnxDelayedDot(nnx.Module):
    """The `dot_general` `nnx.mixed_precision` gives a float8 `Linear`/`LinearGeneral` under a
    `DelayedScaling` recipe (an NVFP4 one under `nvfp4.Recipe`): a submodule holding the
    matmul's `Fp8State`, stacked like the layer's kernel where the layer is (`stacked_shape`:
    layers made under `nnx.vmap` and run under `nnx.scan` take one state per layer)."""

    def __init__(self, recipe: Recipe, path: tuple[str, ...] = (), stacked: tuple[int, ...] = ()):
        self.recipe = recipe
        self.fmt = _format(recipe)
        self.state = Fp8State(_stacked_first_state(recipe, path, stacked))

    def __call__(
        self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs
    ):
        return _dot(
            lhs, rhs, dimension_numbers, self.state.get_value, self.recipe, precision,
            preferred_element_type, kwargs,
        )  # fmt: skip


def is_delayed_dot(x: Any) -> bool:
    return isinstance(x, (LinenDelayedDot, NnxDelayedDot))


def layer_recipe(fp8_scaling: Any, policy: Any) -> Recipe | None:
    """The `fp8_scaling` of `linen`/`nnx.mixed_precision`: None for "tensorwise" (current
    scaling, `Fp8DotGeneral`), the `DelayedScaling` recipe ("delayed": the default one), or
    NVFP4's `nvfp4.Recipe` (under `"mixed_nvfp4"`)."""
    scaling = checked_scaling(fp8_scaling, policy)
    recipe = stateful(scaling)
    if recipe is not None:
        return recipe
    if scaling != "tensorwise":
        raise ValueError(
            f"Unknown `fp8_scaling` {fp8_scaling!r} for a Flax integration: expected "
            "'tensorwise', 'delayed', a jmp_policy.fp8.DelayedScaling recipe or (under "
            "'mixed_nvfp4') a jmp_policy.nvfp4.Recipe (rowwise scaling: "
            "`jmp_policy.autocast(..., fp8_scaling='rowwise')`)."
        )
    return None
