"""autocast: torch.amp's allow/deny op lists as a JAX function transform.

`autocast(fun, policy)` traces `fun` once per input signature and re-evaluates
its program with casts:

- allow-listed primitives (matmuls, convolutions) get compute-dtype operands;
- deny-listed primitives (exp, log, pow, sqrt/rsqrt, erf, logistic, sums,
  products and cumulative sums: what softmax, logsumexp, normalisation
  statistics and losses lower to) run in float32;
- everything else follows `jmp_policy.activations.meet`: where a half-precision
  activation meets a float32 weight, constant or island value (a bias add, a
  residual add after a norm), it runs in the activation's dtype, so activations
  stay in the compute dtype between the float32 islands; where it meets a
  float32 statistic (a mean, a variance, a log-sum-exp) it runs in float32;
  integer, bool and key values are never touched;
- the floating outputs are cast to `output_dtype`.

Nested `jit` is inlined; `scan`, `while_loop`, `cond`/`switch` and
`jax.checkpoint` are rebuilt with their bodies autocast (loop carries keep the
dtype of their initial value, branches agree on the widest dtype); functions
with custom derivatives (`custom_jvp`, `custom_vjp`) run as traced, so their
rules are kept exactly. `full_precision(fun)` marks a float32 region, and an
inner `autocast` with another policy is kept as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from jmp_policy import _jaxpr, _naming
from jmp_policy._compat import jaxprs_in_params
from jmp_policy._pytree import is_traced_leaf
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
    FORMATS,
    FP8_EXCLUDE,
    SCALINGS,
    float8_format,
    fp8_dot_general,
    fp8_eligible,
    fp8_excluded_by,
)
from jmp_policy.matmul import check_accumulate_dtype, check_reduce_dtype, mixed
from jmp_policy.overrides import FULL_PRECISION_REGION
from jmp_policy.policy import Policy, casting_policy, check_policy

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


def _known_primitives() -> frozenset:
    names = set()
    for module in (lax, jax.lax):
        for value in vars(module).values():
            if isinstance(value, jcore.Primitive):
                names.add(value.name)
    return frozenset(names)


def _check_names(names: Any, argument: str) -> frozenset:
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise TypeError(
            f"Expected a collection of primitive names (e.g. {{'dot_general'}}) for `{argument}`, "
            f"got {names!r}."
        )
    names = frozenset(names)
    bad = sorted(n for n in names if not isinstance(n, str))
    if bad:
        raise TypeError(f"Expected primitive names (strings) in `{argument}`, got {bad!r}.")
    unknown = sorted(names - _known_primitives() - ALLOW - DENY)
    if unknown:
        raise ValueError(
            f"Unknown primitive name(s) {unknown} in `{argument}`: use names as they appear in "
            "a jaxpr (`jax.make_jaxpr(f)(x)`), e.g. 'dot_general', 'exp', 'reduce_sum', or the "
            "names in jmp_policy.AUTOCAST_ALLOW / AUTOCAST_DENY."
        )
    return names


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


def _eval_jaxpr(jaxpr: Any, consts: list, args: list, rules: _Rules) -> list:
    return _jaxpr.evaluate(
        jaxpr, consts, args, lambda eqn, invals: _eval_equation(eqn, invals, rules)
    )


def _eval_closed(closed: Any, args: list, rules: _Rules) -> list:
    return _eval_jaxpr(closed.jaxpr, list(closed.consts), list(args), rules)


def _eval_equation(eqn: Any, invals: list, rules: _Rules) -> list:
    name = eqn.primitive.name
    if eqn.primitive in _jaxpr.STRUCTURAL or _jaxpr.is_call(eqn):
        return _eval_structural(eqn, invals, rules)
    if rules.at_use:
        return _eval_cast_at_use(eqn, invals)
    if eqn.primitive in _jaxpr.CUSTOM_DERIVATIVES:
        outs = _eval_custom_derivative(eqn, _cast_like_avals(invals, _avals(eqn.invars)), rules)
        _record(outs, combined(_kinds(invals)))
        return outs
    has_subprogram = bool(list(jaxprs_in_params(eqn.params)))
    if has_subprogram or name == "bitcast_convert_type" or ("callback" in name):
        if name == "shard_map":
            raise NotImplementedError(
                "autocast does not rewrite inside shard_map: apply autocast to the per-shard "
                "function instead (shard_map(autocast(f, policy), ...))."
            )
        # Run as traced: typed callbacks stay exact.
        outs = _bind(eqn, _cast_like_avals(invals, _avals(eqn.invars)))
        _record(outs, combined(_kinds(invals)))
        return outs
    floating = [i for i, x in enumerate(invals) if _is_float(x)]
    if not floating:
        return _bind(eqn, invals)
    if name in NO_HALF_KERNEL:
        return _in_float32(eqn, invals)
    try:
        return _eval_by_rules(eqn, invals, floating, rules)
    except (TypeError, ValueError, NotImplementedError):
        # An op that refuses half precision (a dtype check when it is bound)
        # runs in float32 rather than failing the whole function.
        if not any(jnp.finfo(invals[i].dtype).bits < 32 for i in floating):
            raise
        return _in_float32(eqn, invals)


# Deny-listed reductions: what they make of activations is a statistic (`activations`).
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


# Shape-only operations a weight's cast is moved past, and elementwise ones whose implicit
# broadcast of a weight is made explicit before the cast (`_eval_cast_at_use`).
_SHAPE_OPS = frozenset({"broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims"})
_ELEMENTWISE = frozenset({"add", "sub", "mul", "div", "max", "min"})


def _eval_cast_at_use(eqn: Any, invals: list) -> list:
    """An equation as traced, except on a weight's cast down from float32:
    - a matmul or conv takes the float32 weight and casts it inside
      `jmp_policy.matmul.mixed`, so its gradient is made in float32;
    - a shape-only operation runs on the float32 weight and is cast after it, and an
      elementwise one that broadcasts the weight (a bias added to a batch) gets it
      broadcast in float32 first, so the sum over the batch that is its gradient runs in
      float32.
    Either way the forward values are the same, and the gradient is summed across devices
    in float32."""
    name = eqn.primitive.name
    if name in _SHAPE_OPS and invals and id(invals[0]) in _downcasts():
        half, weight = _downcasts()[id(invals[0])]
        (wide,) = _bind(eqn, [weight, *invals[1:]])
        out = _cast(wide, half.dtype)
        _downcasts()[id(out)] = (out, wide)
        return [out]
    if name in _ELEMENTWISE:
        shape = eqn.outvars[0].aval.shape
        invals = [
            _cast(jnp.broadcast_to(_downcasts()[id(x)][1], shape), x.dtype)
            if id(x) in _downcasts() and np.shape(x) != shape and np.ndim(x) == len(shape)
            else x
            for x in invals
        ]
    if name in _MIXED:
        found = [_downcasts().get(id(x)) for x in invals]
        if any(f is not None for f in found):
            compute = next(x.dtype for x, f in zip(invals, found, strict=True) if f is not None)
            lhs, rhs = [x if f is None else f[1] for x, f in zip(invals, found, strict=True)]
            preferred = eqn.params.get("preferred_element_type")
            wider = preferred is not None and jnp.finfo(preferred).bits > jnp.finfo(compute).bits

            def op(lhs, rhs, preferred):
                return _LAX_MATMULS[name](
                    lhs, rhs, **{**eqn.params, "preferred_element_type": preferred}
                )

            with _source_context(eqn):
                out = mixed(op, compute, preferred if wider else None, lhs, rhs)
            return [_cast(out, eqn.outvars[0].aval.dtype)]
    outs = _bind(eqn, invals)
    if (
        name == "convert_element_type"
        and id(invals[0]) in _DOWNCASTS.stack[-1][0]
        and invals[0].dtype == _FLOAT32
        and _is_float(outs[0])
        and jnp.finfo(outs[0].dtype).bits == 16
    ):
        _downcasts()[id(outs[0])] = (outs[0], invals[0])
    return outs


def _eval_by_rules(eqn: Any, invals: list, floating: list, rules: _Rules) -> list:
    name = eqn.primitive.name
    if rules.fp8 and name == "dot_general" and name in rules.allow and len(floating) == 2:
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


def _avals(variables: Iterable) -> list:
    return [v.aval for v in variables]


def _rewritten(fun: Callable[..., list], args: Sequence[Any], rules: _Rules) -> list:
    """`fun(*args)` traced and run by the rules, its outputs in the dtypes it was traced
    with."""
    closed = jax.make_jaxpr(fun)(*args)
    return _cast_like_avals(_eval_closed(closed, list(args), rules), closed.out_avals)


def _eval_custom_derivative(eqn: Any, invals: list, rules: _Rules) -> list:
    """A `jax.custom_jvp`/`jax.custom_vjp` function (`invals` in the dtypes it was traced
    with), as torch.amp runs a custom autograd function: its computation by the rules (its
    matmuls in the compute dtype), and the derivative rule as the user wrote it, on values in
    the dtypes it was written for. Rebuilt with the public APIs from JAX's own derivative of
    the equation: `custom_jvp`'s rule traced by `jax.jvp` and run by the rules, its outputs
    cast back; `custom_vjp`'s forward pass (`jax.vjp`: the outputs and the residuals the
    backward pass keeps) run by the rules and cast back, and its backward pass run as
    written on those residuals."""
    n_out = len(eqn.outvars)
    body = _jaxpr.inlined_body(eqn)  # the function's own program

    def original(*args: Any) -> list:
        return _bind(eqn, list(args))

    def primal(*args: Any) -> list:
        outs = _eval_closed(body, list(args), rules)
        return _cast_like_avals(outs, _avals(eqn.outvars))

    if eqn.primitive is _jaxpr.CUSTOM_JVP:

        @jax.custom_jvp
        def with_jvp(*args):
            return primal(*args)

        @with_jvp.defjvp
        def _(primals, tangents):
            n = len(primals)

            def jvp(*both):
                outs, tangents_out = jax.jvp(original, both[:n], both[n:])
                return [*outs, *tangents_out]

            # Plain matmuls (not `matmul.mixed`, a custom_vjp): a custom_jvp rule's tangents
            # must stay transposable.
            linear = dataclasses.replace(rules, reduce=False, accumulate=None)
            outs = _rewritten(jvp, [*primals, *tangents], linear)
            return outs[:n_out], outs[n_out:]

        return list(with_jvp(*invals))

    pullback: list = []  # the tree of `jax.vjp`'s function: its leaves are the residuals

    def forward(*args: Any) -> list:
        outs, vjp = jax.vjp(original, *args)
        residuals, tree = jax.tree.flatten(vjp)
        pullback[:] = [tree]
        return [*outs, *residuals]

    @jax.custom_vjp
    def fun(*args):
        return primal(*args)

    def fwd(*args):
        outs = _rewritten(forward, args, rules)
        return outs[:n_out], outs[n_out:]

    def bwd(residuals, cotangents):
        return tuple(jax.tree.unflatten(pullback[0], residuals)(list(cotangents)))

    fun.defvjp(fwd, bwd)
    return list(fun(*invals))


def _eval_structural(eqn: Any, invals: list, rules: _Rules) -> list:
    params = eqn.params
    if _jaxpr.is_call(eqn):
        inner = _jaxpr.inlined_body(eqn)
        if params.get("name", "").startswith(_REGION_NAMES):
            return _bind(eqn, _cast_like_avals(invals, inner.in_avals))
        return (
            _eval_closed(inner, invals, rules)
            if hasattr(inner, "consts")
            else _eval_jaxpr(inner, [], invals, rules)
        )
    # The loop or branch keeps its place in the name stack (its body's are relative to it).
    if eqn.primitive is _jaxpr.SCAN:
        with _source_context(eqn):
            return _eval_scan(params, invals, rules)
    if eqn.primitive is _jaxpr.WHILE:
        with _source_context(eqn):
            return _eval_while(params, invals, rules)
    if eqn.primitive is _jaxpr.COND:
        with _source_context(eqn):
            return _eval_cond(params, invals, rules)
    # `jax.checkpoint` (`_jaxpr.REMAT`): an open jaxpr without consts.
    body = functools.partial(_eval_jaxpr, params["jaxpr"], [], rules=rules)

    wide = _wide_sources(rules, invals)

    def rematted(*inner):
        inner = _follow_weights(rules, invals, list(inner), wide)
        _inherit(invals, inner)
        return body(inner)

    with _source_context(eqn):
        return jax.checkpoint(rematted, prevent_cse=params["prevent_cse"], policy=params["policy"])(
            *invals, *[w for _, w in wide]
        )


def _wide_sources(rules: _Rules, outer: list) -> list:
    """`cast_at_use`: [(position, float32 weight)] of a body's inputs that are a weight's
    cast, to be passed into the body beside them."""
    if not rules.at_use:
        return []
    return [(i, _downcasts()[id(v)][1]) for i, v in enumerate(outer) if id(v) in _downcasts()]


def _follow_weights(rules: _Rules, outer: list, inner: list, wide: list) -> list:
    """`cast_at_use`: a body's input that is a weight (or one layer of stacked weights in a
    `scan`) is a weight too, and one that is a weight's cast is that (its float32 weight
    passed in after the body's own inputs, per `_wide_sources`). Returns the body's own
    inputs."""
    if not rules.at_use:
        return inner
    inner, extra = inner[: len(outer)], inner[len(outer) :]
    weights = _DOWNCASTS.stack[-1][0]
    for o, i in zip(outer, inner, strict=True):
        if id(o) in weights:
            weights[id(i)] = i
    for (position, _), w in zip(wide, extra, strict=True):
        _downcasts()[id(inner[position])] = (inner[position], w)
    return inner


def _eval_scan(params: dict, invals: list, rules: _Rules) -> list:
    n_consts, n_carry = params["num_consts"], params["num_carry"]
    consts, init, xs = (
        invals[:n_consts],
        invals[n_consts : n_consts + n_carry],
        invals[n_consts + n_carry :],
    )

    wide = _wide_sources(rules, xs)

    def body(carry, x):
        x = _follow_weights(rules, xs, list(x), wide)
        _inherit([*init, *xs], [*carry, *x])
        outs = _eval_closed(params["jaxpr"], [*consts, *carry, *x], rules)
        new_carry = [_cast(o, c.dtype) for o, c in zip(outs[:n_carry], carry, strict=True)]
        return new_carry, outs[n_carry:]

    # A float32 carry that starts as a weight (an embedding, zeros) and that the body makes an
    # activation (a layer's output, as under `nn.scan` over blocks) is carried in the compute
    # dtype, as it is between the layers of a Python loop (`activations.meet`); a carry that
    # the body keeps in float32 (a sum of losses, statistics) stays float32.
    def made(carry):
        def run(carry, x):
            return _eval_closed(params["jaxpr"], [*consts, *carry, *x], rules)[:n_carry]

        xs_one = [jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for v in xs]
        return [o.dtype for o in jax.eval_shape(run, carry, xs_one)]

    init = list(init)
    if any(_is_float(c) and c.dtype == _FLOAT32 and _kind(c) == WEIGHT for c in init):
        for i, dtype in enumerate(made(init)):
            c = init[i]
            if _is_float(c) and c.dtype == _FLOAT32 and _kind(c) == WEIGHT and dtype != c.dtype:
                init[i] = weight_at_use(c, dtype)

    carry, ys = lax.scan(
        body,
        list(init),
        [*xs, *[w for _, w in wide]],  # a weight's cast: its float32 weight beside it
        length=params["length"],
        reverse=params["reverse"],
        unroll=params["unroll"],
    )
    return [*carry, *ys]


def _eval_while(params: dict, invals: list, rules: _Rules) -> list:
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    cond_consts, body_consts, init = invals[:nc], invals[nc : nc + nb], invals[nc + nb :]

    def cond_fn(carry):
        _inherit(init, carry)
        return _eval_closed(params["cond_jaxpr"], [*cond_consts, *carry], rules)[0]

    def body_fn(carry):
        _inherit(init, carry)
        outs = _eval_closed(params["body_jaxpr"], [*body_consts, *carry], rules)
        return [_cast(o, c.dtype) for o, c in zip(outs, carry, strict=True)]

    return list(lax.while_loop(cond_fn, body_fn, list(init)))


def _eval_cond(params: dict, invals: list, rules: _Rules) -> list:
    index, operands = invals[0], invals[1:]
    branches = [functools.partial(_eval_closed, b, rules=rules) for b in params["branches"]]
    shapes = [jax.eval_shape(lambda *a, f=f: f(list(a)), *operands) for f in branches]
    dtypes = [
        _widest([s[i].dtype for s in shapes])
        if jnp.issubdtype(shapes[0][i].dtype, jnp.floating)
        else None
        for i in range(len(shapes[0]))
    ]

    def agreeing(f):
        def run(*a):
            _inherit(operands, a)
            outs = f(list(a))
            return [o if d is None else _cast(o, d) for o, d in zip(outs, dtypes, strict=True)]

        return run

    return list(lax.switch(index, [agreeing(f) for f in branches], *operands))


class _Autocast:
    """The function `autocast` returns; caches one program per input signature."""

    def __init__(self, fun, rules, static_argnums, static_argnames, cast_inputs, region_name):
        functools.update_wrapper(self, fun)
        self._fun = fun
        self._rules = rules
        self._static_argnums = static_argnums
        self._static_argnames = static_argnames
        self._cast_inputs = cast_inputs
        self._region_name = region_name
        self._cache: dict = {}

    def _program(self, args, kwargs):
        static_args = tuple((i, args[i]) for i in self._static_argnums if i < len(args))
        static_kwargs = tuple(sorted((k, kwargs[k]) for k in self._static_argnames if k in kwargs))
        dyn_args = [a for i, a in enumerate(args) if i not in self._static_argnums]
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self._static_argnames}
        flat, in_tree = jax.tree.flatten((dyn_args, dyn_kwargs))
        # Leaves that are not arrays (an Equinox module's activation function,
        # a bool flag, a name) are passed to `fun` as they are, like
        # `eqx.filter_jit` does: they are part of the program, not its inputs.
        traced = tuple(is_traced_leaf(x) for x in flat)
        specs = tuple(
            jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.result_type(x), weak_type=_weak(x))
            if is_traced
            else _StaticLeaf(x)
            for x, is_traced in zip(flat, traced, strict=True)
        )
        # Traced again while the debugger names NNX/Equinox modules (`_naming`): a program
        # built before has no module paths in its name stacks.
        key = (in_tree, specs, static_args, static_kwargs, _naming.active())
        if key not in self._cache:
            self._cache[key] = self._build(
                in_tree, specs, dict(static_args), dict(static_kwargs), len(args)
            )
        return [x for x, is_traced in zip(flat, traced, strict=True) if is_traced], self._cache[key]

    def _build(self, in_tree, specs, static_args, static_kwargs, n_args):
        def flat_fun(*arrays):
            given = iter(arrays)
            flat = [next(given) if isinstance(s, jax.ShapeDtypeStruct) else s.value for s in specs]
            dyn_args, dyn_kwargs = jax.tree.unflatten(in_tree, flat)
            dyn = iter(dyn_args)
            full = [static_args[i] if i in static_args else next(dyn) for i in range(n_args)]
            return self._fun(*full, **dyn_kwargs, **static_kwargs)

        arrays = [s for s in specs if isinstance(s, jax.ShapeDtypeStruct)]
        closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*arrays)
        out_tree = jax.tree.structure(out_shape)
        rules, cast_inputs = self._rules, self._cast_inputs
        # `cast_at_use`: the traced leaves of the first argument are the weights.
        n_weights = 0
        if rules.at_use and in_tree.children()[0].children():
            first = in_tree.children()[0].children()[0].num_leaves
            n_weights = sum(isinstance(s, jax.ShapeDtypeStruct) for s in specs[:first])

        def region(*flat):
            if cast_inputs:
                flat = [_cast(x, rules.compute) for x in flat]
            if not rules.at_use:
                with _evaluation():
                    outs = _eval_closed(closed, list(flat), rules)
                return [_cast(o, rules.output) for o in outs]
            if not hasattr(_DOWNCASTS, "stack"):
                _DOWNCASTS.stack = []
            _DOWNCASTS.stack.append(({id(w): w for w in flat[:n_weights]}, {}))
            try:
                return _eval_closed(closed, list(flat), rules)  # the output dtypes as traced
            finally:
                _DOWNCASTS.stack.pop()

        region.__name__ = region.__qualname__ = self._region_name
        return jax.jit(region), out_tree, closed

    def __call__(self, *args, **kwargs):
        flat, (region, out_tree, _) = self._program(args, kwargs)
        return jax.tree.unflatten(out_tree, region(*flat))

    def traced_program(self, *args, **kwargs):
        """The program as traced, before casts (for reports and debugging)."""
        return self._program(args, kwargs)[1][2]


class _StaticLeaf:
    """A leaf passed through untouched: compared by value where it can be, else by identity."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def _key(self) -> Any:
        try:
            hash(self.value)
        except TypeError:
            return (type(self.value), id(self.value))
        return (type(self.value), self.value)

    def __hash__(self) -> int:
        return hash(self._key())

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _StaticLeaf) and self._key() == other._key()


