"""What autocast evaluates a program under: the rules of a policy (`_Rules`), and one
evaluation's records of its values (`_Evaluation`: their kinds, the half-precision operands
kept for the backward pass under `RESIDUAL`, weights, and float8 delayed scaling's `Sites`),
with the casts every rule uses."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import Literal

from jmp_policy._autocast.activations import ISLAND, STATISTIC, WEIGHT, kind_of_dtype
from jmp_policy._core import jaxpr as _jaxpr
from jmp_policy._core import rules as _rules
from jmp_policy._core.naming import TOP_LEVEL
from jmp_policy._fp8.state import Sites
from jmp_policy.fp8 import float8_format, warn_head_in_low_precision
from jmp_policy.policy import Policy, casting_policy

_FLOAT32 = np.dtype(np.float32)


@dataclasses.dataclass(frozen=True)
class _Rules:
    compute: np.dtype
    output: np.dtype
    allow: frozenset
    deny: frozenset
    # With a float8 compute dtype (the rule set `programs.FLOAT8`): eligible matmuls run as
    # `fp8_dot_general` with these (scaling, fmt), and `compute` is bfloat16 for everything else; a
    # `DelayedScaling` scaling: as `_fp8_state.delayed_dot_general`, with `_Evaluation.sites`.
    fp8: tuple[Any, str] | None = None
    fp8_exclude: tuple[str, ...] = ()
    # `jmp_policy.matmul`: float32 operands' gradients made in float32 (`reduce`), and
    # the matmul's result in `accumulate` (None: the compute dtype).
    reduce: bool = False
    accumulate: np.dtype | None = None
    # `cast_at_use` (the rule set `programs.CAST_AT_USE`): the program runs as traced, except
    # where a weight's 16-bit cast is used (`_eval_cast_at_use`).
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


RESIDUAL = "jmp_autocast_residual"
"""The name (`jax.ad_checkpoint.checkpoint_name`) of what an autocast region keeps for the
backward pass: the outputs of the equations `_rules.kept_for_backward` names (matmuls, ...),
the half-precision operands of its matmuls and the half-precision inputs of its float32
islands (`_Evaluation.island_input`). The region is `jax.checkpoint`ed to save only these
(`REGION_POLICY`), and where it can, the half-precision transcendental functions' outputs
(`REGION_POLICY_KEEPING_TRANSCENDENTALS`): everything else, its float32 islands first, is
computed again from them in the backward pass, so no island keeps a float32 activation."""
REGION_POLICY = jax.checkpoint_policies.save_only_these_names(RESIDUAL)


@dataclasses.dataclass(frozen=True)
class _KeepingTranscendentals:
    """`REGION_POLICY`, and the outputs of the half-precision transcendental functions
    (`_rules.kept_in_half`), which their derivatives read: in the MLP of
    benchmarks/bench_memory.py (GELU between its layers) the float16 gradient took 1.11x of
    Flax's own `dtype=` model's computing them again, 1.02-1.04x keeping them (bfloat16:
    0.99-1.00x, 0.90-0.93x; runs of one day on 2 CPU cores, BENCHMARKS.md).

    For a region without a `jax.checkpoint` of the user's only: JAX applies the outermost
    policy to every equation, inside the user's checkpoint too, whose policy decides there
    (`test_the_users_own_checkpoint_inside_autocast_keeps_what_its_policy_saves`)."""

    def __call__(self, primitive: Any, *avals: Any, **params: Any) -> bool:
        return bool(REGION_POLICY(primitive, *avals, **params)) or _rules.kept_in_half(
            primitive, avals
        )

    def __repr__(self) -> str:  # as it shows in a jaxpr: the same in every process
        return f"{REGION_POLICY!r} and half-precision transcendentals"


REGION_POLICY_KEEPING_TRANSCENDENTALS = _KeepingTranscendentals()


@dataclasses.dataclass(eq=False)
class Known:
    """What an evaluation knows of one value of the program: one record per value, held in
    the evaluation's environment beside the value (`_Evaluation.run`), and shared where a
    sub-program takes the caller's value itself (an inlined call's body).

    - `kind`: ISLAND or STATISTIC for a float32 value computed so far (`activations`; None:
      a weight, or an activation by its dtype);
    - `copy`: the half-precision operand a matmul took for the value, kept for the backward
      pass (`RESIDUAL`): every matmul that takes the value takes that one;
    - `name`: a region input's place in the arguments (`out.weight`);
    - `weight`: a float32 weight (`cast_at_use`); `cast_of`: the float32 weight this 16-bit
      value is a cast of;
    - `constant`: computed from the program's constants alone (a fill of zeros, an iota, a
      table of positions), in whatever dtype: no activation (`WEIGHT`), as a float32 one
      traced by autocast is.
    """

    kind: str | None = None
    copy: Any = None
    name: str | None = None
    weight: bool = False
    cast_of: Any = None
    constant: bool = False


class _Records(_jaxpr.Records):
    """What one evaluation has learned of its values (see `_Evaluation`): a `Known` record
    per value."""

    def __init__(self, transcendentals: bool = False) -> None:
        super().__init__(Known)
        # Whether the region's policy keeps half-precision transcendentals' outputs.
        self.transcendentals = transcendentals
        # Under a float8 or block-scaled policy: (where, format or None) of the last matmul
        # evaluated, in program order; the last before the output is the logits head.
        self.last_matmul: tuple[str, str | None] | None = None

    def written(self, x: Any) -> Known:
        """The record of `x` to write to (made if there is none); once the region is traced, a
        record of its own that nothing reads: nothing more is recorded."""
        return self.of(x) or Known()


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

    What it knows of a value is one `Known` record beside it in the environment of the
    program being run (`run`, `_jaxpr.Records`): rules read and write it through the methods
    below, by the value (an operand of the equation being evaluated, or one the rule made).
    Once the region is traced (`close`) nothing more is recorded or found, so a derivative
    rule JAX traces later reads values by their dtype alone.

    `keeps` (None where the region is not `jax.checkpoint`ed: `cast_at_use`, float32):
    whose outputs are named `RESIDUAL` (`_rules.kept_for_backward`; inside the user's own
    `jax.checkpoint`, what its policy saves, as `within_checkpoint` says). `transcendentals`:
    the region's policy is `REGION_POLICY_KEEPING_TRANSCENDENTALS`.
    """

    def __init__(
        self,
        rules: _Rules,
        records: _Records | None = None,
        keeps: Callable[[Any], bool] | None = None,
        sites: Sites | None = None,
        transcendentals: bool = False,
    ):
        self.rules = rules
        self.keeps = keeps
        self.sites = sites
        self._records = _Records(transcendentals) if records is None else records

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
        """`eqn`'s outputs, named `RESIDUAL` where `keeps` says so. A half-precision
        transcendental function's, which `REGION_POLICY_KEEPING_TRANSCENDENTALS` keeps as
        they are, are recorded: a matmul that takes one as its operand keeps no copy."""
        if self.keeps is None:
            return outs
        if not self.keeps(eqn):
            records = self._records
            if (
                records.transcendentals
                and records.open
                and _rules.kept_in_half(eqn.primitive, outs)
            ):
                for o in outs:
                    records.written(o).copy = o
            return outs
        return [_named(o) for o in outs]

    def kept_value(self, x: Any) -> Any:
        """`x` named `RESIDUAL` where the region chooses what is kept (not inside the
        user's own checkpoint)."""
        return _named(x) if self.keeps is _rules.kept_for_backward else x

    def island_input(self, x: Any) -> Any:
        """`x`, a full-size 16-bit operand of a float32 island, kept as a matmul's operand is
        (`operand`: named `RESIDUAL` once where the region chooses what is kept, a weight's
        copy cast again instead): the island is computed again from it in the backward pass,
        and nothing before it is computed again to make it (an island or a matmul that reads
        `x` later takes the same copy). Not kept, a layer norm's input was made again there
        from the whole residual stream before it: the float16 Equinox example's gradient took
        1.22x of MPX's, 0.90-0.94x keeping it (XLA:CPU, BENCHMARKS.md).

        The half-precision ops reading `x` read it as it was, not the kept copy: with every
        reader taking the copy, the same example took 1.37x (JAX's checkpoint puts a
        `reduce_precision` on each kept value the forward pass reads: 44 such XLA:CPU
        fusions against 28). So the MLP keeps a matmul's output and its biased sum both
        (0.35x of float32's residuals, not 0.27x)."""
        if jnp.finfo(x.dtype).bits != 16:
            return x
        return self.operand(x, x.dtype)  # the one copy a matmul would keep of it

    def operand(self, x: Any, half: np.dtype) -> Any:
        """`x` as a matmul's operand in `half`: an activation's copy is kept for the backward
        pass (`RESIDUAL`, one per value); a weight's is cast again there from the weight."""
        if not _is_float(x):
            return x
        known = self._records.find(x)
        found = None if known is None else known.copy
        if found is not None and found.dtype == half:
            return found
        copy = _cast(x, half)
        own_choice = self.keeps is _rules.kept_for_backward  # not inside the user's checkpoint
        if not own_choice or self.kind(x) == WEIGHT:
            return copy
        copy = _named(copy)
        self._records.written(x).copy = copy
        return copy

    def name_inputs(self, inputs: Iterable, names: Iterable[str]) -> None:
        """Names the region's inputs by their places in the arguments (`out.weight`)."""
        for x, name in zip(inputs, names, strict=True):
            self._records.written(x).name = name

    def note_matmul(self, where: str, fmt: str | None, operands: Iterable) -> None:
        """A matmul at module path `where` evaluated, in `fmt` (None: in 16 bits); outside any
        module (an Equinox layer's) it is named by the input among its `operands`."""
        if where == TOP_LEVEL:
            named = [k.name for x in operands if (k := self._records.find(x)) and k.name]
            where = f"the matmul on {named[-1]}" if named else where
        self._records.last_matmul = (where, fmt)

    def close(self) -> None:
        last = self._records.last_matmul
        if self._records.open and last is not None and last[1] is not None:
            where = last[0]
            if where.startswith("the matmul on "):  # outside any module: named by its weight
                owner = where.removeprefix("the matmul on ").rsplit(".", 1)[0]
                keep_out = (
                    f"an override of its module, overrides={{{owner.replace('.', '/')!r}: "
                    "'mixed_bfloat16'}} (eqx.mixed_precision), or, under autocast, a "
                    "`jax.named_scope('head')` around it (fp8_exclude matches name scopes)"
                )
            elif where == TOP_LEVEL:  # in no module, on no named input: no path to match
                keep_out = "a `jax.named_scope('head')` around it (fp8_exclude matches name scopes)"
            else:
                name = re.escape(where.rsplit("/", 1)[-1])
                keep_out = (
                    f"fp8_exclude=(*jmp_policy.fp8.FP8_EXCLUDE, {name!r}) (a pattern matched "
                    "against each part of a module path)"
                )
            warn_head_in_low_precision(where, last[1], keep_out)
        self._records.close()

    def run(self, jaxpr: Any, consts: list, args: list, rule: Callable[[Any, list], list]) -> list:
        """`jaxpr` run equation by equation (`rule(eqn, invals)` gives each one's outputs),
        a `Known` record beside each value (`_jaxpr.Records`)."""
        return _jaxpr.evaluate(jaxpr, consts, args, rule, self._records)

    def kind(self, x: Any) -> str:
        known = self._records.find(x)
        if known is not None and known.constant:
            return WEIGHT
        return kind_of_dtype(x.dtype, None if known is None else known.kind)

    def from_constants(self, eqn: Any, invals: list) -> bool:
        """Whether `eqn`'s floating operands are all constants (literals, or values computed
        from them alone; vacuously, for an equation with none: an iota, a cast of integers)."""
        for var, x in zip(eqn.invars, invals, strict=True):
            if _is_float(x) and not isinstance(var, Literal):
                known = self._records.find(x)
                if known is None or not known.constant:
                    return False
        return True

    def mark_constant(self, values: Iterable) -> None:
        for v in values:
            if _is_float(v):
                self._records.written(v).constant = True

    def kinds_of(self, values: Iterable) -> list:
        return [self.kind(x) for x in values if _is_float(x)]

    def record(self, values: Iterable, kind: str) -> None:
        if self._records.open and kind in (ISLAND, STATISTIC):
            for v in values:
                if _is_float(v) and v.dtype == _FLOAT32:
                    self._records.written(v).kind = kind

    def inherit(self, outer: Iterable, inner: Iterable) -> None:
        """A body's inputs (new tracers) have the kinds of the values they stand for."""
        for o, i in zip(outer, inner, strict=True):
            if _is_float(o) and _is_float(i):
                self.record([i], self.kind(o))

    def is_weight(self, x: Any) -> bool:
        known = self._records.find(x)
        return known is not None and known.weight

    def add_weight(self, x: Any) -> None:
        self._records.written(x).weight = True

    def downcast(self, x: Any) -> tuple[Any, Any] | None:
        """`(x, float32 weight)` if `x` is a weight's 16-bit cast (`cast_at_use`), else None."""
        known = self._records.find(x)
        return None if known is None or known.cast_of is None else (x, known.cast_of)

    def add_downcast(self, half: Any, weight: Any) -> None:
        """`half` is a 16-bit cast of `weight`, a float32 weight or a value computed from
        weights alone (a weight too)."""
        self._records.written(half).cast_of = weight
        self._records.written(weight).weight = True

    def as_weights(self, values: Iterable) -> list:
        """`values` with each weight's 16-bit cast (`cast_at_use`) replaced by its float32
        weight."""
        return [x if (found := self.downcast(x)) is None else found[1] for x in values]


def _named(x: Any) -> Any:
    return checkpoint_name(x, RESIDUAL) if hasattr(x, "dtype") else x
