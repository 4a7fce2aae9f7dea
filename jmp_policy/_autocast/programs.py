"""How autocast runs a program: equation by equation, by the rule sets at the end of this file
(`jmp_policy._core.interpreter`): `STRUCTURE` rebuilds sub-programs with public APIs (calls
inlined; `scan`, `while`, `cond` and `jax.checkpoint` with bodies run by the same rules);
`AUTOCAST` over it runs every primitive by its rule and keeps custom derivatives' rules;
`FLOAT8` over that, float8 and block-scaled matmuls; `CAST_AT_USE`, `cast_at_use`'s weights."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Literal

from jmp_policy._autocast.activations import (
    ISLAND,
    STATISTIC,
    WEIGHT,
    combined,
    meet,
    weight_at_use,
)
from jmp_policy._autocast.evaluation import (
    _FLOAT32,
    _cast,
    _cast_like_avals,
    _Evaluation,
    _is_float,
    _Rules,
    _widest,
)
from jmp_policy._autocast.ops import (
    _LAX_MATMULS,
    _REGION_NAMES,
    _adding_in_float32,
    _bind,
    _eval_by_rules,
    _float8_matmul,
    _half_among,
    _in_float32,
    _source_context,
    _strong,
    _sums_in_transpose,
)
from jmp_policy._core import jaxpr as _jaxpr
from jmp_policy._core import rules as _rules
from jmp_policy._core.interpreter import RuleSet
from jmp_policy._reports.census import PrecisionWarning
from jmp_policy.matmul import dot_of, mixed


def _eval_jaxpr(jaxpr: Any, consts: list, args: list, ev: _Evaluation) -> list:
    rules = rule_set(ev.rules)

    def rule(eqn: Any, invals: list) -> list:
        constant = ev.from_constants(eqn, invals)
        outs = ev.kept(eqn, rules.apply(ev, eqn, invals))
        if constant:
            ev.mark_constant(outs)
        return outs

    return ev.run(jaxpr, consts, args, rule)


def _eval_closed(closed: Any, args: list, ev: _Evaluation) -> list:
    return _eval_jaxpr(closed.jaxpr, list(closed.consts), list(args), ev)


def _as_traced(ev: _Evaluation, eqn: Any, invals: list) -> list:
    """`eqn` on its operands cast back to the dtypes it was traced with."""
    outs = _bind(eqn, _cast_like_avals(invals, _avals(eqn.invars)))
    ev.record(outs, combined(ev.kinds_of(invals)))
    return outs


_UNKNOWN_WARNED: set[str] = set()


def _unknown(ev: _Evaluation, eqn: Any, invals: list) -> list:
    """A primitive without a rule (`_rules.rule_of`): it runs as traced, and the user is told
    once, so the float32 it may run in is never silent."""
    name = eqn.primitive.name
    if name not in _UNKNOWN_WARNED:
        _UNKNOWN_WARNED.add(name)
        warnings.warn(
            f"autocast has no rule for the primitive {name!r}: it runs in the dtypes it was "
            "traced with. Name it in `allow` (compute dtype) or `deny` (float32) to decide.",
            PrecisionWarning,
            stacklevel=2,
        )
    return _as_traced(ev, eqn, invals)


def _by_meaning(ev: _Evaluation, eqn: Any, invals: list) -> list | None:
    """A primitive that runs in the compute dtype, in float32 or in its operands' dtype
    (`_rules.RULES`): by the user's lists, then by where its operands meet
    (`_eval_by_rules`)."""
    floating = [i for i, x in enumerate(invals) if _is_float(x)]
    return _eval_by_rules(ev, eqn, invals, floating) if floating else None


def _without_half_kernel(ev: _Evaluation, eqn: Any, invals: list) -> list | None:
    """A decomposition or an FFT (`_rules.NO_HALF_KERNEL`): in float32, whatever the lists."""
    return _in_float32(ev, eqn, invals) if any(map(_is_float, invals)) else None


def _kept_as_traced(ev: _Evaluation, eqn: Any, invals: list) -> list | None:
    """A bit cast, an opaque sub-program (`_rules.AS_TRACED`): in the dtypes it was traced
    with."""
    return _as_traced(ev, eqn, invals) if any(map(_is_float, invals)) else None


_BY_RUNS_IN = {
    _rules.COMPUTE: _by_meaning,
    _rules.FLOAT32: _by_meaning,
    _rules.OPERANDS: _by_meaning,
    _rules.NO_HALF_KERNEL: _without_half_kernel,
    _rules.AS_TRACED: _kept_as_traced,
}


def _eval_primitive(ev: _Evaluation, eqn: Any, invals: list) -> list:
    """autocast's default rule: a primitive without a rule of its own (or one whose rule
    declined: no floating operand). A typed callback or an opaque sub-program runs exactly as
    traced; a primitive the user's lists name, by them; any other as traced, and the user is
    told (`_unknown`)."""
    rules, name = ev.rules, eqn.primitive.name
    if _jaxpr.sub_programs(eqn) or _jaxpr.is_callback(eqn):
        return _as_traced(ev, eqn, invals)  # typed callbacks and opaque sub-programs stay exact
    floating = [i for i, x in enumerate(invals) if _is_float(x)]
    if not floating:
        return _bind(eqn, invals)
    if name in rules.allow or name in rules.deny:  # the user's lists decide
        return _eval_by_rules(ev, eqn, invals, floating)
    return _unknown(ev, eqn, invals)


def _in_shard_map(ev: _Evaluation, eqn: Any, invals: list) -> list:
    raise NotImplementedError(
        "autocast does not rewrite inside shard_map: apply autocast to the per-shard "
        "function instead (shard_map(autocast(f, policy), ...))."
    )


def _held(ev: _Evaluation, eqn: Any, invals: list) -> bool:
    """`cast_at_use`: whether an operand of `eqn` is held in float32 where the program has a
    16-bit dtype: the float32 list's results and the float32 arithmetic on them."""
    return any(
        _is_float(x) and (x.dtype != a.dtype or ev.kind(x) in (ISLAND, STATISTIC))
        for x, a in zip(invals, _avals(eqn.invars), strict=True)
    )