def _weak(x: Any) -> bool:
    return bool(
        getattr(x, "weak_type", isinstance(x, (int, float, complex)) and not isinstance(x, bool))
    )


def _static(values: Any, kind: type, argument: str) -> tuple:
    if values is None:
        return ()
    values = (values,) if isinstance(values, (int, str)) else tuple(values)
    if not all(isinstance(v, kind) and not isinstance(v, bool) for v in values):
        raise TypeError(
            f"Expected {kind.__name__} values (or one) for `{argument}`, got {values!r}."
        )
    return values


def autocast(
    fun: Callable,
    policy: Policy | str = "mixed_float16",
    *,
    allow: Iterable[str] = ALLOW,
    deny: Iterable[str] = DENY,
    static_argnums: int | Iterable[int] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    fp8_scaling: str = "tensorwise",
    fp8_format: str = "hybrid",
    fp8_exclude: Iterable[str] = FP8_EXCLUDE,
    reduce_dtype: Any = jnp.float32,
    accumulate_dtype: Any = None,
) -> Callable:
    """Runs `fun` with matmuls in half precision and fragile ops in float32.

    The rewrite happens on the traced program, so `fun` (a Flax `apply`, a loss
    function, anything) needs no change. The returned function takes and
    returns the same pytrees as `fun`, works under `jit`, `grad` (gradients come
    back in the dtype of the inputs they belong to) and `vmap`, and caches one
    program per input signature.

    Matmul outputs are in the compute dtype (`preferred_element_type` is set to
    it): GPUs and TPUs accumulate half-precision matmuls in float32 anyway, and
    a float32 output would make the backward matmuls mix dtypes.

    Args:
      fun: the function to run.
      policy: a `Policy` or a policy string; its `compute_dtype` is used for
        the allow-listed ops and its `output_dtype` for the outputs.
      allow: primitive names run in the compute dtype (default `ALLOW`).
      deny: primitive names run in float32 (default `DENY`), e.g.
        `DENY | {"tanh"}` keeps `tanh` in float32 too.
      static_argnums: positions of arguments that are static (hashable).
      static_argnames: names of keyword arguments that are static.
      fp8_scaling: with a float8 policy (`"mixed_float8"`), how the matmul
        operands are scaled: "tensorwise" or "rowwise" (current scaling,
        `jmp_policy.fp8.fp8_dot_general`). Ignored otherwise.
      fp8_format: with a float8 policy, "hybrid" (e5m2 gradients) or "e4m3".
      fp8_exclude: with a float8 policy, regular expressions for module names
        (each matched against every component of a module path) whose
        matmuls stay in bfloat16; default `jmp_policy.fp8.FP8_EXCLUDE`, the
        logits head and the embedding. `()` puts every eligible matmul in float8.
      reduce_dtype: float32 (default): under a half compute dtype, a matmul or
        conv casts its float32 operands (the weights) inside the op
        (`jmp_policy.matmul`), so their gradients are made, and summed across
        devices, in float32. None: in the compute dtype (half the bytes).
      accumulate_dtype: e.g. float32: matmuls and convs return their sum in
        this dtype (`preferred_element_type`); None (default): the compute dtype.

    Returns:
      The autocast function.

    Raises:
      TypeError/ValueError: a bad policy, or unknown primitive names in `allow`/`deny`.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jmp_policy as jmp
      >>> def f(w, x):
      ...     return jax.nn.logsumexp(x @ w)
      >>> g = jmp.autocast(f, "mixed_bfloat16")
      >>> g(jnp.ones((3, 2)), jnp.ones((4, 3))).dtype
      dtype('float32')
      >>> jmp.precision_report(g, jnp.ones((3, 2)), jnp.ones((4, 3))).counts["dot_general"]
      {'bfloat16': 1}
    """
    policy = check_policy(policy)
    if not callable(fun):
        raise TypeError(f"Expected a callable for `fun`, got {type(fun).__name__}.")
    allow, deny = _check_names(allow, "allow"), _check_names(deny, "deny")
    both = sorted(allow & deny)
    if both:
        raise ValueError(f"Primitives {both} are in both `allow` and `deny`; pick one.")
    if fp8_scaling not in SCALINGS:
        raise ValueError(
            f"Unknown `fp8_scaling` {fp8_scaling!r}: expected one of {', '.join(SCALINGS)}."
        )
    if fp8_format not in FORMATS:
        raise ValueError(
            f"Unknown `fp8_format` {fp8_format!r}: expected 'hybrid' (e5m2 gradients) or 'e4m3'."
        )
    if isinstance(fp8_exclude, str) or not all(isinstance(p, str) for p in fp8_exclude):
        raise TypeError(
            "Expected a tuple of regular expressions for `fp8_exclude`, e.g. ('head',), got "
            f"{fp8_exclude!r}."
        )
    exclude = tuple(fp8_exclude)
    for pattern in exclude:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(
                f"Invalid regular expression {pattern!r} in `fp8_exclude`: {e}."
            ) from e
    rules = _Rules.of(
        policy,
        allow,
        deny,
        (fp8_scaling, fp8_format),
        exclude,
        reduce=check_reduce_dtype(reduce_dtype) is not None,
        accumulate=check_accumulate_dtype(accumulate_dtype),
    )
    return _Autocast(
        fun,
        rules,
        _static(static_argnums, int, "static_argnums"),
        _static(static_argnames, str, "static_argnames"),
        cast_inputs=False,
        region_name="jmp_autocast_region",
    )


