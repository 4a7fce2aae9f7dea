"""How one operation runs under autocast's rules (`_autocast_evaluation`: the rules of a
policy and what an evaluation records): the op lists, the kinds of values
(`jmp_policy._autocast.activations`), float32 islands and half-precision quotients, and a matmul's
operands (`jmp_policy.matmul`, float8)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_policy import nvfp4
from jmp_policy._autocast.activations import (
    ACTIVATION,
    ISLAND,
    WEIGHT,
    combined,
    meet,
    weight_at_use,
)
from jmp_policy._autocast.evaluation import (
    _FLOAT32,
    _cast,
    _Evaluation,
    _is_float,
)
from jmp_policy._core import jaxpr as _jaxpr
from jmp_policy._core import rules as _rules
from jmp_policy._core.naming import module_path
from jmp_policy._fp8.state import delayed_dot_general
from jmp_policy.block_scaled import MODES
from jmp_policy.fp8 import (
    DelayedScaling,
    fp8_dot_general,
    fp8_eligible,
    fp8_excluded_by,
)
from jmp_policy.matmul import dot_of, mixed

ALLOW = _rules.names_running_in(_rules.COMPUTE)
"""Primitives that run in the compute dtype (torch.amp's "lower precision" list): the matmuls
of `_jaxpr.MATMULS` by their names in the installed JAX (`dot_general`,
`conv_general_dilated`, and `ragged_dot_general`, what `lax.ragged_dot` binds)."""

DENY = _rules.names_running_in(_rules.FLOAT32)
"""Primitives that run in float32 (torch.amp's "float32" list, as JAX lowers it): exp, log,
powers and roots, erf, logistic, sums, products and cumulative sums, and maxima and minima over
an axis (softmax's shift) (`_rules.RULES`)."""

NO_HALF_KERNEL = _rules.names_running_in(_rules.NO_HALF_KERNEL)
"""Primitives that always run in float32: linear-algebra decompositions and FFTs have no
half-precision kernel (XLA and LAPACK have none; `rfft` refuses float16), and torch.amp keeps
them in float32 too."""

# Regions made by autocast/full_precision: kept as they are when nested.
_REGION_NAMES = ("jmp_autocast_region", "jmp_full_precision_region", "jmp_cast_at_use")
_CAST_AT_USE = "jmp_cast_at_use"
# Run through `jmp_policy.matmul.mixed` when `reduce_dtype`/`accumulate_dtype` ask for it,
# with lax's functions (they take the equations' parameters as keywords).
_LAX_MATMULS = _jaxpr.LAX_MATMULS
_bind = _jaxpr.bind
_source_context = _jaxpr.source_context


def _in_float32(ev: _Evaluation, eqn: Any, invals: list, half: np.dtype | None = None) -> list:
    """`eqn` computed in float32. With `half` (a float32 island inside a half-precision
    program), a nonlinear op on activations keeps its full-size operands for the backward pass
    in `half`, not float32: the island's memory is what the same model in `half` keeps."""
    kinds = [ev.kind(x) if _is_float(x) else None for x in invals]
    # Full-size operands (activations, and statistics or weights broadcast to their size);
    # smaller ones (a row's statistic, a weight as stored) stay float32: they cost little.
    size = max(np.size(x) for x in invals)
    on_activations = ACTIVATION in kinds or ISLAND in kinds
    keep = [
        i
        for i, x in enumerate(invals)
        if kinds[i] is not None and on_activations and size > 1 and np.size(x) == size
    ]
    # Under the region's checkpoint the island is computed again from its half-precision
    # input, which is kept (once), not made again from what came before it.
    invals = [ev.island_input(x) if i in keep else x for i, x in enumerate(invals)]
    rule = _rules.rule_of(eqn)
    if half is None or half == _FLOAT32 or not keep or (rule is not None and rule.linear):
        outs = _bind(eqn, [_cast(x, _FLOAT32) for x in invals])
    elif eqn.primitive is _jaxpr.DIV and keep == [0]:
        outs = [_quotient_keeping_half(ev, invals[0], invals[1], half, eqn)]
    else:
        outs = _keeping_half(eqn, invals, frozenset(keep), half)
    reduction = rule is not None and rule.reduction
    ev.record(outs, combined([k for k in kinds if k is not None], reduction))
    return outs


def _quotient_keeping_half(ev: _Evaluation, a: Any, b: Any, half: np.dtype, eqn: Any) -> Any:
    """`a / b` in float32 for an activation `a` and a statistic `b` (softmax's quotient, a
    normalised value): its derivative needs only the quotient and `b`, so the quotient's
    half-precision copy is kept (and taken by the matmul that follows), not `a`."""

    def run(a, b):
        return _bind(eqn, [_cast(a, _FLOAT32), _cast(b, _FLOAT32)])[0]

    @jax.custom_vjp
    def quotient(a, b):
        q = run(a, b)
        return q, _cast(q, half)

    def forward(a, b):
        q, copy = quotient(a, b)
        return (q, copy), (copy, _cast(b, _FLOAT32))

    a_dtype, b_dtype, b_shape = a.dtype, b.dtype, np.shape(b)

    def backward(kept, cotangents):
        copy, wide_b = kept
        g = _cast(cotangents[0], _FLOAT32) + _cast(cotangents[1], _FLOAT32)
        ga = g / wide_b
        return _cast(ga, a_dtype), _cast(_sum_to(-ga * _cast(copy, _FLOAT32), b_shape), b_dtype)

    quotient.defvjp(forward, backward)
    return quotient(a, b)[0]


def _sum_to(x: Any, shape: tuple) -> Any:
    """The cotangent `x` of an operand of `shape` that an elementwise op broadcast to
    `x.shape` (a scalar implicitly, size-1 axes explicitly): summed over what was broadcast."""
    if x.shape == tuple(shape):
        return x
    if len(shape) == 0:
        return jnp.sum(x)
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return jnp.sum(x, axis=axes, keepdims=True)


def _keeping_half(eqn: Any, invals: list, keep: frozenset, half: np.dtype) -> list:
    """`eqn` in float32, differentiated from the operands in `keep` stored in `half` (the
    backward pass recomputes the op's derivative in float32 from them)."""

    def run(*operands):
        return _bind(eqn, [_cast(x, _FLOAT32) for x in operands])

    @jax.custom_vjp
    def op(*operands):
        return run(*operands)

    def forward(*operands):
        kept = [_cast(x, half) if i in keep else x for i, x in enumerate(operands)]
        return run(*operands), kept

    def backward(kept, cotangents):
        floating = [i for i, x in enumerate(kept) if _is_float(x)]
        wide = [_cast(x, _FLOAT32) for x in kept]

        def of_floating(*values):
            full = list(wide)
            for i, v in zip(floating, values, strict=True):
                full[i] = v
            return run(*full)

        _, vjp = jax.vjp(of_floating, *[wide[i] for i in floating])
        grads = iter(vjp(list(cotangents)))
        return tuple(
            _cast(next(grads), x.dtype)
            if _is_float(x)
            else np.zeros(np.shape(x), jax.dtypes.float0)
            for x in invals
        )

    op.defvjp(forward, backward)
    return op(*invals)


def _half_among(values: Iterable) -> np.dtype | None:
    """The 16-bit floating dtype among `values` (None if there is none)."""
    for x in values:
        if _is_float(x) and jnp.finfo(x.dtype).bits == 16:
            return np.dtype(x.dtype)
    return None


def _sums_in_transpose(eqn: Any, invals: list) -> bool:
    """Whether `eqn`'s backward pass sums cotangents into each value of an operand: a gather
    or a selection (`Rule.adds_in_transpose`), or a broadcast that repeats its operand (a
    grouped-query attention's `jnp.repeat` of keys and values)."""
    rule = _rules.rule_of(eqn)
    if rule is not None and rule.adds_in_transpose:
        return True
    return _repeats(eqn, invals)


def _repeats(eqn: Any, invals: list) -> bool:
    return (
        eqn.primitive is _jaxpr.BROADCAST_IN_DIM
        and len(invals) == 1
        and np.size(invals[0]) < int(np.prod(eqn.outvars[0].aval.shape))
    )


def _adding_in_float32(eqn: Any, invals: list) -> list:
    """`_sums_in_transpose`'s equation with its backward pass's sum made in float32: a
    repeating broadcast as it is, its transpose (a sum) on the cotangent cast to float32; a
    maximum or minimum as it is, its derivative in float32 (`_choosing_in_float32`); any
    other (`_gathering_in_float32`) on operands cast to float32."""
    if eqn.primitive in _jaxpr.CHOOSERS:
        return _choosing_in_float32(eqn, invals)
    if not _repeats(eqn, invals):
        return _gathering_in_float32(eqn, invals)
    (x,) = invals

    @jax.custom_vjp
    def repeated(x):
        return _bind(eqn, [x])[0]

    def backward(_, cotangent):
        wide = jax.ShapeDtypeStruct(np.shape(x), _FLOAT32)
        (grad,) = jax.linear_transpose(lambda y: _bind(eqn, [y])[0], wide)(
            _cast(cotangent, _FLOAT32)
        )
        return (_cast(grad, x.dtype),)

    repeated.defvjp(lambda x: (repeated(x), None), backward)
    return [repeated(x)]


def _choosing_in_float32(eqn: Any, invals: list) -> list:
    """A `reduce_max`/`reduce_min` as it is, with JAX's derivative made in float32: the
    tangents of the entries that tie for the maximum summed, over their count (JAX's rule
    sums both in the operand's dtype)."""
    (x,) = invals
    axes = tuple(eqn.params["axes"])

    @jax.custom_jvp
    def chosen(x):
        return _bind(eqn, [x])[0]

    @chosen.defjvp
    def _(primals, tangents):
        (x,), (t,) = primals, tangents
        out = chosen(x)
        ties = lax.convert_element_type(x == lax.expand_dims(out, axes), _FLOAT32)
        tangent = jnp.sum(_cast(t, _FLOAT32) * ties, axes) / jnp.sum(ties, axes)
        return out, _cast(tangent, t.dtype)

    return [chosen(x)]


def _gathering_in_float32(eqn: Any, invals: list) -> list:
    """`eqn` (a gather or a selection: `Rule.adds_in_transpose`) on its floating operands
    cast to float32, its result cast back: the same values (it rounds nothing), and the
    backward pass's sum of the cotangents (a scatter-add) made in float32. It is
    linear: nothing of its operands is kept for the backward pass."""
    outs = _bind(eqn, [_cast(x, _FLOAT32) for x in invals])
    return [_cast(o, invals[0].dtype) for o in outs]


def _float8_matmul(ev: _Evaluation, eqn: Any, invals: list) -> list | None:
    """A float8 or block-scaled policy's rule for `dot_general`: in the policy's format where
    it can run in it (two floating operands, allowed, eligible, not excluded), else None (the
    compute dtype, by `_eval_by_rules`). Where it is, it is noted (`note_matmul`: the head
    left in a low-precision format is reported)."""
    rules = ev.rules
    assert rules.fp8 is not None  # the rule set of a float8 policy's region
    if eqn.primitive.name not in rules.allow or sum(map(_is_float, invals)) != 2:
        return None
    lhs, rhs = (ev.operand(x, x.dtype) for x in invals)
    dimension_numbers = eqn.params["dimension_numbers"]
    outer = _jaxpr.current_name_stack()
    where = "/".join(p for p in (outer, str(eqn.source_info.name_stack)) if p)
    scaling, fmt = rules.fp8
    side = None
    if isinstance(scaling, nvfp4.Recipe):  # linear layers only: attention in bfloat16
        side = _weight_side(ev, invals)
        shapes = (lhs.shape, rhs.shape, dimension_numbers, scaling)
        low = side is not None and nvfp4.linear_ineligible(*shapes, side) is None
    else:
        low = fp8_eligible(lhs.shape, rhs.shape, dimension_numbers, fmt) is None
    low = low and fp8_excluded_by(where, rules.fp8_exclude) is None
    fmt_name = (fmt if fmt in MODES else "float8") if low else None
    ev.note_matmul(module_path(where), fmt_name, invals)
    if not low:
        return None
    with _source_context(eqn):
        if not isinstance(scaling, (nvfp4.Recipe, DelayedScaling)):  # stateless scaling
            out = fp8_dot_general(
                lhs, rhs, dimension_numbers, fmt=fmt, scaling=scaling,
                out_dtype=rules.compute,
            )  # fmt: skip
        elif ev.sites is None:  # inside a custom derivative: no state, current scaling
            out = fp8_dot_general(lhs, rhs, dimension_numbers, fmt=fmt,
                                  out_dtype=rules.compute)  # fmt: skip
        elif isinstance(scaling, nvfp4.Recipe):
            out = nvfp4.linear_dot_general(
                lhs, rhs, dimension_numbers, ev.sites.state_for(eqn), scaling,
                weight=side or "rhs", out_dtype=rules.compute,
            )  # fmt: skip
        else:
            state = ev.sites.state_for(eqn)
            out = delayed_dot_general(
                lhs, rhs, dimension_numbers, state, scaling, out_dtype=rules.compute
            )
    return [out]


def _eval_by_rules(ev: _Evaluation, eqn: Any, invals: list, floating: list) -> list:
    rules, name = ev.rules, eqn.primitive.name
    mixed_ok = eqn.primitive in _LAX_MATMULS
    if name in rules.allow and mixed_ok and (rules.reduce or rules.accumulate is not None):
        # Only weights go in as float32 (their gradients made in float32): an activation
        # that is float32 here (an island's output) is cast first, so the matmul keeps its
        # half-precision copy for the backward pass, not the float32 one.
        lhs, rhs = (
            x if rules.reduce and ev.kind(x) == WEIGHT else ev.operand(x, rules.compute)
            for x in invals
        )

        def op(lhs, rhs, preferred):
            # Through lax's functions, not `bind`: they add what the operands need
            # (e.g. `pvary` for a replicated weight inside `shard_map`).
            return _LAX_MATMULS[eqn.primitive](
                lhs, rhs, **{**eqn.params, "preferred_element_type": preferred}
            )

        with _source_context(eqn):
            dot = dot_of(eqn.primitive, eqn.params)
            return [mixed(op, rules.compute, rules.accumulate, lhs, rhs, dot)]
    if name in rules.allow:
        target = rules.compute
        invals = [ev.operand(x, target) for x in invals]
        if (
            "preferred_element_type" in eqn.params
            and eqn.params["preferred_element_type"] is not None
        ):
            # Output in the compute dtype: its backward matmuls stay in it too
            # (GPUs accumulate half-precision matmuls in float32 regardless).
            return _bind(eqn, invals, preferred_element_type=target)
        return _bind(eqn, invals)
    # Float32 islands: under the region's `jax.checkpoint` (`ev.keeps`) they are computed
    # again in the backward pass from what it keeps, so nothing of theirs is kept.
    island_half = None if ev.keeps is not None else rules.compute
    if name in rules.deny:
        return _in_float32(ev, eqn, invals, island_half)
    strong = _strong(eqn, floating)
    if not strong:
        outs = _bind(eqn, invals)
        ev.record(outs, combined(ev.kinds_of(invals)))
        return outs
    target, kind = meet([invals[i].dtype for i in strong], [ev.kind(invals[i]) for i in strong])
    if target == _FLOAT32 and kind == ISLAND:  # an island computing on activations
        return _in_float32(ev, eqn, invals, island_half)
    # Only an elementwise op broadcasts its operands to its output's shape (a concatenation
    # or a scatter does not).
    rule = _rules.rule_of(eqn)
    elementwise = rule is not None and rule.elementwise
    shape = eqn.outvars[0].aval.shape if rules.reduce and elementwise else None
    met = [_meeting(ev, x, target, shape) for x in invals]
    if _sums_in_transpose(eqn, met) and _half_among(met) is not None:
        outs = _adding_in_float32(eqn, met)
    else:
        outs = _bind(eqn, met)
    ev.record(outs, kind)
    return outs


def _weight_side(ev: _Evaluation, invals: list) -> str | None:
    """Which operand of a matmul is a layer's weight: the one of kind `WEIGHT` (a float32
    value that no activation computed): "rhs" (Flax's `x @ kernel`), "lhs" (Equinox's
    `weight @ x`); where both are (a float32 input times a weight), the one among the first
    argument's leaves (`add_weight`: a model, Flax's variables), else "rhs"; None where
    neither is (two activations: attention's products, which the recipe leaves in bfloat16)."""
    lhs, rhs = (ev.kind(x) == WEIGHT for x in invals)
    if lhs and rhs:
        return "lhs" if ev.is_weight(invals[0]) and not ev.is_weight(invals[1]) else "rhs"
    if rhs:
        return "rhs"
    return "lhs" if lhs else None


def _strong(eqn: Any, floating: list) -> list:
    """The positions among `floating` whose operand is strongly typed (a Python scalar is
    weak): the operands `activations.meet` weighs."""
    return [i for i in floating if not getattr(eqn.invars[i].aval, "weak_type", False)]


def _meeting(ev: _Evaluation, x: Any, target: Any, shape: tuple | None) -> Any:
    """`x` cast to the dtype of the op it meets: a weight or constant cast down as
    `activations.weight_at_use` says (saturating; broadcast in float32 first with `shape`)."""
    if _is_float(x) and x.dtype != target and ev.kind(x) == WEIGHT:
        if np.ndim(x) != len(shape or ()):
            shape = None
        return weight_at_use(x, target, shape)
    return _cast(x, target)