def _at_use_convert(ev: _Evaluation, eqn: Any, invals: list) -> list:
    """`cast_at_use`'s rule for a cast. A value held in float32 cast down to 16 bits (JAX's own
    `jnp.sum` of 16-bit values sums in float32 and casts back; a model's
    `rsqrt(var).astype(x.dtype)`) is held on: the op that takes it decides; cast otherwise,
    where float32 and 16-bit values meet (`_meeting_held`). Any other cast as traced, noting
    a float32 weight's cast to 16 bits (`downcast`: its uses take the weight), such a cast
    cast back to float32 (still a weight: what is computed from weights alone is one,
    `_weights_if_from_weights`, so its own casts to 16 bits are weights' casts) and an
    activation's cast to float32 (an island: `_meeting_held`)."""
    (x,) = invals
    to = eqn.outvars[0].aval.dtype
    found = ev.downcast(x)
    if found is not None and to == _FLOAT32:
        # A weight's 16-bit cast cast back up (`jnp.mean`'s own float32 sum of an embedding's
        # rows): the float32 weight itself, exact, and computed on as a weight
        # (`_weights_if_from_weights`). A float32 island on it keeps that float32 value for the
        # backward pass, as autocast's does.
        ev.add_weight(found[1])
        return [found[1]]
    if _held(ev, eqn, invals):
        if x.dtype == _FLOAT32 and jnp.issubdtype(to, jnp.floating) and jnp.finfo(to).bits == 16:
            return [x]
        return _meeting_held(ev, eqn, invals)
    outs = _bind(eqn, invals)
    if _is_float(x) and _is_float(outs[0]):
        bits = jnp.finfo(x.dtype).bits, jnp.finfo(outs[0].dtype).bits
        if ev.is_weight(x) and x.dtype == _FLOAT32 and bits[1] == 16:
            ev.add_downcast(outs[0], x)
        elif bits == (16, 32):  # (a weight's cast cast back up returned above)
            ev.record(outs, ISLAND)
    return outs


