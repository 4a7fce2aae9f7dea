"""How one operation runs under autocast's rules: the op lists, the rules of a policy,
the kinds of values (`jmp_policy.activations`), float32 islands and half-precision
quotients, and a matmul's operands (`jmp_policy.matmul`, float8)."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_policy import _jaxpr
from jmp_policy.activations import (
    ACTIVATION,
    ISLAND,
    STATISTIC,
    WEIGHT,
    combined,
    kind_of_dtype,
    meet,
    weight_at_use,
)
from jmp_policy.fp8 import (
    float8_format,
    fp8_dot_general,
    fp8_eligible,
    fp8_excluded_by,
)
from jmp_policy.matmul import mixed
from jmp_policy.policy import Policy, casting_policy

ALLOW = _jaxpr.matmul_names()
"""Primitives that run in the compute dtype (torch.amp's "lower precision" list): the matmuls
of `_jaxpr.MATMULS` by their names in the installed JAX (`dot_general`,
`conv_general_dilated`, and `ragged_dot_general`, what `lax.ragged_dot` binds)."""

DENY = frozenset(
    {
        "exp",
        "exp2",
        "log",
        "log1p",
        "expm1",
        "pow",
        "integer_pow",
        "square",
        "sqrt",
        "rsqrt",
        "cbrt",
        "logistic",
        "erf",
        "erfc",
        "erf_inv",
        "lgamma",
        "digamma",
        "reduce_sum",
        "reduce_prod",
        "cumsum",
        "cumprod",
        "cumlogsumexp",
    }
)
"""Primitives that run in float32 (torch.amp's "float32" list, as JAX lowers it)."""

# Linear-algebra decompositions and FFTs: no half-precision kernels (XLA and
# LAPACK have none; `rfft` refuses float16), and torch.amp keeps them in float32
# too. They run in float32 whatever `allow` and `deny` say.
NO_HALF_KERNEL = frozenset(
    {
        "cholesky",
        "eig",
        "eigh",
        "fft",
        "geqp3",
        "geqrf",
        "hessenberg",
        "householder_product",
        "lu",
        "ormqr",
        "qr",
        "schur",
        "svd",
        "triangular_solve",
        "tridiagonal",
        "tridiagonal_solve",
    }
)
"""Primitives that always run in float32: they have no half-precision kernel."""

# Regions made by autocast/full_precision: kept as they are when nested.
_REGION_NAMES = ("jmp_autocast_region", "jmp_full_precision_region", "jmp_cast_at_use")
_CAST_AT_USE = "jmp_cast_at_use"
_FLOAT32 = np.dtype(np.float32)
# Run through `jmp_policy.matmul.mixed` when `reduce_dtype`/`accumulate_dtype` ask for it,
# with lax's functions (they take the equations' parameters as keywords).
_LAX_MATMULS = {"dot_general": lax.dot_general, "conv_general_dilated": lax.conv_general_dilated}
_MIXED = frozenset(_LAX_MATMULS)


@dataclasses.dataclass(frozen=True)
class _Rules:
    compute: np.dtype
    output: np.dtype
    allow: frozenset
    deny: frozenset
    # With a float8 compute dtype: eligible matmuls run as `fp8_dot_general`
    # with these (scaling, fmt), and `compute` is bfloat16 for everything else.
    fp8: tuple[str, str] | None = None
    fp8_exclude: tuple[str, ...] = ()
    # `jmp_policy.matmul`: float32 operands' gradients made in float32 (`reduce`), and
    # the matmul's result in `accumulate` (None: the compute dtype).
    reduce: bool = False
    accumulate: np.dtype | None = None
    # `cast_at_use`: the program runs as traced, except where a weight's 16-bit cast is used
    # (`_eval_cast_at_use`).
    at_use: bool = False

    @classmethod
    def of(
        cls,
        policy: Policy,
        allow: frozenset,
        deny: frozenset,
        fp8: tuple[str, str],
        fp8_exclude: tuple[str, ...],
        reduce: bool = False,
        accumulate: np.dtype | None = None,
    ) -> _Rules:
        if policy.compute_dtype.itemsize == 1:  # float8: matmuls only
            compute = casting_policy(policy).compute_dtype
            fp8 = (fp8[0], float8_format(policy.compute_dtype, fp8[1]))  # or block-scaled
            return cls(compute, policy.output_dtype, allow, deny, fp8, fp8_exclude)
        half = policy.compute_dtype != _FLOAT32
        return cls(
            policy.compute_dtype,
            policy.output_dtype,
            allow,
            deny,
            reduce=reduce and half,
            accumulate=accumulate if half else None,
        )


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def _cast(x: Any, dtype: Any) -> Any:
    if _is_float(x) and x.dtype != dtype:
        return lax.convert_element_type(x, dtype)
    return x


def _cast_like_avals(values: list, avals: Iterable) -> list:
    """Casts floating values back to the dtypes a sub-program was traced with."""
    return [
        _cast(v, a.dtype) if hasattr(a, "dtype") else v for v, a in zip(values, avals, strict=True)
    ]


def _widest(dtypes: list) -> Any:
    return max(dtypes, key=lambda d: jnp.finfo(d).bits)


_bind = _jaxpr.bind
_source_context = _jaxpr.source_context


# The kinds (`jmp_policy.activations`) of the float32 values computed so far, one record per
# evaluation on this thread: {id(value): (value, kind)} (the value is kept, so an id is never
# reused while it is recorded). Values not recorded are weights, or activations by dtype.
_KINDS = threading.local()
# The half-precision copy a float32 island value was kept as for the backward pass, likewise
# ({id(value): (value, copy)}): a matmul that takes the value in half precision takes that
# copy, so the backward pass keeps one.
_HALF_COPIES = threading.local()


def _recorded(record: threading.local, x: Any) -> Any:
    """What the current evaluation recorded of `x` in `record`, or None."""
    stack = getattr(record, "stack", None)
    found = stack[-1].get(id(x)) if stack else None
    return found[1] if found is not None and found[0] is x else None


def _remember(record: threading.local, x: Any, what: Any) -> None:
    stack = getattr(record, "stack", None)
    if stack:
        stack[-1][id(x)] = (x, what)


@contextlib.contextmanager
def _evaluation():
    """A new record of kinds and half-precision copies for one evaluation (nested ones too)."""
    for record in (_KINDS, _HALF_COPIES):
        record.stack = [*getattr(record, "stack", []), {}]
    try:
        yield
    finally:
        for record in (_KINDS, _HALF_COPIES):
            record.stack.pop()


def _kind(x: Any) -> str:
    return kind_of_dtype(x.dtype, _recorded(_KINDS, x))


def _record(values: Iterable, kind: str) -> None:
    if kind in (ISLAND, STATISTIC):
        for v in values:
            if _is_float(v) and v.dtype == _FLOAT32:
                _remember(_KINDS, v, kind)


def _inherit(outer: Iterable, inner: Iterable) -> None:
    """A body's inputs (new tracers) have the kinds of the values they stand for."""
    for o, i in zip(outer, inner, strict=True):
        if _is_float(o) and _is_float(i):
            _record([i], _kind(o))


def _kinds(values: Iterable) -> list:
    return [_kind(x) for x in values if _is_float(x)]


_REDUCTIONS = frozenset({"reduce_sum", "reduce_prod"})


# Primitives whose backward pass needs no operand (linear in every floating operand): they
# keep nothing for the backward pass whatever their dtype, and are bound as they are.
_LINEAR = frozenset(
    {
        "add",
        "sub",
        "neg",
        "reduce_sum",
        "cumsum",
        "broadcast_in_dim",
        "reshape",
        "transpose",
        "squeeze",
        "expand_dims",
        "convert_element_type",
        "select_n",
        "concatenate",
        "pad",
        "slice",
        "dynamic_slice",
        "gather",
        "copy",
        "copy_p",
        "stop_gradient",
    }
)


def _in_float32(eqn: Any, invals: list, half: np.dtype | None = None) -> list:
    """`eqn` computed in float32. With `half` (a float32 island inside a half-precision
    program), a nonlinear op on activations keeps its full-size operands for the backward pass
    in `half`, not float32: the island's memory is what the same model in `half` keeps."""
    kinds = [_kind(x) if _is_float(x) else None for x in invals]
    # Full-size operands (activations, and statistics or weights broadcast to their size);
    # smaller ones (a row's statistic, a weight as stored) stay float32: they cost little.
    size = max(np.size(x) for x in invals)
    on_activations = ACTIVATION in kinds or ISLAND in kinds
    keep = [
        i
        for i, x in enumerate(invals)
        if kinds[i] is not None and on_activations and size > 1 and np.size(x) == size
    ]
    if half is None or half == _FLOAT32 or not keep or eqn.primitive.name in _LINEAR:
        outs = _bind(eqn, [_cast(x, _FLOAT32) for x in invals])
    elif eqn.primitive.name == "div" and keep == [0]:
        outs = [_quotient_keeping_half(invals[0], invals[1], half, eqn)]
    else:
        outs = _keeping_half(eqn, invals, frozenset(keep), half)
    reduction = eqn.primitive.name in _REDUCTIONS
    _record(outs, combined([k for k in kinds if k is not None], reduction))
    return outs


def _half_of(x: Any, half: np.dtype) -> Any:
    copy = _recorded(_HALF_COPIES, x)
    return copy if copy is not None and copy.dtype == half else _cast(x, half)


def _quotient_keeping_half(a: Any, b: Any, half: np.dtype, eqn: Any) -> Any:
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

    a_dtype, b_dtype = a.dtype, b.dtype

    def backward(kept, cotangents):
        copy, wide_b = kept
        g = _cast(cotangents[0], _FLOAT32) + _cast(cotangents[1], _FLOAT32)
        ga = g / wide_b
        gb = -ga * _cast(copy, _FLOAT32)
        broadcast = tuple(i for i, n in enumerate(wide_b.shape) if n == 1 and gb.shape[i] != 1)
        gb = jnp.sum(gb, axis=broadcast, keepdims=True) if broadcast else gb
        return _cast(ga, a_dtype), _cast(jnp.broadcast_to(gb, wide_b.shape), b_dtype)

    quotient.defvjp(forward, backward)
    q, copy = quotient(a, b)
    _remember(_HALF_COPIES, q, copy)
    return q


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


# The weights and their casts in the program being evaluated (`cast_at_use`), one entry per
# evaluation on this thread: ({id(weight): weight}, {id(half cast): (half cast, weight)}).
_DOWNCASTS = threading.local()


def _downcasts() -> dict:
    return _DOWNCASTS.stack[-1][1]


def _eval_by_rules(eqn: Any, invals: list, floating: list, rules: _Rules) -> list:
    name = eqn.primitive.name
    if (
        rules.fp8
        and eqn.primitive is _jaxpr.DOT_GENERAL
        and name in rules.allow
        and len(floating) == 2
    ):
        lhs, rhs = invals
        dimension_numbers = eqn.params["dimension_numbers"]
        outer = _jaxpr.current_name_stack()
        where = "/".join(p for p in (outer, str(eqn.source_info.name_stack)) if p)
        scaling, fmt = rules.fp8
        if fp8_eligible(lhs.shape, rhs.shape, dimension_numbers, fmt) is None and (
            fp8_excluded_by(where, rules.fp8_exclude) is None
        ):
            with _source_context(eqn):
                out = fp8_dot_general(
                    lhs, rhs, dimension_numbers, fmt=fmt, scaling=scaling, out_dtype=rules.compute
                )
            return [out]
    if name in rules.allow and name in _MIXED and (rules.reduce or rules.accumulate is not None):
        # Only weights go in as float32 (their gradients made in float32): an activation
        # that is float32 here (an island's output) is cast first, so the matmul keeps its
        # half-precision copy for the backward pass, not the float32 one.
        lhs, rhs = (
            x if rules.reduce and _kind(x) == WEIGHT else _half_of(x, rules.compute) for x in invals
        )

        def op(lhs, rhs, preferred):
            # Through lax's functions, not `bind`: they add what the operands need
            # (e.g. `pvary` for a replicated weight inside `shard_map`).
            return _LAX_MATMULS[name](
                lhs, rhs, **{**eqn.params, "preferred_element_type": preferred}
            )

        with _source_context(eqn):
            return [mixed(op, rules.compute, rules.accumulate, lhs, rhs)]
    if name in rules.allow:
        target = rules.compute
        invals = [_half_of(x, target) for x in invals]
        if (
            "preferred_element_type" in eqn.params
            and eqn.params["preferred_element_type"] is not None
        ):
            # Output in the compute dtype: its backward matmuls stay in it too
            # (GPUs accumulate half-precision matmuls in float32 regardless).
            return _bind(eqn, invals, preferred_element_type=target)
        return _bind(eqn, invals)
    if name in rules.deny:
        return _in_float32(eqn, invals, rules.compute)
    strong = [i for i in floating if not getattr(eqn.invars[i].aval, "weak_type", False)]
    if not strong:
        outs = _bind(eqn, invals)
        _record(outs, combined(_kinds(invals)))
        return outs
    target, kind = meet([invals[i].dtype for i in strong], [_kind(invals[i]) for i in strong])
    if target == _FLOAT32 and kind == ISLAND:  # an island computing on activations
        return _in_float32(eqn, invals, rules.compute)
    shape = eqn.outvars[0].aval.shape if rules.reduce else None
    outs = _bind(eqn, [_meeting(x, target, shape) for x in invals])
    _record(outs, kind)
    return outs


def _meeting(x: Any, target: Any, shape: tuple | None) -> Any:
    """`x` cast to the dtype of the op it meets: a weight or constant cast down as
    `activations.weight_at_use` says (saturating; broadcast in float32 first with `shape`)."""
    if _is_float(x) and x.dtype != target and _kind(x) == WEIGHT:
        if np.ndim(x) != len(shape or ()):
            shape = None
        return weight_at_use(x, target, shape)
    return _cast(x, target)