def cast_at_use(fun: Callable) -> Callable:
    """`fun(weights, *args, **kwargs)` as written, except that each matmul or conv
    (`dot_general`, `conv_general_dilated`) on a float32 leaf of `weights` cast to 16 bits
    takes the float32 leaf and casts it inside the op (`jmp_policy.matmul.mixed`): the
    same forward pass, and the weight's gradient made, and summed across devices, in
    float32 (activation gradients stay in 16 bits); a bias broadcast to a batch is
    broadcast in float32 before its cast. What `linen.mixed_precision` runs `apply` under,
    and `nnx.mixed_precision` a model's call, when `reduce_dtype` is float32 and a layer
    has no matmul to take over (`nn.Einsum`, `nn.ConvTranspose`, your own
    `x @ self.param(...)`; `nnx.ConvTranspose`). A weight, or its cast, is followed into
    `scan` bodies (one layer of stacked weights at a time) and `jax.checkpoint` bodies, not
    into `cond` branches or `while` loops."""
    rules = _Rules(_FLOAT32, _FLOAT32, frozenset(), frozenset(), reduce=True, at_use=True)
    return _Autocast(fun, rules, (), (), cast_inputs=False, region_name=_CAST_AT_USE)


def full_precision(fun: Callable) -> Callable:
    """Marks `fun` as a float32 region, inside `autocast` or anywhere else.

    JAX's counterpart of torch.amp's `with autocast(enabled=False): x = layer_norm(x.float())`:
    floating inputs are cast to float32 and every operation of `fun` runs in
    float32; an enclosing `autocast` leaves the region as it is.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jmp_policy as jmp
      >>> def f(w, x):
      ...     return jmp.full_precision(lambda a: a @ w)(x) + x @ w
      >>> w = x = jnp.ones((2, 2))
      >>> jmp.precision_report(jmp.autocast(f), w, x).counts["dot_general"]
      {'float16': 1, 'float32': 1}
    """
    if not callable(fun):
        raise TypeError(f"Expected a callable for `fun`, got {type(fun).__name__}.")
    rules = _Rules(_FLOAT32, _FLOAT32, frozenset(ALLOW), frozenset(DENY))
    return _Autocast(fun, rules, (), (), cast_inputs=True, region_name=FULL_PRECISION_REGION)