def _at_use_matmul(ev: _Evaluation, eqn: Any, invals: list) -> list:
    """`cast_at_use`'s rule for a matmul or conv, on its operands in the dtypes it was traced
    with (a value held in float32 given back in 16 bits). On a weight's cast the float32
    weight goes in, cast inside `jmp_policy.matmul.mixed`, so its gradient is made in float32
    (and summed across devices in float32). Accumulated wider than its 16-bit operands
    (`jax.nn.dot_product_attention`'s scores, preferred float32), its backward takes its
    cotangent in the operands' dtype: JAX's own transpose would multiply the float32
    cotangent by a 16-bit operand, which a GPU runs as a float32 GEMM."""
    invals = _cast_like_avals(invals, _avals(eqn.invars))
    found = [ev.downcast(x) for x in invals]
    preferred = eqn.params.get("preferred_element_type")
    compute = next(
        (x.dtype for x, f in zip(invals, found, strict=True) if f is not None),
        _half_among(invals),
    )
    wider = (
        compute is not None
        and preferred is not None
        and jnp.finfo(preferred).bits > jnp.finfo(compute).bits
    )
    # `accumulate_dtype`: the sum returned in it, held (the bias added to it) until an
    # operation takes it back in 16 bits.
    accumulate = ev.rules.accumulate if compute is not None else None
    if compute is None or not (any(f is not None for f in found) or wider or accumulate):
        return _bind(eqn, invals)
    lhs, rhs = [x if f is None else f[1] for x, f in zip(invals, found, strict=True)]

    # An algorithm preset (`jax.nn.dot_product_attention`'s F16_F16_F32) names the dtypes it
    # was traced with, which XLA:CPU cannot run: `mixed` says the same with its operands'
    # dtypes and `preferred_element_type`.
    params = dict(eqn.params)
    if isinstance(params.get("precision"), lax.DotAlgorithmPreset):
        params["precision"] = None

    def op(lhs, rhs, preferred):
        return _LAX_MATMULS[eqn.primitive](
            lhs, rhs, **{**params, "preferred_element_type": preferred}
        )

    with _source_context(eqn):
        dot = dot_of(eqn.primitive, params)
        out = mixed(op, compute, accumulate or (preferred if wider else None), lhs, rhs, dot)
    if accumulate is not None:
        ev.record([out], ISLAND)
        return [out]
    return [_cast(out, eqn.outvars[0].aval.dtype)]


