"""What each primitive means to mixed precision, the one table every module asks (`RULES`,
`rule_of`): runs in the compute dtype (matmuls), in float32 (the float32 list), only in float32
(no half kernel), in its operands' dtype, or as traced; whether it is elementwise (operands
broadcast to its output), linear, a reduction, or a layout change; and what an autocast region
keeps for the backward pass (`kept_for_backward`, `kept_in_half`). Primitives are found by the
names the installed JAX gives them (`jmp_policy._core.jaxpr` reads the programs)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.extend.core import primitives as _primitives

from jmp_policy._core.jaxpr import (
    CUSTOM_DERIVATIVES,
    RAGGED_DOT,
    STRUCTURAL,
    is_call,
    is_callback,
    sub_programs,
)

COMPUTE = "compute"
"""Runs in the compute dtype (torch.amp's "lower precision" list): matmuls and convolutions."""
FLOAT32 = "float32"
"""Runs in float32 (torch.amp's "float32" list): exp, log, powers, roots, sums, products."""
NO_HALF_KERNEL = "no half kernel"
"""Runs in float32 whatever a user's lists say: decompositions and FFTs have no 16-bit kernel."""
OPERANDS = "operands"
"""Runs in the dtype its operands meet in (`jmp_policy._autocast.activations.meet`)."""
AS_TRACED = "as traced"
"""Runs on its operands in the dtypes it was traced with (bit casts, opaque sub-programs)."""


@dataclasses.dataclass(frozen=True)
class Rule:
    """What one primitive means to mixed precision.

    `runs_in`: `COMPUTE`, `FLOAT32`, `NO_HALF_KERNEL`, `OPERANDS` or `AS_TRACED`.
    `elementwise`: its operands broadcast to its output (a scalar operand implicitly), so an
    operand may be broadcast to the output's shape before it is cast.
    `linear`: its derivative needs none of its floating operands (it keeps nothing for the
    backward pass whatever their dtype).
    `reduction`: it adds (or multiplies) many values into fewer, so its precision is that of
    an accumulator: a result computed from activations is a statistic.
    `layout`: it moves every value without dropping or combining any, so a cast commutes
    with it.
    `adds_in_transpose`: its backward pass adds many cotangents into one value (a gather's
    transpose is a scatter-add: every edge a graph's hub sends adds into the hub; `top_k`'s
    derivative is such a gather; `reduce_max`'s sums the tangents of the entries that tie and
    counts them), so that sum is made in float32.
    `kept`: its outputs are worth keeping for the backward pass rather than computing again
    (matmuls, decompositions, sorts, collectives); what is not kept, autocast recomputes
    from what is (`kept_for_backward`).
    """

    runs_in: str
    elementwise: bool = False
    linear: bool = False
    reduction: bool = False
    layout: bool = False
    adds_in_transpose: bool = False
    kept: bool = False


_ELEMENTWISE = Rule(OPERANDS, elementwise=True)
_ELEMENTWISE_LINEAR = Rule(OPERANDS, elementwise=True, linear=True)
_FLOAT32_ELEMENTWISE = Rule(FLOAT32, elementwise=True)
_LINEAR = Rule(OPERANDS, linear=True)
_LAYOUT = Rule(OPERANDS, linear=True, layout=True)
_FOLLOWS = Rule(OPERANDS)

# One line per rule: primitive names as the installed JAX spells them.
_TABLE_BY_NAME: dict[str, Rule] = {
    **dict.fromkeys(
        ["dot_general", "conv_general_dilated", RAGGED_DOT.name], Rule(COMPUTE, kept=True)
    ),
    **dict.fromkeys(
        "exp exp2 log log1p expm1 pow integer_pow square sqrt rsqrt cbrt logistic erf erfc "
        "erf_inv lgamma digamma".split(),
        _FLOAT32_ELEMENTWISE,
    ),
    "reduce_sum": Rule(FLOAT32, linear=True, reduction=True),
    "reduce_prod": Rule(FLOAT32, reduction=True),
    "cumsum": Rule(FLOAT32, linear=True),
    **dict.fromkeys("cumprod cumlogsumexp".split(), Rule(FLOAT32)),
    **dict.fromkeys(
        "cholesky eig eigh fft geqp3 geqrf hessenberg householder_product lu ormqr qr schur "
        "svd triangular_solve tridiagonal tridiagonal_solve".split(),
        Rule(NO_HALF_KERNEL, kept=True),
    ),
    **dict.fromkeys(
        "add sub neg add_any convert_element_type copy copy_p select_n real imag complex "
        "conj".split(),
        _ELEMENTWISE_LINEAR,
    ),
    **dict.fromkeys(
        "mul div rem max min atan2 nextafter abs sign floor ceil round is_finite sin cos tan "
        "asin acos atan sinh cosh tanh asinh acosh atanh clamp reduce_precision igamma igammac "
        "igamma_grad_a random_gamma_grad bessel_i0e bessel_i1e zeta polygamma "
        "regularized_incomplete_beta eq ne lt le gt ge eq_to lt_to le_to and or not xor "
        "shift_left shift_right_arithmetic shift_right_logical population_count clz".split(),
        _ELEMENTWISE,
    ),
    **dict.fromkeys("broadcast_in_dim reshape transpose squeeze".split(), _LAYOUT),
    **dict.fromkeys(
        "slice dynamic_slice dynamic_update_slice concatenate stack pad rev split scatter "
        "stop_gradient select_and_gather_add".split(),
        _LINEAR,
    ),
    "gather": Rule(OPERANDS, linear=True, adds_in_transpose=True),
    # segment sums (`jax.ops.segment_sum`, jraph's aggregations) and `.at[].add`
    "scatter-add": Rule(FLOAT32, linear=True, reduction=True),
    **dict.fromkeys(
        "reduce_window_sum select_and_scatter_add".split(),
        Rule(OPERANDS, linear=True, reduction=True),
    ),
    "scatter-mul": Rule(OPERANDS, reduction=True),
    **dict.fromkeys(
        "argmax argmin reduce_and reduce_or reduce_xor reduce_window_max "
        "reduce_window_min cummax cummin scatter-max scatter-min select_and_scatter iota "
        "random_bits random_fold_in random_gamma random_seed random_split random_wrap "
        "random_unwrap threefry2x32 rng_bit_generator rng_uniform sharding_constraint "
        "device_put optimization_barrier pvary pbroadcast axis_index mesh_cast reshard "
        "platform_index".split(),
        _FOLLOWS,
    ),
    # Sorts, and collectives (computing them again would communicate again).
    **dict.fromkeys(
        "sort psum pmax pmin psum_invariant all_gather all_to_all ppermute ragged_all_to_all "
        "reduce_scatter".split(),
        Rule(OPERANDS, kept=True),
    ),
    # A maximum or minimum over an axis: a statistic, in float32 (softmax's and log-softmax's
    # shift `x - max(x)`, computed on in float32 to the `exp` after it, as the policies do where
    # the model asks for float32 scores or casts its logits to float32). Its derivative sums
    # the tangents of the entries that tie for it and counts them.
    **dict.fromkeys(
        "reduce_max reduce_min".split(),
        Rule(FLOAT32, reduction=True, adds_in_transpose=True),
    ),
    # a selection: its derivative gathers the chosen entries, its transpose scatter-adds them
    **dict.fromkeys(
        "top_k approx_top_k".split(), Rule(OPERANDS, kept=True, adds_in_transpose=True)
    ),
    **dict.fromkeys(
        "bitcast_convert_type custom_lin reduce reduce_window create_token after_all get swap "
        "empty2 name".split(),
        Rule(AS_TRACED),
    ),
    **dict.fromkeys(["custom_linear_solve", "xla_pmap"], Rule(AS_TRACED, kept=True)),
    # Equinox's own primitives, in the loops diffrax's solvers run: a buffer write, a select
    # made only under vmap (data movement, in the dtypes the loop carries), and `vprim`, the
    # primitive Equinox's batching-aware primitives bind (in the adjoint's backward pass)
    **dict.fromkeys(["maybe_set", "select_if_vmap", "vprim"], Rule(AS_TRACED)),
}

_EXPORTED = {p.name: p for p in vars(_primitives).values() if isinstance(p, jcore.Primitive)}
_EXPORTED.setdefault(RAGGED_DOT.name, RAGGED_DOT)

RULES: dict[Any, Rule] = {
    _EXPORTED[name]: rule for name, rule in _TABLE_BY_NAME.items() if name in _EXPORTED
}
"""The rule of each primitive object of the installed JAX that has one (`rule_of` also finds
those it binds but does not export, by name)."""
RULES_BY_NAME: dict[str, Rule] = {
    name: rule for name, rule in _TABLE_BY_NAME.items() if name not in _EXPORTED
}
"""The rules of primitives `jax.extend.core.primitives` does not export (`split`,
`optimization_barrier`, `geqrf`, ...), by name; tests/test_jaxpr.py checks the list."""


def rule_of(primitive: Any) -> Rule | None:
    """The `Rule` of `primitive` (an object, or an equation's), or None: a primitive this
    library has no rule for (autocast runs it as traced, and says so)."""
    primitive = getattr(primitive, "primitive", primitive)
    rule = RULES.get(primitive)
    return rule if rule is not None else RULES_BY_NAME.get(primitive.name)


def kept_for_backward(eqn: Any) -> bool:
    """Whether `eqn`'s outputs are kept for the backward pass rather than computed again from
    what is kept (`Rule.kept`): a primitive without a rule, a host callback and an opaque
    sub-program are kept too (computing them again may cost anything). For a call, a loop, a
    branch, a remat or a custom derivative, what runs inside decides (False)."""
    if eqn.primitive in STRUCTURAL or eqn.primitive in CUSTOM_DERIVATIVES or is_call(eqn):
        return False
    rule = rule_of(eqn)
    return rule is None or rule.kept or is_callback(eqn) or bool(sub_programs(eqn))


_TRANSCENDENTAL = frozenset(
    "tanh sin cos tan asin acos atan atan2 sinh cosh asinh acosh atanh exp exp2 log log1p "
    "expm1 logistic erf erfc erf_inv pow lgamma digamma".split()
)
_HALF = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def kept_in_half(primitive: Any, avals: Sequence[Any]) -> bool:
    """Whether a transcendental function computed in half precision (an activation's `tanh`,
    as GELU's approximation and Flax's `tanh` layers run it) has its output kept for the
    backward pass rather than computed again: its derivative reads that output, and running it
    twice costs more than an elementwise sum does. One half-precision value per call; in
    float32 (autocast's islands) it is computed again from its half input."""
    floating = [a for a in avals if jnp.issubdtype(getattr(a, "dtype", np.int32), jnp.floating)]
    return (
        primitive.name in _TRANSCENDENTAL
        and bool(floating)
        and all(a.dtype in _HALF for a in floating)
    )


def names_running_in(runs_in: str) -> frozenset[str]:
    """The names of the primitives whose rule runs in `runs_in` (for lists users write by
    name: autocast's `allow` and `deny`)."""
    return frozenset(name for name, rule in _TABLE_BY_NAME.items() if rule.runs_in == runs_in)
