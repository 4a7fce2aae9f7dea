"""How one operation runs under autocast's rules: the op lists, the rules of a policy,
the kinds of values (`jmp_policy.activations`), float32 islands and half-precision
quotients, and a matmul's operands (`jmp_policy.matmul`, float8)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jmp_policy import _jaxpr
from jmp_policy._fp8_state import Sites, delayed_dot_general
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
    DelayedScaling,
    float8_format,
    fp8_dot_general,
    fp8_eligible,
    fp8_excluded_by,
)
from jmp_policy.matmul import mixed
from jmp_policy.policy import Policy, casting_policy

ALLOW = _jaxpr.names_running_in(_jaxpr.COMPUTE)
"""Primitives that run in the compute dtype (torch.amp's "lower precision" list): the matmuls
of `_jaxpr.MATMULS` by their names in the installed JAX (`dot_general`,
`conv_general_dilated`, and `ragged_dot_general`, what `lax.ragged_dot` binds)."""

DENY = _jaxpr.names_running_in(_jaxpr.FLOAT32)
"""Primitives that run in float32 (torch.amp's "float32" list, as JAX lowers it): exp, log,
powers and roots, erf, logistic, sums, products and cumulative sums (`_jaxpr.RULES`)."""

NO_HALF_KERNEL = _jaxpr.names_running_in(_jaxpr.NO_HALF_KERNEL)
"""Primitives that always run in float32: linear-algebra decompositions and FFTs have no
half-precision kernel (XLA and LAPACK have none; `rfft` refuses float16), and torch.amp keeps
them in float32 too."""

# Regions made by autocast/full_precision: kept as they are when nested.
_REGION_NAMES = ("jmp_autocast_region", "jmp_full_precision_region", "jmp_cast_at_use")
_CAST_AT_USE = "jmp_cast_at_use"
_FLOAT32 = np.dtype(np.float32)
# Run through `jmp_policy.matmul.mixed` when `reduce_dtype`/`accumulate_dtype` ask for it,
# with lax's functions (they take the equations' parameters as keywords).
_LAX_MATMULS = _jaxpr.LAX_MATMULS


@dataclasses.dataclass(frozen=True)
class _Rules:
    compute: np.dtype
    output: np.dtype
    allow: frozenset
    deny: frozenset
    # With a float8 compute dtype: eligible matmuls run as `fp8_dot_general`
    # with these (scaling, fmt), and `compute` is bfloat16 for everything else; a
    # `DelayedScaling` scaling: as `_fp8_state.delayed_dot_general`, with `_Evaluation.sites`.
    fp8: tuple[Any, str] | None = None
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
        fp8: tuple[Any, str],
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


RESIDUAL = "jmp_autocast_residual"
"""The name (`jax.ad_checkpoint.checkpoint_name`) of what an autocast region keeps for the
backward pass: the outputs of the equations `_jaxpr.kept_for_backward` names (matmuls, ...)
and the half-precision operands of its matmuls. The region is `jax.checkpoint`ed to save
only these (`REGION_POLICY`): everything else, its float32 islands first, is computed again
from them in the backward pass, so no island keeps a float32 activation."""
REGION_POLICY = jax.checkpoint_policies.save_only_these_names(RESIDUAL)


class _Records:
    """What one evaluation has learned of its values (see `_Evaluation`)."""

    def __init__(self) -> None:
        self.kinds: dict[int, tuple[Any, str]] = {}
        self.operands: dict[int, tuple[Any, Any]] = {}
        self.weights: dict[int, Any] = {}
        self.downcasts: dict[int, tuple[Any, Any]] = {}
        self.open = True

    def close(self) -> None:
        self.open = False
        for record in (self.kinds, self.operands, self.weights, self.downcasts):
            record.clear()


def _saved_by(policy: Any) -> Callable[[Any], bool]:
    """Which equations' outputs a `jax.checkpoint` of the user's, with `policy`, saves."""

    def saves(eqn: Any) -> bool:
        if policy is None:
            return False
        avals = [v.aval for v in eqn.invars]
        return policy(eqn.primitive, *avals, **eqn.params) is True

    return saves


class _Evaluation:
    """One evaluation of a program under `rules` (an autocast region, with its sub-programs):
    what it has learned of the values it computed, passed to every rule.

    - `kinds`: the kind (`jmp_policy.activations`) of the float32 values computed so far
      (values not recorded are weights, or activations by dtype);
    - `operands`: the half-precision operand a matmul took for a value, kept for the
      backward pass (`RESIDUAL`): every matmul that takes the value takes that one;
    - `weights` and `downcasts` (`cast_at_use`): the weights, and each 16-bit cast of a
      weight with the float32 weight it came from.

    JAX values are not hashable, so each record is keyed by `id()` and keeps the value
    itself: an id is never reused while it is recorded, and a lookup checks identity. Once
    the region is traced (`close`) nothing more is recorded or found, so a derivative rule
    JAX traces later reads values by their dtype alone.

    `keeps` (None where the region is not `jax.checkpoint`ed: `cast_at_use`, float32):
    whose outputs are named `RESIDUAL` (`_jaxpr.kept_for_backward`; inside the user's own
    `jax.checkpoint`, what its policy saves, as `within_checkpoint` says).
    """

    def __init__(
        self,
        rules: _Rules,
        records: _Records | None = None,
        keeps: Callable[[Any], bool] | None = None,
        sites: Sites | None = None,
    ):
        self.rules = rules
        self.keeps = keeps
        self.sites = sites
        self._records = _Records() if records is None else records

    def with_rules(self, rules: _Rules) -> _Evaluation:
        """The same evaluation (what it learned so far, and will) under other rules."""
        return _Evaluation(rules, self._records, self.keeps, self.sites)

    def with_sites(self, sites: Sites | None) -> _Evaluation:
        """The same evaluation taking its float8 matmuls' delayed-scaling states from `sites`
        (a `scan` body's, one step of them)."""
        return _Evaluation(self.rules, self._records, self.keeps, sites)

    def within_checkpoint(self, policy: Any) -> _Evaluation:
        """The evaluation of the body of the user's `jax.checkpoint` with `policy`: the
        region's own `jax.checkpoint` decides what the whole program saves (JAX applies the
        outermost policy), so inside the body only what the user's policy saves is named."""
        keeps = None if self.keeps is None else _saved_by(policy)
        return _Evaluation(self.rules, self._records, keeps, self.sites)

    def naming_nothing(self) -> _Evaluation:
        """The same evaluation naming nothing `RESIDUAL`: inside a custom derivative's
        rewritten rules, whose tangents JAX transposes (a name has no transpose); the
        custom function runs again in the backward pass where its outputs are needed. Its
        float8 matmuls scale currently (a custom derivative cannot close over state)."""
        return _Evaluation(self.rules, self._records, None)

    def kept(self, eqn: Any, outs: list) -> list:
        """`eqn`'s outputs, named `RESIDUAL` where `keeps` says so."""
        if self.keeps is None or not self.keeps(eqn):
            return outs
        return [_named(o) for o in outs]

    def kept_value(self, x: Any) -> Any:
        """`x` named `RESIDUAL` where the region chooses what is kept (not inside the
        user's own checkpoint)."""
        return _named(x) if self.keeps is _jaxpr.kept_for_backward else x

    def operand(self, x: Any, half: np.dtype) -> Any:
        """`x` as a matmul's operand in `half`: an activation's copy is kept for the backward
        pass (`RESIDUAL`, one per value); a weight's is cast again there from the weight."""
        if not _is_float(x):
            return x
        found = self._found(self._records.operands, x)
        if found is not None and found.dtype == half:
            return found
        copy = _cast(x, half)
        own_choice = self.keeps is _jaxpr.kept_for_backward  # not inside the user's checkpoint
        if not own_choice or self.kind(x) == WEIGHT:
            return copy
        copy = _named(copy)
        if self._records.open:
            self._records.operands[id(x)] = (x, copy)
        return copy

    def close(self) -> None:
        self._records.close()

    @staticmethod
    def _found(record: dict, x: Any) -> Any:
        found = record.get(id(x))
        return found[1] if found is not None and found[0] is x else None

    def kind(self, x: Any) -> str:
        return kind_of_dtype(x.dtype, self._found(self._records.kinds, x))

    def kinds_of(self, values: Iterable) -> list:
        return [self.kind(x) for x in values if _is_float(x)]

    def record(self, values: Iterable, kind: str) -> None:
        if self._records.open and kind in (ISLAND, STATISTIC):
            for v in values:
                if _is_float(v) and v.dtype == _FLOAT32:
                    self._records.kinds[id(v)] = (v, kind)

    def inherit(self, outer: Iterable, inner: Iterable) -> None:
        """A body's inputs (new tracers) have the kinds of the values they stand for."""
        for o, i in zip(outer, inner, strict=True):
            if _is_float(o) and _is_float(i):
                self.record([i], self.kind(o))

    def is_weight(self, x: Any) -> bool:
        return self._records.weights.get(id(x)) is x

    def add_weight(self, x: Any) -> None:
        if self._records.open:
            self._records.weights[id(x)] = x

    def downcast(self, x: Any) -> tuple[Any, Any] | None:
        """`(x, float32 weight)` if `x` is a weight's 16-bit cast (`cast_at_use`), else None."""
        found = self._records.downcasts.get(id(x))
        return found if found is not None and found[0] is x else None

    def add_downcast(self, half: Any, weight: Any) -> None:
        if self._records.open:
            self._records.downcasts[id(half)] = (half, weight)


def _named(x: Any) -> Any:
    return checkpoint_name(x, RESIDUAL) if hasattr(x, "dtype") else x


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
    rule = _jaxpr.rule_of(eqn)
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


def _adding_in_float32(eqn: Any, invals: list) -> list:
    """`eqn` (a gather: `Rule.adds_in_transpose`) on its floating operands cast to float32,
    its result cast back: the same values (a gather rounds nothing), and the backward pass's
    sum of the cotangents (the gather's transpose, a scatter-add) made in float32. It is
    linear: nothing of its operands is kept for the backward pass."""
    outs = _bind(eqn, [_cast(x, _FLOAT32) for x in invals])
    return [_cast(o, invals[0].dtype) for o in outs]


def _eval_by_rules(ev: _Evaluation, eqn: Any, invals: list, floating: list) -> list:
    rules, name = ev.rules, eqn.primitive.name
    if (
        rules.fp8
        and eqn.primitive is _jaxpr.DOT_GENERAL
        and name in rules.allow
        and len(floating) == 2
    ):
        lhs, rhs = (ev.operand(x, x.dtype) for x in invals)
        dimension_numbers = eqn.params["dimension_numbers"]
        outer = _jaxpr.current_name_stack()
        where = "/".join(p for p in (outer, str(eqn.source_info.name_stack)) if p)
        scaling, fmt = rules.fp8
        if fp8_eligible(lhs.shape, rhs.shape, dimension_numbers, fmt) is None and (
            fp8_excluded_by(where, rules.fp8_exclude) is None
        ):
            with _source_context(eqn):
                if not isinstance(scaling, DelayedScaling):
                    out = fp8_dot_general(
                        lhs, rhs, dimension_numbers, fmt=fmt, scaling=scaling,
                        out_dtype=rules.compute,
                    )  # fmt: skip
                elif ev.sites is None:  # inside a custom derivative: current scaling
                    out = fp8_dot_general(lhs, rhs, dimension_numbers, fmt=fmt,
                                          out_dtype=rules.compute)  # fmt: skip
                else:
                    state = ev.sites.state_for(eqn)
                    out = delayed_dot_general(
                        lhs, rhs, dimension_numbers, state, scaling, out_dtype=rules.compute
                    )
            return [out]
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
            return [mixed(op, rules.compute, rules.accumulate, lhs, rhs)]
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
    strong = [i for i in floating if not getattr(eqn.invars[i].aval, "weak_type", False)]
    if not strong:
        outs = _bind(eqn, invals)
        ev.record(outs, combined(ev.kinds_of(invals)))
        return outs
    target, kind = meet([invals[i].dtype for i in strong], [ev.kind(invals[i]) for i in strong])
    if target == _FLOAT32 and kind == ISLAND:  # an island computing on activations
        return _in_float32(ev, eqn, invals, island_half)
    # Only an elementwise op broadcasts its operands to its output's shape (a concatenation
    # or a scatter does not).
    rule = _jaxpr.rule_of(eqn)
    elementwise = rule is not None and rule.elementwise
    shape = eqn.outvars[0].aval.shape if rules.reduce and elementwise else None
    met = [_meeting(ev, x, target, shape) for x in invals]
    if rule is not None and rule.adds_in_transpose and _half_among(met) is not None:
        outs = _adding_in_float32(eqn, met)
    else:
        outs = _bind(eqn, met)
    ev.record(outs, kind)
    return outs


def _meeting(ev: _Evaluation, x: Any, target: Any, shape: tuple | None) -> Any:
    """`x` cast to the dtype of the op it meets: a weight or constant cast down as
    `activations.weight_at_use` says (saturating; broadcast in float32 first with `shape`)."""
    if _is_float(x) and x.dtype != target and ev.kind(x) == WEIGHT:
        if np.ndim(x) != len(shape or ()):
            shape = None
        return weight_at_use(x, target, shape)
    return _cast(x, target)