def _eval_cast_at_use(ev: _Evaluation, eqn: Any, invals: list) -> list:
    """`cast_at_use`'s rule for any other equation: as traced, except on a weight's cast down
    from float32 and on values held in float32 (`_held`):
    - a shape-only operation runs on the float32 weight and is cast after it, and an
      elementwise one that broadcasts the weight (a bias added to a batch) gets it
      broadcast in float32 first, so the sum over the batch that is its gradient runs in
      float32 (a 16-bit activation broadcast over size-1 axes too);
    - an elementwise op, the float32 list, and an op on one floating operand (a reshape, a
      broadcast, a slice, a max) take held values as they are; any other op (a
      concatenation, a custom function) gets them back in the dtype it was traced with,
      where the model continues in it.
    Either way the forward values are the same."""
    rule = _rules.rule_of(eqn)
    avals = _avals(eqn.invars)
    held = _held(ev, eqn, invals)
    follows = rule is not None and (
        rule.elementwise
        or rule.runs_in == _rules.FLOAT32
        or (rule.runs_in == _rules.OPERANDS and sum(map(_is_float, invals)) == 1)
    )
    if held and not follows:
        invals, held = _cast_like_avals(invals, avals), False
    if held:  # a constant of the program (`var + 1e-6`) is no activation: in float32
        invals = [
            _cast(x, _FLOAT32) if isinstance(v, Literal) and _is_float(x) else x
            for x, v in zip(invals, eqn.invars, strict=True)
        ]
    # A weight's cast moved (reshaped, or its rows gathered: an embedding): the float32
    # weight moved, then cast.
    moves = rule is not None and (rule.layout or rule.adds_in_transpose) and len(eqn.outvars) == 1
    moved = ev.downcast(invals[0]) if moves and invals else None
    if moved is not None:
        half, weight = moved
        (wide,) = _bind(eqn, [weight, *invals[1:]])
        out = _cast(wide, half.dtype)
        ev.add_downcast(out, wide)
        return [out]
    if rule is not None and rule.elementwise and not held:
        weights = _weight_arithmetic(ev, eqn, invals)
        if weights is not None:
            # Arithmetic on weights alone (RMSNorm's `1 + scale`): in float32 on the float32
            # weights, cast after it, as autocast computes it before it meets an activation.
            (wide,) = _bind(eqn, weights)
            out = _cast(wide, eqn.outvars[0].aval.dtype)
            ev.add_downcast(out, wide)
            return [out]
    if rule is not None and rule.elementwise:
        shape = eqn.outvars[0].aval.shape

        def broadcast(x: Any) -> Any:
            if not _is_float(x) or np.shape(x) == shape or np.ndim(x) != len(shape):
                return x
            found = ev.downcast(x)
            if found is not None:  # still a weight's cast, broadcast in float32
                wide = jnp.broadcast_to(found[1], shape)
                out = _cast(wide, x.dtype)
                ev.add_downcast(out, wide)
                return out
            if jnp.finfo(x.dtype).bits == 16:
                # A 16-bit value broadcast over size-1 axes (`x - logsumexp(x)` in the model's
                # own code): broadcast in float32, so its gradient, a sum over those axes,
                # is summed in float32. The same values forward.
                return _cast(jnp.broadcast_to(_cast(x, _FLOAT32), shape), x.dtype)
            return x

        invals = [broadcast(x) for x in invals]
    half = _half_among(invals)
    if rule is not None and rule.runs_in == _rules.FLOAT32 and (half is not None or held):
        # The float32 list, in the model's own code too (a segment sum, exp, log, a
        # cumulative sum): computed in float32 (a weight's cast from its float32 weight),
        # and held in float32 for the float32 arithmetic that uses it (`_meeting_held`).
        wide = ev.as_weights(invals)
        outs = _in_float32(ev, eqn, wide, half or _half_among(_avals(eqn.outvars)))
        return _weights_if_from_weights(ev, eqn, wide, outs)
    if held:
        return _meeting_held(ev, eqn, invals)
    if half is not None and _sums_in_transpose(eqn, invals):
        return _adding_in_float32(eqn, invals)
    return _weights_if_from_weights(ev, eqn, invals, _bind(eqn, invals))


def _weights_if_from_weights(ev: _Evaluation, eqn: Any, invals: list, outs: list) -> list:
    """`cast_at_use`: `outs`, each float32 one recorded as a weight where `eqn`'s floating
    operands are float32 weights and constants alone, at least one a weight (a norm's statistic
    of an embedding's rows, before any activation): its cast to 16 bits is then a weight's
    (`_at_use_convert`), and the float32 arithmetic on it stays float32."""
    weights = False
    for var, x in zip(eqn.invars, invals, strict=True):
        if not _is_float(x) or isinstance(var, Literal):
            continue
        if not ev.is_weight(x):
            return outs
        weights = True
    if weights:
        for out in outs:
            if _is_float(out) and out.dtype == _FLOAT32:
                ev.add_weight(out)
    return outs


def _weight_arithmetic(ev: _Evaluation, eqn: Any, invals: list) -> list | None:
    """`cast_at_use`: the operands of an elementwise `eqn` on weights' 16-bit casts and
    constants alone (at least one cast), as float32 (each cast's float32 weight, the constants
    widened); None for any other, and for a cast (the model's own)."""
    out = eqn.outvars[0].aval if len(eqn.outvars) == 1 else None
    if out is None or not _is_float(out) or jnp.finfo(out.dtype).bits != 16:
        return None
    if eqn.primitive is _jaxpr.CONVERT:
        return None
    wide, any_weight = [], False
    for var, x in zip(eqn.invars, invals, strict=True):
        if not _is_float(x):
            wide.append(x)
            continue
        found = ev.downcast(x)
        if found is not None:
            wide.append(found[1])
            any_weight = True
        elif isinstance(var, Literal) or ev.kind(x) == WEIGHT:
            wide.append(_cast(x, _FLOAT32))
        else:
            return None
    return wide if any_weight else None


