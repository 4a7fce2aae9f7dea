"""The precision debugger's rule sets over the engine's interpreter
(`jmp_policy._core.interpreter`): every operation recorded (`RECORDING`), and with loops and
branches unrolled (`UNROLLING`) into the one program that returns every value, replayed on the
host (`_Collector`, `_Host`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from jmp_policy._core import jaxpr as _jaxpr
from jmp_policy._core.compat import eval_jaxpr
from jmp_policy._core.interpreter import RuleSet
from jmp_policy._core.overrides import FULL_PRECISION_REGION
from jmp_policy._reports.debugger.names import _float32_island, _layer_and_direction, _once, _source
from jmp_policy._reports.debugger.report import NonFiniteOrigin
from jmp_policy._reports.debugger.values import _Accumulator, _all_finite, _carries_mask
from jmp_policy.policy import is_floating_array


@dataclasses.dataclass(eq=False)
class _Run:
    """One program run by the debugger's rules (the `ctx` they are given): the interpreter
    running it, where it sits (`stack`), whether its inputs carry the pullback's seed
    (`seeded_run`: which do is marked), and the flags of its variables."""

    interpreter: _Interpreter
    stack: str
    seeded_run: bool
    seeded: set = dataclasses.field(default_factory=set)  # variables carrying the seed
    constant: set = dataclasses.field(default_factory=set)  # computed from literals alone

    def flags(self, v: Any) -> tuple[bool, bool]:
        """(carries the pullback's seed, comes from literals alone) of variable `v`."""
        if isinstance(v, jcore.Literal):
            return False, True
        return v in self.seeded, v in self.constant

    def mark(self, variables: Sequence[Any], marks: Iterable[tuple[bool, bool]]) -> None:
        for v, (seed, const) in zip(variables, marks, strict=True):
            if seed:
                self.seeded.add(v)
            if const:
                self.constant.add(v)

    def here(self, eqn: Any) -> str:
        """The name stack of `eqn`: where this program sits, then the equation's own."""
        own = _once(str(eqn.source_info.name_stack))
        return "/".join(p for p in (self.stack, own) if p)

    def in_flags(self, eqn: Any) -> list[tuple[bool, bool]]:
        return [self.flags(v) for v in eqn.invars]

    def structured(self, run: Callable[..., list], eqn: Any, invals: list) -> list:
        """`eqn`, a loop, branch or call, run by `run(eqn, invals, in_flags, here, seeded)`
        of the interpreter, its outputs flagged as `interpreter.flags_out` says."""
        outs = run(eqn, invals, self.in_flags(eqn), self.here(eqn), self.seeded_run)
        self.mark(eqn.outvars, self.interpreter.flags_out)
        return outs


def _inlined(run: _Run, eqn: Any, invals: list) -> list:
    """A call, a remat or a custom derivative: its body run in its place, by the same rules."""
    return run.structured(run.interpreter.inline, eqn, invals)


def _recorded(run: _Run, eqn: Any, invals: list) -> list:
    """Any other operation: bound as it is, and recorded (`_Interpreter._record`)."""
    in_flags = run.in_flags(eqn)
    gradient = any(f[0] for f in in_flags) if run.seeded_run else None
    from_literals = all(f[1] for f in in_flags)
    outs = _jaxpr.bind(eqn, invals)
    run.interpreter._record(eqn, run.here(eqn), invals, outs, gradient, from_literals)
    run.mark(eqn.outvars, [(bool(gradient), from_literals)] * len(eqn.outvars))
    return outs


RECORDING = RuleSet(
    "the precision debugger",
    dict.fromkeys([*_jaxpr.CALLS, _jaxpr.REMAT, *_jaxpr.CUSTOM_DERIVATIVES], _inlined),
    by_name=dict.fromkeys(_jaxpr.FALLBACK_NAMES, _inlined),
    default=_recorded,
)
"""The debugger's rules: every operation recorded with its values, calls (and remats, custom
derivatives' functions) inlined; a loop or branch is bound whole (`UNROLLING` runs them)."""


def _unrolled(method: str) -> Callable[[_Run, Any, list], list]:
    """The rule running a loop or branch by the interpreter's `method` (`_Collector`'s)."""

    def rule(run: _Run, eqn: Any, invals: list) -> list:
        return run.structured(getattr(run.interpreter, method), eqn, invals)

    return rule


UNROLLING = RECORDING.over(
    "the precision debugger, loops unrolled",
    {
        _jaxpr.SCAN: _unrolled("run_scan"),
        _jaxpr.WHILE: _unrolled("run_while"),
        _jaxpr.COND: _unrolled("run_cond"),
    },
)
"""`RECORDING`, with the operations inside loops and branches recorded one by one
(`_Collector`)."""


class _Interpreter:
    """Runs a jaxpr equation by equation by its `rule_set` (calls inlined); `_record` sees
    each operation. `values`: a record per value (`_jaxpr.Records`), where a subclass keeps
    one."""

    values: _jaxpr.Records | None = None
    rule_set: RuleSet = RECORDING

    def run(
        self,
        jaxpr: Any,
        consts: Sequence[Any],
        args: Sequence[Any],
        stack: str,
        cotangent: Sequence[bool] | None = None,
        literal: Sequence[bool] | None = None,
    ) -> list:
        """Runs `jaxpr`, recording every operation on data.

        With `cotangent` (which `args` carry the pullback's seed), an operation is backward when
        its inputs carry it (a gradient), forward otherwise, whatever its name stack says (a
        weight cast again for the backward pass is not a gradient). An operation on literals
        alone (a mask or a placeholder the program builds from constants) is left out of the
        statistics; an inf/NaN it makes from finite values is still one.
        `literal` says which `args` come from literals alone. `self.flags_out` says, for each
        output, (carries the seed, comes from literals alone).
        """
        run = _Run(self, stack, cotangent is not None)
        run.mark(
            jaxpr.invars,
            zip(cotangent or [False] * len(args), literal or [False] * len(args), strict=True),
        )
        outs = self.rule_set.run(run, jaxpr, consts, args, self.values)
        self.flags_out = [run.flags(v) for v in jaxpr.outvars]
        return outs

    def call(
        self,
        sub: Any,
        args: Sequence[Any],
        flags: Sequence[tuple[bool, bool]],
        here: str,
        seeded: bool,
    ) -> list:
        """Runs the (closed) jaxpr `sub` on `args` whose `(seeded, literal)` flags are `flags`;
        `self.flags_out` then holds its outputs' flags."""
        inner = getattr(sub, "jaxpr", sub)
        consts = list(getattr(sub, "consts", []))
        cotangent = [f[0] for f in flags] if seeded else None
        return self.run(inner, consts, list(args), here, cotangent, [f[1] for f in flags])

    def inline(self, eqn: Any, invals: list, in_flags: list, here: str, seeded: bool) -> list:
        """A call, a remat or a custom derivative's function, run in place of `eqn`; under
        `autocast.full_precision`'s region, its operations are named by it."""
        sub = _jaxpr.inlined_body(eqn)
        if eqn.params.get("name") == FULL_PRECISION_REGION:
            here = f"{here}/{FULL_PRECISION_REGION}"
        n = len(getattr(sub, "jaxpr", sub).invars)
        return self.call(sub, invals[:n], in_flags[:n], here, seeded)

    def _record(
        self,
        eqn: Any,
        stack: str,
        invals: list,
        outs: list,
        gradient: bool | None = None,
        from_literals: bool = False,
    ) -> None:
        raise NotImplementedError


class _Host:
    """Records operations with their values on the host: statistics, op errors, and the first
    inf/NaN that the program's loss or gradients carry.

    Every non-finite value carries the set of operations that made an inf/NaN it comes from
    (by the value's place in `kept`). A value a `select` discards (the scale `max / amax` of an
    empty amax history, which a `where` replaces) carries nothing on, so it is not an inf of
    the program; `origin` is the first operation whose inf/NaN reaches the loss or a gradient.
    """

    def __init__(self, acc: _Accumulator):
        self.acc = acc
        self.origin: NonFiniteOrigin | None = None
        self.passed_on = 0
        self._made: list[tuple[NonFiniteOrigin, bool]] = []  # (where, only a mask's -inf)
        self._carried: dict[int, frozenset[int]] = {}  # kept index -> the `_made` it carries
        self._passes: list[frozenset[int]] = []  # what each operation that passed one on carried

    def _carries(self, refs: Sequence[tuple[bool, Any]]) -> frozenset[int]:
        found: frozenset[int] = frozenset()
        for traced, index in refs:
            if traced:
                found |= self._carried.get(index, frozenset())
        return found

    def _mark(self, refs: Sequence[tuple[bool, Any]], values: Sequence[Any], made) -> None:
        for (traced, index), value in zip(refs, values, strict=True):
            if traced and made and not _all_finite([value]):
                self._carried[index] = made

    def passed(self, in_refs: list, out_refs: list, outs: list) -> None:
        """Values moved without an operation on them (a loop's stacked outputs, a branch's
        selected ones): they carry what their inputs carried."""
        self._mark(out_refs, outs, self._carries(in_refs))

    def record(
        self,
        eqn: Any,
        key: tuple[str, str],
        island: str | None,
        from_literals: bool,
        invals: list,
        outs: list,
        rerun: list | None,
        in_refs: list,
        out_refs: list,
    ) -> None:
        floats = [o for o in outs if is_floating_array(o)]
        from_mask = _carries_mask(invals)
        if not from_literals:
            for value in floats:
                self.acc.add(key, value, island, from_mask)
            if key[1] == "forward":
                self.acc.op_error(key[0], eqn, invals, outs, island, rerun)
        if not floats or _all_finite(floats):
            return
        # A mask (1e30 or more, or its dtype's largest value) cast to or carried into a dtype
        # that cannot hold it becomes -inf: still a mask, not an overflow, unless it reaches
        # the loss. A NaN is never one.
        mask_carried = from_mask and not any(
            np.isnan(np.asarray(o, np.float64)).any() for o in floats
        )
        if _all_finite(invals):
            where = NonFiniteOrigin(eqn.primitive.name, key[0], key[1], _source(eqn), 0)
            self._made.append((where, mask_carried))
            made = frozenset([len(self._made) - 1])
        else:
            made = self._carries(in_refs)
            self._passes.append(made)
        self._mark(out_refs, outs, made)

    def finish(self, output_refs: list, outputs: list) -> None:
        """Sets `origin` (and `passed_on`) from what the program's outputs carry: the first
        inf/NaN made by an operation, a mask's -inf only where nothing else reached them."""
        reached = set()
        for ref, value in zip(output_refs, outputs, strict=True):
            if not _all_finite([value]):
                reached |= self._carries([ref])
        if not reached:
            return
        real = [i for i in sorted(reached) if not self._made[i][1]]
        first = (real or sorted(reached))[0]
        self.origin = self._made[first][0]
        self.passed_on = sum(first in carried for carried in self._passes)


def _merge_flags(runs: Sequence[Sequence[tuple[bool, bool]]]) -> list[tuple[bool, bool]]:
    """The flags of values that may come from any of `runs` (loop iterations, branches): seeded
    if any run's is, from literals alone if every run's is."""
    return [(any(f[0] for f in fs), all(f[1] for f in fs)) for fs in zip(*runs, strict=True)]


@dataclasses.dataclass(eq=False)
class _Kept:
    """A value's place among the outputs of `_Collector`'s program (None: not kept yet)."""

    index: int | None = None


class _Collector(_Interpreter):
    """Runs the program once under `jax.jit`, keeping what `_Interpreter._record` reads (every
    recorded operation's inputs, outputs and re-run outputs) as outputs of that one program;
    `replay` then records them on the host. One compile instead of one per operation.

    Loops and branches are descended into, so the layers inside them are named and judged
    operation by operation, and a loop's carry is never cast: a `scan` is unrolled; a `cond`
    runs every branch, and only the taken one's operations are recorded; a `while` loop runs
    as many times as it ran in the program, which a first run with a counter tells
    (`trip_counts`, keyed by where the loop sits; `pending` lists those still unknown)."""

    rule_set = UNROLLING

    def __init__(self, acc: _Accumulator, trip_counts: dict | None = None):
        self.acc = acc
        self.records: list = []
        self.output_refs: list = []
        self.kept: list = []
        self.values = _jaxpr.Records(_Kept)  # each value's place in `kept`
        self.trip_counts = trip_counts or {}
        self.pending: dict[tuple, int] = {}  # a while loop's place -> its counter in `kept`
        self._guards: list[tuple[int, int]] = []  # (branch index in `kept`, this branch)
        self._place: list[tuple] = []  # the loop iterations and branches around this point
        self._seen: dict[tuple, int] = {}

    def _where(self, eqn: Any) -> tuple:
        """Where this run of `eqn` sits: the same in every run of the program."""
        key = (*self._place, eqn)  # an equation is hashed by identity, and kept
        self._seen[key] = self._seen.get(key, -1) + 1
        return (*key, self._seen[key])

    def run_cond(self, eqn: Any, invals: list, in_flags: list, here: str, seeded: bool) -> list:
        """A `cond`: every branch run, only the taken one's operations recorded."""
        p, where = eqn.params, self._where(eqn)
        index, runs, flags = invals[0], [], []
        if not isinstance(index, jax.Array):  # a literal: only that branch can run
            taken = int(np.clip(int(index), 0, len(p["branches"]) - 1))
            return self.call(p["branches"][taken], invals[1:], in_flags[1:], here, seeded)
        for b, branch in enumerate(p["branches"]):
            self._guards.append((self._keep(index)[1], b))
            self._place.append((where, b))
            runs.append(self.call(branch, invals[1:], in_flags[1:], here, seeded))
            flags.append(self.flags_out)
            self._place.pop()
            self._guards.pop()
        self.flags_out = _merge_flags(flags)
        if len(runs) == 1:
            return runs[0]
        chosen = [jax.lax.select_n(index, *values) for values in zip(*runs, strict=True)]
        for values, out in zip(zip(*runs, strict=True), chosen, strict=True):
            self._passed(list(values), [out])
        return chosen

    def run_scan(self, eqn: Any, invals: list, in_flags: list, here: str, seeded: bool) -> list:
        """A `scan`, unrolled."""
        p, where = eqn.params, self._where(eqn)
        nc, nk, length = p["num_consts"], p["num_carry"], p["length"]
        consts, carry, xs = invals[:nc], invals[nc : nc + nk], invals[nc + nk :]
        carry_flags, xs_flags = in_flags[nc : nc + nk], in_flags[nc + nk :]
        ys, ys_flags = [], []
        for i in reversed(range(length)) if p["reverse"] else range(length):
            self._place.append((where, i))
            outs = self.call(
                p["jaxpr"],
                [*consts, *carry, *(x[i] for x in xs)],
                [*in_flags[:nc], *carry_flags, *xs_flags],
                here,
                seeded,
            )
            self._place.pop()
            carry, carry_flags = outs[:nk], self.flags_out[:nk]
            ys.append(outs[nk:])
            ys_flags.append(self.flags_out[nk:])
        if p["reverse"]:
            ys.reverse()
        empty = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in eqn.outvars[nk:]]
        stacked = [jnp.stack(y) for y in zip(*ys, strict=True)] if ys else empty
        for y, out in zip(zip(*ys, strict=True), stacked, strict=True):
            self._passed(list(y), [out])
        self.flags_out = [
            *carry_flags,
            *(_merge_flags(ys_flags) if ys else in_flags[nc + nk :]),
        ]
        return [*carry, *stacked]

    def run_while(self, eqn: Any, invals: list, in_flags: list, here: str, seeded: bool) -> list:
        """A `while` loop, run as often as it ran in the program (`trip_counts`)."""
        p, where = eqn.params, self._where(eqn)
        # while: cond_consts, body_consts, carry.
        cc, bc = p["cond_nconsts"], p["body_nconsts"]
        cond_consts, body_consts, carry = invals[:cc], invals[cc : cc + bc], invals[cc + bc :]
        if where not in self.trip_counts:
            # Not known yet: run it whole, with a counter, for the next run of the program.
            outs = _jaxpr.bind(eqn, invals)
            self.pending[where] = self._keep(_trip_count(p, cond_consts, body_consts, carry))[1]
            self.flags_out = list(in_flags[cc + bc :])  # this run is not recorded
            return list(outs)
        carry_flags = in_flags[cc + bc :]
        for i in range(self.trip_counts[where]):
            self._place.append((where, i))
            carry = self.call(
                p["body_jaxpr"],
                [*body_consts, *carry],
                [*in_flags[cc : cc + bc], *carry_flags],
                here,
                seeded,
            )
            self._place.pop()
            carry_flags = self.flags_out
        self.flags_out = carry_flags
        return list(carry)

    def _passed(self, invals: list, outs: list) -> None:
        """Values moved without an operation (`_Host.passed`)."""
        refs = ([self._keep(v) for v in invals], [self._keep(o) for o in outs])
        self.records.append((tuple(self._guards), None, None, None, False, *refs, None))

    def keep_outputs(self, outs: Sequence[Any]) -> None:
        """The program's outputs (the loss and its gradients), for `_Host.finish`."""
        self.output_refs = [self._keep(o) for o in outs]

    def _keep(self, value: Any) -> tuple[bool, Any]:
        """`(True, its place in kept)` for a traced value (or a constant): an output of the
        program, once however often it is read; `(False, value)` for anything else."""
        if isinstance(value, jax.Array):
            kept = self.values.of(value)  # type: ignore[union-attr]
            if kept.index is None:
                kept.index = len(self.kept)
                self.kept.append(value)
            return True, kept.index
        return False, value

    def _record(
        self,
        eqn: Any,
        stack: str,
        invals: list,
        outs: list,
        gradient: bool | None = None,
        from_literals: bool = False,
    ) -> None:
        key = _layer_and_direction(stack, gradient)
        island = _float32_island(stack)
        judged = not from_literals and key[1] == "forward" and island is None
        rerun = self.acc.rerun(eqn, invals, outs) if judged else None
        self.records.append(
            (
                tuple(self._guards),
                eqn,
                key,
                island,
                from_literals,
                [self._keep(v) for v in invals],
                [self._keep(o) for o in outs],
                None if rerun is None else [self._keep(r) for r in rerun],
            )
        )

    def replay(self, kept: Sequence[Any]) -> _Host:
        """Records every operation with the program's values, in program order."""
        host = _Host(self.acc)

        def get(refs: list) -> list:
            return [kept[v] if traced else v for traced, v in refs]

        for guards, eqn, key, island, from_literals, invals, outs, rerun in self.records:
            if any(int(np.asarray(kept[index])) != branch for index, branch in guards):
                continue  # a branch the program did not take
            if eqn is None:
                host.passed(invals, outs, get(outs))
                continue
            rerun = None if rerun is None else get(rerun)
            values = get(invals), get(outs)
            host.record(eqn, key, island, from_literals, *values, rerun, invals, outs)
        host.finish(self.output_refs, get(self.output_refs))
        return host


def _trip_count(params: dict, cond_consts: list, body_consts: list, carry: list) -> jax.Array:
    """How many times the `while` loop of `params` runs from `carry`."""
    cond, body = params["cond_jaxpr"], params["body_jaxpr"]

    def go_on(state):
        return eval_jaxpr(cond.jaxpr, cond.consts, *cond_consts, *state[1])[0]

    def step(state):
        return state[0] + 1, eval_jaxpr(body.jaxpr, body.consts, *body_consts, *state[1])

    return jax.lax.while_loop(go_on, step, (jnp.zeros((), jnp.int32), list(carry)))[0]
