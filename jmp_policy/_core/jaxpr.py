"""One reader of JAX programs for the whole library.

What `autocast`, `precision_report` (`census`), the precision debugger, `jmp_policy.matmul`
and the float8 exclusion know about jaxprs is decided here, once:

- what each primitive means to mixed precision is beside it, in `jmp_policy._core.rules`;
- which primitives are matmuls (`MATMULS`), and which hold sub-programs, by what they do
  with them: run them once where they stand (`CALLS`), recompute them for the backward pass
  (`REMAT`), loop or branch over them (`SCAN`, `WHILE`, `COND`), or give them a derivative
  rule (`CUSTOM_DERIVATIVES`); `inlined_body` is the one sub-program of a call, a remat or a
  custom derivative, which a reader may run in place of the equation;
- `bind`: one equation bound as `jax.core.eval_jaxpr` binds it (its sub-functions, its
  source information and name stack, its context `eqn.ctx`);
- `evaluate`: a jaxpr run equation by equation (literals read in their dtype, dropped
  outputs dropped), each equation handed to a rule that may run it otherwise;
- `walk`: every equation of a program and of its sub-programs, with its full name stack and
  how often it runs (a `scan` body `length` times);

Primitives are the objects of the installed JAX, from its public API
(`jax.extend.core.primitives`, or the primitive a public function binds, found by tracing
that function once), so a release that renames one changes nothing here. `FALLBACK_NAMES`
are the names of call primitives no public API exposes (JAX's main branch stages a jaxpr
evaluation as `eval_jaxpr`); tests/test_jaxpr.py checks that each is either a primitive of
the installed JAX or absent from it on purpose.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.extend.core import primitives as _primitives

from jmp_policy._core.compat import DropVar, bind_params, jaxprs_in_params
from jmp_policy._core.compat import source_info as _source_info


def _bound_by(fun: Callable[..., Any], *args: Any) -> Any:
    """The primitive of the last equation `fun(*args)` traces to."""
    return jax.make_jaxpr(fun)(*args).eqns[-1].primitive


_F32 = jnp.float32
DOT_GENERAL = _primitives.dot_general_p
CONV = _primitives.conv_general_dilated_p
RAGGED_DOT = _bound_by(
    lax.ragged_dot,
    jax.ShapeDtypeStruct((2, 4), _F32),
    jax.ShapeDtypeStruct((1, 4, 3), _F32),
    jax.ShapeDtypeStruct((1,), jnp.int32),
)
MATMULS = frozenset({DOT_GENERAL, CONV, RAGGED_DOT})
"""Matrix multiplications and convolutions: what runs in half precision (or float8)."""


def _bound_inside(fun: Callable[..., Any], *args: Any) -> Any:
    """The last primitive `fun(*args)` binds, inside the calls it makes."""
    return [e for e, _ in walk(jax.make_jaxpr(fun)(*args)) if not is_call(e)][-1].primitive


CALLS = frozenset({_primitives.jit_p, _primitives.closed_call_p, _primitives.call_p})
"""Primitives that run their one sub-program once, where they stand (`jax.jit`, ...)."""
FALLBACK_NAMES = frozenset({"eval_jaxpr"})
"""Names of call primitives the installed JAX may not expose (see the module docstring)."""
SHARD_MAP_NAME = "shard_map"
"""`jax.shard_map`'s primitive, read by name: finding its object means tracing a mesh at
import (tests/test_jaxpr.py checks the name)."""

CONVERT = _primitives.convert_element_type_p
BROADCAST_IN_DIM = _primitives.broadcast_in_dim_p
CHOOSERS = frozenset({_primitives.reduce_max_p, _primitives.reduce_min_p})
"""`reduce_max`, `reduce_min`: their derivative sums the tangents of the entries that tie."""
BITCAST = _primitives.bitcast_convert_type_p
REMAT = _primitives.remat_p
SCAN = _primitives.scan_p
WHILE = _primitives.while_p
COND = _primitives.cond_p
CHECKPOINT_NAME = _primitives.name_p
"""`jax.ad_checkpoint.checkpoint_name`: the identity, naming a value for `jax.checkpoint`'s
policies (autocast names what its regions keep); readers look through it."""
CUSTOM_JVP = _primitives.custom_jvp_call_p
CUSTOM_VJP = _primitives.custom_vjp_call_p
CUSTOM_DERIVATIVES = frozenset({CUSTOM_JVP, CUSTOM_VJP})
STRUCTURAL = CALLS | {REMAT, SCAN, WHILE, COND}
"""Primitives whose sub-programs a rewriter rebuilds with public APIs (`autocast`)."""


def is_call(eqn: Any) -> bool:
    """Whether `eqn` runs one sub-program once where it stands (`CALLS`)."""
    return eqn.primitive in CALLS or eqn.primitive.name in FALLBACK_NAMES


def is_matmul(eqn: Any) -> bool:
    return eqn.primitive in MATMULS


def is_callback(eqn: Any) -> bool:
    """A host callback (`jax.pure_callback`, `io_callback`, `jax.debug.callback`): by name,
    as JAX has one primitive per kind of callback."""
    return "callback" in eqn.primitive.name


def matmul_names() -> frozenset[str]:
    """The names of `MATMULS` in the installed JAX (for lists users write by name)."""
    return frozenset(p.name for p in MATMULS)


def inlined_body(eqn: Any) -> Any:
    """The (closed or open) sub-program a reader may run in place of `eqn`: a call's, a
    remat's, or a custom derivative's primal function; None for any other equation."""
    if not (is_call(eqn) or eqn.primitive is REMAT or eqn.primitive in CUSTOM_DERIVATIVES):
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in eqn.params:
            return eqn.params[key]
    return None


def current_name_stack() -> str:
    """The name stack operations are traced under here ("" where JAX does not say)."""
    return "" if _source_info is None else str(_source_info.current_name_stack())


def source_context(eqn: Any) -> contextlib.AbstractContextManager:
    """Where `eqn` is bound again: its traceback and its name stack under the current one."""
    if _source_info is None:
        return contextlib.nullcontext()
    name_stack = _source_info.current_name_stack() + eqn.source_info.name_stack
    return _source_info.user_context(eqn.source_info.traceback, name_stack=name_stack)


def bind(eqn: Any, invals: Sequence[Any], **param_updates: Any) -> list:
    """`eqn` bound on `invals` as `jax.core.eval_jaxpr` binds it (its parameters updated by
    `param_updates`): its name stack kept, so a rewritten program still says which module
    each operation belongs to, and its context (`eqn.ctx`) entered. A scatter given operands
    of another dtype than traced goes through its lax function, which builds the combining
    function (`update_jaxpr`) for their dtype."""
    subfuns, params = bind_params(eqn.primitive, {**eqn.params, **param_updates})
    ctx = getattr(getattr(eqn, "ctx", None), "manager", contextlib.nullcontext())
    with source_context(eqn), ctx:
        scatter = _LAX_SCATTERS.get(eqn.primitive.name)
        if scatter is not None and invals[0].dtype != eqn.invars[0].aval.dtype:
            kept = {k: v for k, v in params.items() if k not in ("update_jaxpr", "update_consts")}
            return [scatter(*invals, **kept)]
        outs = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def sub_programs(eqn: Any) -> list:
    """The programs an equation runs (a `jit`'s, a `scan`'s body, a `cond`'s branches), not a
    scatter's combining function (`update_jaxpr`): that is part of the scatter itself. Of a
    `lax.platform_dependent` branch, the one the default backend runs (`platform_branch`)."""
    if eqn.primitive.name in _LAX_SCATTERS:
        return []
    chosen = platform_branch(eqn)
    if chosen is not None:
        return [eqn.params["branches"][chosen]]
    return list(jaxprs_in_params(eqn.params))


# The names `lax.platform_dependent` gives the platforms of `jax.default_backend()`.
_LOWERING_NAMES = {"gpu": ("cuda", "rocm", "gpu")}


def platform_branch(eqn: Any) -> int | None:
    """For a `cond` made by `lax.platform_dependent` (its `branches_platforms`), the index of
    the branch `jax.default_backend()` runs; None for any other equation."""
    platforms = eqn.params.get("branches_platforms") if eqn.primitive is COND else None
    if platforms is None:
        return None
    backend = jax.default_backend()
    names = _LOWERING_NAMES.get(backend, (backend,))
    default = None
    for i, branch in enumerate(platforms):
        if branch is None:
            default = i
        elif any(name in branch for name in names):
            return i
    return default


_LAX_SCATTERS: dict[str, Callable[..., Any]] = {
    "scatter": lax.scatter,
    "scatter-add": lax.scatter_add,
    "scatter-mul": lax.scatter_mul,
    "scatter-min": lax.scatter_min,
    "scatter-max": lax.scatter_max,
}


def read_literal(literal: Any) -> Any:
    """A literal's value in the dtype of its abstract value (older JAX releases keep Python
    scalars in literals)."""
    dtype = getattr(literal.aval, "dtype", None)
    return literal.val if dtype is None else np.asarray(literal.val, dtype)


@dataclasses.dataclass(eq=False)
class _Frame:
    """One program being run by `evaluate` (nested for a sub-program): the current equation's
    operands with their records, and the records made while it is evaluated for values not
    yet bound to a variable (its outputs, a body's inputs)."""

    operands: list = dataclasses.field(default_factory=list)
    made: list = dataclasses.field(default_factory=list)

    def find(self, x: Any) -> Any:
        for pairs in (self.made, self.operands):
            for value, record in pairs:
                if value is x:
                    return record
        return None


class Records:
    """What an interpreter knows of each value of the programs it runs: one record per value
    (made by `new`), held beside the value in `evaluate`'s environment and found by the value
    itself (`is`; JAX values are not hashable): an operand of an equation being evaluated (at
    any depth), or a value a rule made a record for. An inlined body's input that is the
    caller's value shares the caller's record, and a program's outputs hand theirs to the
    caller, so a record follows its value through calls. `close()` ends it: nothing more is
    found or made."""

    def __init__(self, new: Callable[[], Any]) -> None:
        self.new = new
        # The first frame: what is known before the programs run (their inputs, constants).
        self.frames = [_Frame()]
        self.open = True

    def find(self, x: Any) -> Any:
        if not self.open:
            return None
        for frame in reversed(self.frames):
            record = frame.find(x)
            if record is not None:
                return record
        return None

    def of(self, x: Any) -> Any:
        """The record of `x`, made if there is none (None once closed)."""
        if not self.open:
            return None
        record = self.find(x)
        if record is None:
            record = self.new()
            self.frames[-1].made.append((x, record))
        return record

    def close(self) -> None:
        self.open = False
        self.frames = [_Frame()]


def evaluate(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    rule: Callable[[Any, list], list | None] | None = None,
    records: Records | None = None,
) -> list:
    """Runs `jaxpr` equation by equation: `rule(eqn, invals)` may return the outputs of an
    equation (run its own way); where it returns None (or there is no rule) the equation is
    bound as it is (`bind`). With `records`, each value carries its record (`Records`)."""
    if records is None:
        records = Records(lambda: None)
        records.close()
    env: dict = {}

    def put(variables: Sequence[Any], values: Sequence[Any]) -> None:
        for var, value in zip(variables, values, strict=True):
            if not isinstance(var, DropVar):
                record = records.find(value)
                env[var] = (value, records.new() if record is None and records.open else record)

    def read(var: Any) -> tuple[Any, Any]:
        return (read_literal(var), None) if isinstance(var, jcore.Literal) else env[var]

    # A closed program's constants keep one record each while the records are open (a
    # `scan` body run again, a sub-program called twice: the same arrays).
    for const in consts if records.open else ():
        if records.find(const) is None:
            records.frames[0].made.append((const, records.new()))
    put(jaxpr.constvars, consts)
    put(jaxpr.invars, args)
    frame = _Frame()
    records.frames.append(frame)
    try:
        for eqn in jaxpr.eqns:
            pairs = [read(v) for v in eqn.invars]
            if records.open:  # what `find` searches
                frame.operands = [p for p in pairs if p[1] is not None]
            invals = [value for value, _ in pairs]
            outs = rule(eqn, invals) if rule is not None else None
            if outs is None:
                outs = bind(eqn, invals)
            put(eqn.outvars, outs)
            frame.made.clear()
        results = [read(v) for v in jaxpr.outvars]
    finally:
        records.frames.pop()
    if records.open:
        records.frames[-1].made.extend(p for p in results if p[1] is not None)
    return [value for value, _ in results]


def producers(jaxpr: Any) -> dict:
    """`{variable: the equation that made it}` of a jaxpr's own equations; a named value
    (`CHECKPOINT_NAME`, the identity) maps to the equation that made what it names."""
    made = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    for eqn in jaxpr.eqns:
        if eqn.primitive is CHECKPOINT_NAME and not isinstance(eqn.invars[0], jcore.Literal):
            made[eqn.outvars[0]] = made.get(eqn.invars[0])
    return made


def within(eqn: Any, outer: Any | None) -> Any:
    """`eqn` with its name stack in full: a sub-program's equations (a scan body, a
    `custom_vjp`'s forward) name their modules relative to the equation holding them."""
    if outer is None or not str(outer.source_info.name_stack):
        return eqn
    stack = outer.source_info.name_stack + eqn.source_info.name_stack
    return eqn.replace(source_info=eqn.source_info.replace(name_stack=stack))


def walk(program: Any, times: int = 1, outer: Any | None = None) -> Iterator[tuple[Any, int]]:
    """Every equation of a (closed) jaxpr and of its sub-programs, depth first, with its full
    name stack (`within`) and how often it runs (a `scan` body `length` times)."""
    jaxpr = getattr(program, "jaxpr", program)
    for eqn in jaxpr.eqns:
        eqn = within(eqn, outer)
        yield eqn, times
        inner = times * eqn.params["length"] if eqn.primitive is SCAN else times
        for sub in sub_programs(eqn):
            yield from walk(sub, inner, eqn)


DIV = _primitives.div_p
MUL = _primitives.mul_p
LAX_MATMULS: dict[Any, Callable[..., Any]] = {
    DOT_GENERAL: lax.dot_general,
    CONV: lax.conv_general_dilated,
}
"""The lax function of each matmul a rewriter binds again with other operands: it takes the
equation's parameters as keywords, and adds what its operands need (`pvary` for a replicated
weight inside `shard_map`)."""


_F8, _SCALE = jnp.float8_e4m3fn, jnp.float8_e8m0fnu
BLOCK_SCALED_MATMUL = _bound_inside(
    jax.nn.scaled_matmul,
    jax.ShapeDtypeStruct((1, 32, 64), _F8),
    jax.ShapeDtypeStruct((1, 16, 64), _F8),
    jax.ShapeDtypeStruct((1, 32, 2), _SCALE),
    jax.ShapeDtypeStruct((1, 16, 2), _SCALE),
)
"""JAX's block-scaled GEMM: what `jax.nn.scaled_matmul` (and `jax.nn.scaled_dot_general`)
binds inside its `jit`, operands `(B, M, K)` and `(B, N, K)` of quantized values and their
blocks' scales."""