def _meeting_held(ev: _Evaluation, eqn: Any, invals: list) -> list:
    """`cast_at_use`: an elementwise op on a value held in float32 (`_eval_cast_at_use`), by
    autocast's rule for where half-precision activations meet float32 values
    (`activations.meet`): float32 where a statistic is among its operands (`x / sum(x)`,
    `x * rsqrt(var)`: softmax's quotient and a norm's scaling, and their derivatives, in
    float32), else the activations' dtype, the held values handed back to it. A weight's
    16-bit cast takes part as its float32 weight, as under autocast (a norm's scale multiplies
    its float32 normalised value in float32)."""
    invals = ev.as_weights(invals)
    strong = _strong(eqn, [i for i, x in enumerate(invals) if _is_float(x)])
    if not strong:
        outs = _bind(eqn, invals)
        ev.record(outs, combined(ev.kinds_of(invals)))
        return outs
    target, kind = meet([invals[i].dtype for i in strong], [ev.kind(invals[i]) for i in strong])
    # Scaled or divided by a constant (GELU's `0.044715 * x**3`): linear in its one variable,
    # so JAX's derivative keeps nothing of it, nor does this.
    variables = [i for i in strong if not isinstance(eqn.invars[i], Literal)]
    by_constant = len(variables) == 1 and (
        eqn.primitive is _jaxpr.MUL or (eqn.primitive is _jaxpr.DIV and variables == [0])
    )
    if target == _FLOAT32 and kind == ISLAND and not by_constant:
        # where the program computes in 16 bits, its full-size operands kept in 16 bits
        return _in_float32(ev, eqn, invals, _half_among(_avals(eqn.outvars)))
    outs = _bind(eqn, [_cast(x, target) for x in invals])
    ev.record(outs, kind)
    return outs


def _avals(variables: Iterable) -> list:
    return [v.aval for v in variables]


def _rewritten(fun: Callable[..., list], args: Sequence[Any], ev: _Evaluation) -> list:
    """`fun(*args)` traced and run by the rules, its outputs in the dtypes it was traced
    with."""
    closed = jax.make_jaxpr(fun)(*args)
    return _cast_like_avals(_eval_closed(closed, list(args), ev), closed.out_avals)


def _eval_custom_derivative(ev: _Evaluation, eqn: Any, invals: list) -> list:
    """autocast's rule for custom derivatives: its operands cast back to the dtypes they were
    traced with, and its outputs recorded as their kinds combined (`_custom_function`)."""
    outs = _custom_function(ev, eqn, _cast_like_avals(invals, _avals(eqn.invars)))
    ev.record(outs, combined(ev.kinds_of(invals)))
    return outs


def _custom_function(ev: _Evaluation, eqn: Any, invals: list) -> list:
    """A `jax.custom_jvp`/`jax.custom_vjp` function (`invals` in the dtypes it was traced
    with), as torch.amp runs a custom autograd function: its computation by the rules (its
    matmuls in the compute dtype), and the derivative rule as the user wrote it, on values in
    the dtypes it was written for. Rebuilt with the public APIs from JAX's own derivative of
    the equation: `custom_jvp`'s rule traced by `jax.jvp` and run by the rules, its outputs
    cast back; `custom_vjp`'s forward pass (`jax.vjp`: the outputs and the residuals the
    backward pass keeps) run by the rules and cast back, and its backward pass, JAX's
    pullback on those residuals, run by the rules and cast back (torch.amp's `custom_fwd` and
    `custom_bwd`: both passes under the region's autocast)."""
    n_out = len(eqn.outvars)
    body = _jaxpr.inlined_body(eqn)  # the function's own program
    ev = ev.naming_nothing()

    def original(*args: Any) -> list:
        return _bind(eqn, list(args))

    def primal(*args: Any) -> list:
        outs = _eval_closed(body, list(args), ev)
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
            linear = dataclasses.replace(ev.rules, reduce=False, accumulate=None)
            outs = _rewritten(jvp, [*primals, *tangents], ev.with_rules(linear))
            return outs[:n_out], outs[n_out:]

        return list(with_jvp(*invals))

    # Differentiated only in the inputs the caller perturbs (`symbolic_zeros`: JAX says which),
    # the others held constant, as JAX itself runs the function: Equinox's
    # `filter_custom_vjp` (diffrax's adjoints) checks that its non-differentiable inputs are
    # not perturbed.
    pullback: list = []  # the tree of `jax.vjp`'s function: its leaves are the residuals
    perturbed: list = []

    def forward(*args: Any) -> list:
        def of_perturbed(*moved: Any) -> list:
            given = iter(moved)
            return original(
                *[next(given) if p else a for a, p in zip(args, perturbed[0], strict=True)]
            )

        moved = [a for a, p in zip(args, perturbed[0], strict=True) if p]
        outs, vjp = jax.vjp(of_perturbed, *moved)
        residuals, tree = jax.tree.flatten(vjp)
        pullback[:] = [tree]
        return [*outs, *residuals]

    @jax.custom_vjp
    def fun(*args):
        return primal(*args)

    def fwd(*primals):
        perturbed[:] = [tuple(p.perturbed for p in primals)]
        outs = _rewritten(forward, [p.value for p in primals], ev)
        return outs[:n_out], outs[n_out:]

    def bwd(residuals, cotangents):
        cotangents = [_instantiated(c) for c in cotangents]
        n = len(residuals)

        def pull(*both: Any) -> list:
            return list(jax.tree.unflatten(pullback[0], list(both[:n]))(list(both[n:])))

        # The backward rule by the rules too (torch.amp's `custom_bwd`): a rule that runs the
        # model again (diffrax's checkpointed adjoint re-runs each solver step) multiplies
        # in the compute dtype, as the forward pass does.
        grads = iter(_rewritten(pull, [*residuals, *cotangents], ev))
        return tuple(next(grads) if p else None for p in perturbed[0])

    fun.defvjp(fwd, bwd, symbolic_zeros=True)
    return list(fun(*invals))


