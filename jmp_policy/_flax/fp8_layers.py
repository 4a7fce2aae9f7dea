"""`mixed_float8` with a `DelayedScaling` recipe in Flax's Dense/Linear layers: the
`dot_general` each float8 layer takes, holding its matmul's delayed-scaling state as model
state (`_fp8_state`): in Linen a variable of the `"fp8_state"` collection, made at `init`; in
NNX an `Fp8State` (an `nnx.Param`, so `nnx.grad` and `nnx.Optimizer` see it) of a submodule.
A matmul whose sizes a float8 GEMM does not take runs as `lax.dot_general` and leaves its
state as it is."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
from flax import nnx
from jax import lax

from jmp_policy._fp8.delayed import DelayedScaling
from jmp_policy._fp8.state import FP8_STATE, checked_scaling, delayed_dot_general
from jmp_policy.fp8 import fp8_eligible


def _dot(lhs, rhs, dimension_numbers, state, recipe, precision, preferred, kwargs):
    placed = any(v is not None for v in kwargs.values())  # e.g. nnx's out_sharding
    if placed or fp8_eligible(lhs.shape, rhs.shape, dimension_numbers, recipe.fmt) is not None:
        return lax.dot_general(
            lhs, rhs, dimension_numbers, precision=precision,
            preferred_element_type=preferred, **kwargs,
        )  # fmt: skip
    return delayed_dot_general(lhs, rhs, dimension_numbers, state(), recipe, out_dtype=preferred)


class LinenDelayedDot:
    """The `dot_general` of one bound Linen layer (`linen.mixed_precision` sets it on the
    layer's per-call clone): its state is the layer's `"fp8_state"` variable
    `"matmul"`, made by `init`."""

    def __init__(self, module: nn.Module, recipe: DelayedScaling):
        self.module = module
        self.recipe = recipe

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
            return module.variable(FP8_STATE, "matmul", self.recipe.init).value

        return _dot(
            lhs, rhs, dimension_numbers, state, self.recipe, precision, preferred_element_type,
            kwargs,
        )  # fmt: skip


class Fp8State(nnx.Param):
    """An NNX layer's float8 delayed-scaling state (an `Fp8DotState`). A `Param`, so that
    `nnx.grad` differentiates it and `nnx.Optimizer` gives its gradient (its next value) to
    the `loss_scaling` optimizer, which writes it."""


class NnxDelayedDot(nnx.Module):
    """The `dot_general` `nnx.mixed_precision` gives a float8 `Linear`/`LinearGeneral` under a
    `DelayedScaling` recipe: a submodule holding the matmul's `Fp8State`."""

    def __init__(self, recipe: DelayedScaling):
        self.recipe = recipe
        self.state = Fp8State(recipe.init())

    def __call__(
        self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs
    ):
        return _dot(
            lhs, rhs, dimension_numbers, self.state.get_value, self.recipe, precision,
            preferred_element_type, kwargs,
        )  # fmt: skip


def is_delayed_dot(x: Any) -> bool:
    return isinstance(x, (LinenDelayedDot, NnxDelayedDot))


def layer_recipe(fp8_scaling: Any, policy: Any) -> DelayedScaling | None:
    """The `fp8_scaling` of `linen`/`nnx.mixed_precision`: None for "tensorwise" (current
    scaling, `Fp8DotGeneral`), or the `DelayedScaling` recipe ("delayed": the default one)."""
    scaling = checked_scaling(fp8_scaling, policy)
    if isinstance(scaling, DelayedScaling):
        return scaling
    if scaling != "tensorwise":
        raise ValueError(
            f"Unknown `fp8_scaling` {fp8_scaling!r} for a Flax integration: expected "
            "'tensorwise', 'delayed' or a jmp_policy.fp8.DelayedScaling recipe (rowwise "
            "scaling: `jmp_policy.autocast(..., fp8_scaling='rowwise')`)."
        )
    return None