def _instantiated(cotangent: Any) -> Any:
    """A cotangent as an array: a `SymbolicZero` (an output nothing depends on) as its zeros."""
    if isinstance(cotangent, jax.custom_derivatives.SymbolicZero):
        aval: Any = cotangent.aval  # its shape and dtype (float0 for an integer output)
        return jnp.zeros(aval.shape, aval.dtype)
    return cotangent


def _eval_call(ev: _Evaluation, eqn: Any, invals: list) -> list:
    """A call (`jax.jit`, ...): its body inlined, by the same rules; a region of autocast's
    own (a nested autocast, `full_precision`, `cast_at_use`) is bound as it is."""
    inner = _jaxpr.inlined_body(eqn)
    if eqn.params.get("name", "").startswith(_REGION_NAMES):
        return _bind(eqn, _cast_like_avals(invals, inner.in_avals))
    if hasattr(inner, "consts"):
        return _eval_closed(inner, invals, ev)
    return _eval_jaxpr(inner, [], invals, ev)


def _eval_remat(ev: _Evaluation, eqn: Any, invals: list) -> list:
    """The user's `jax.checkpoint` (an open jaxpr without consts), its body by the rules."""
    params = eqn.params
    inside = ev.within_checkpoint(params["policy"])
    body = functools.partial(_eval_jaxpr, params["jaxpr"], [], ev=inside)

    wide = _wide_sources(ev, invals)

    def rematted(*inner):
        inner = _follow_weights(ev, invals, list(inner), wide)
        ev.inherit(invals, inner)
        return body(inner)

    with _source_context(eqn):
        outs = jax.checkpoint(rematted, prevent_cse=params["prevent_cse"], policy=params["policy"])(
            *invals, *[w for _, w in wide]
        )
    # What the user's checkpoint hands out is kept, as the user's own checkpoint keeps the
    # boundary of what it recomputes: otherwise the region's checkpoint computes the body
    # once more to find it (nn.scan over nn.remat blocks: 16-25% slower on this CPU).
    return [ev.kept_value(o) for o in outs]


def _wide_sources(ev: _Evaluation, outer: list) -> list:
    """`cast_at_use`: [(position, float32 weight)] of a body's inputs that are a weight's
    cast, to be passed into the body beside them."""
    if not ev.rules.at_use:
        return []
    found = [(i, ev.downcast(v)) for i, v in enumerate(outer)]
    return [(i, f[1]) for i, f in found if f is not None]


def _follow_weights(ev: _Evaluation, outer: list, inner: list, wide: list) -> list:
    """`cast_at_use`: a body's input that is a weight (or one layer of stacked weights in a
    `scan`) is a weight too, and one that is a weight's cast is that (its float32 weight
    passed in after the body's own inputs, per `_wide_sources`). Returns the body's own
    inputs."""
    if not ev.rules.at_use:
        return inner
    inner, extra = inner[: len(outer)], inner[len(outer) :]
    for o, i in zip(outer, inner, strict=True):
        if ev.is_weight(o):
            ev.add_weight(i)
    for (position, _), w in zip(wide, extra, strict=True):
        ev.add_downcast(inner[position], w)
    return inner


def _in_its_place(
    run: Callable[[_Evaluation, Any, list], list],
) -> Callable[[_Evaluation, Any, list], list]:
    """The rule of a loop or branch: `run(ev, eqn, invals)` with the equation's place in the
    name stack kept (its body's are relative to it)."""

    def rule(ev: _Evaluation, eqn: Any, invals: list) -> list:
        with _source_context(eqn):
            return run(ev, eqn, invals)

    return rule


def _scan(ev: _Evaluation, eqn: Any, invals: list) -> list:
    params = eqn.params
    n_consts, n_carry = params["num_consts"], params["num_carry"]
    consts, init, xs = (
        invals[:n_consts],
        invals[n_consts : n_consts + n_carry],
        invals[n_consts + n_carry :],
    )

    wide = _wide_sources(ev, xs)
    checkpointed_body = any(e.primitive is _jaxpr.REMAT for e in params["jaxpr"].jaxpr.eqns)
    # Float8 delayed scaling: the body's matmul states, stacked over the steps, go in
    # beside `xs` (`_fp8_state.Sites`); while they are made, one record of them.
    stacked, recording = (None, None) if ev.sites is None else ev.sites.scan_entry(eqn)

    def evaluation(sliced: Any) -> _Evaluation:
        if ev.sites is None:
            return ev
        return ev.with_sites(recording if recording is not None else ev.sites.child(sliced))

    def run_body(carry: list, x: list, sliced: Any) -> list:
        inner = evaluation(sliced)
        outs = _eval_closed(params["jaxpr"], [*consts, *carry, *x], inner)
        if inner.sites is not None and inner.sites is not recording:
            inner.sites.check_used()
        return outs

    def body(carry, x_and_states):
        x, sliced = x_and_states
        x = _follow_weights(ev, xs, list(x), wide)
        # The carry each step starts from is kept for the backward pass; without it the
        # region's checkpoint runs the whole loop again to find it. A body that is the
        # user's checkpoint (`nn.scan` over `nn.remat` blocks) keeps what that hands out.
        if not checkpointed_body:
            carry = [ev.kept_value(c) for c in carry]
        ev.inherit([*init, *xs], [*carry, *x])
        outs = run_body(carry, x, sliced)
        new_carry = [_cast(o, c.dtype) for o, c in zip(outs[:n_carry], carry, strict=True)]
        return new_carry, outs[n_carry:]

    # A float32 carry that starts as a weight (an embedding, zeros) and that the body makes an
    # activation (a layer's output, as under `nn.scan` over blocks) is carried in the compute
    # dtype, as it is between the layers of a Python loop (`activations.meet`); a carry that
    # the body keeps in float32 (a sum of losses, statistics) stays float32.
    def made(carry):
        def run(carry, x, sliced):
            return run_body(carry, x, sliced)[:n_carry]

        def one(v: Any) -> Any:
            return jax.ShapeDtypeStruct(v.shape[1:], v.dtype)

        sliced_one = jax.tree.map(one, stacked)
        return [o.dtype for o in jax.eval_shape(run, carry, [one(v) for v in xs], sliced_one)]

    init = list(init)
    if any(_is_float(c) and c.dtype == _FLOAT32 and ev.kind(c) == WEIGHT for c in init):
        for i, dtype in enumerate(made(init)):
            c = init[i]
            if _is_float(c) and c.dtype == _FLOAT32 and ev.kind(c) == WEIGHT and dtype != c.dtype:
                init[i] = weight_at_use(c, dtype)

    carry, ys = lax.scan(
        body,
        list(init),
        ([*xs, *[w for _, w in wide]], stacked),  # a weight's cast: its float32 weight beside it
        length=params["length"],
        reverse=params["reverse"],
        unroll=params["unroll"],
    )
    return [*carry, *ys]


def _while(ev: _Evaluation, eqn: Any, invals: list) -> list:
    params = eqn.params
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    cond_consts, body_consts, init = invals[:nc], invals[nc : nc + nb], invals[nc + nb :]

    def cond_fn(carry):
        ev.inherit(init, carry)
        return _eval_closed(params["cond_jaxpr"], [*cond_consts, *carry], ev)[0]

    def body_fn(carry):
        ev.inherit(init, carry)
        outs = _eval_closed(params["body_jaxpr"], [*body_consts, *carry], ev)
        return [_cast(o, c.dtype) for o, c in zip(outs, carry, strict=True)]

    return list(lax.while_loop(cond_fn, body_fn, list(init)))


def _cond(ev: _Evaluation, eqn: Any, invals: list) -> list:
    params = eqn.params
    index, operands = invals[0], invals[1:]
    branches = [functools.partial(_eval_closed, b, ev=ev) for b in params["branches"]]
    shapes = [jax.eval_shape(lambda *a, f=f: f(list(a)), *operands) for f in branches]
    dtypes = [
        _widest([s[i].dtype for s in shapes])
        if jnp.issubdtype(shapes[0][i].dtype, jnp.floating)
        else None
        for i in range(len(shapes[0]))
    ]

    def agreeing(f):
        def run(*a):
            ev.inherit(operands, a)
            outs = f(list(a))
            return [o if d is None else _cast(o, d) for o, d in zip(outs, dtypes, strict=True)]

        return run

    return list(lax.switch(index, [agreeing(f) for f in branches], *operands))


STRUCTURE = RuleSet(
    "autocast's structure",
    {
        **dict.fromkeys(_jaxpr.CALLS, _eval_call),
        _jaxpr.REMAT: _eval_remat,
        _jaxpr.SCAN: _in_its_place(_scan),
        _jaxpr.WHILE: _in_its_place(_while),
        _jaxpr.COND: _in_its_place(_cond),
    },
    by_name=dict.fromkeys(_jaxpr.FALLBACK_NAMES, _eval_call),
)
"""The base of autocast's rule sets: calls inlined; loops, branches and the user's checkpoints
rebuilt with public APIs around bodies run by the same rule set."""
AUTOCAST = STRUCTURE.over(
    "autocast",
    {
        **{p: _BY_RUNS_IN[rule.runs_in] for p, rule in _rules.RULES.items()},
        **dict.fromkeys(_jaxpr.CUSTOM_DERIVATIVES, _eval_custom_derivative),
    },
    by_name={
        **{name: _BY_RUNS_IN[rule.runs_in] for name, rule in _rules.RULES_BY_NAME.items()},
        _jaxpr.SHARD_MAP_NAME: _in_shard_map,
    },
    default=_eval_primitive,
)
"""autocast: each primitive of the rules table by what it means (`_rules.RULES`: in the
compute dtype, in float32, ...), and the user's `allow` and `deny` lists; custom derivatives
rebuilt with their rules; any other primitive by `_eval_primitive`."""
FLOAT8 = AUTOCAST.over("float8 and block-scaled", {_jaxpr.DOT_GENERAL: _float8_matmul})
"""A float8 or block-scaled policy: the matmuls that can run in its format (the others, and
every other operation, as under `AUTOCAST`)."""
CAST_AT_USE = STRUCTURE.over(
    "cast_at_use",
    {
        _jaxpr.CONVERT: _at_use_convert,
        **dict.fromkeys(_LAX_MATMULS, _at_use_matmul),
    },
    default=_eval_cast_at_use,
)
"""`cast_at_use`: the program as traced, but for its weights' casts and the values the float32
list holds in float32 (`_at_use_convert`, `_at_use_matmul`, `_eval_cast_at_use`)."""


def rule_set(rules: _Rules) -> RuleSet:
    """The rule set a region with `rules` runs its program by."""
    if rules.at_use:
        return CAST_AT_USE
    return FLOAT8 if rules.fp8 else AUTOCAST
