"""One reader of JAX programs for the whole library.

What `autocast`, `precision_report` (`census`), the precision debugger, `jmp_policy.matmul`
and the float8 exclusion know about jaxprs is decided here, once:

- what each primitive means to mixed precision (`RULES`, `rule_of`): runs in the compute
  dtype (matmuls), in float32 (the float32 list), only in float32 (no half kernel), in its
  operands' dtype, or as traced; and whether it is elementwise (operands broadcast to its
  output), linear, a reduction, or a layout change. Every other module asks here;
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


def evaluate(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    rule: Callable[[Any, list], list | None] | None = None,
) -> list:
    """Runs `jaxpr` equation by equation: `rule(eqn, invals)` may return the outputs of an
    equation (run its own way); where it returns None (or there is no rule) the equation is
    bound as it is (`bind`)."""
    env: dict = {}

    def read(v: Any) -> Any:
        return read_literal(v) if isinstance(v, jcore.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        outs = rule(eqn, invals) if rule is not None else None
        if outs is None:
            outs = bind(eqn, invals)
        for var, value in zip(eqn.outvars, outs, strict=True):
            if not isinstance(var, DropVar):
                env[var] = value
    return [read(v) for v in jaxpr.outvars]


def evaluate_closed(closed: Any, args: Sequence[Any], rule: Any = None) -> list:
    return evaluate(closed.jaxpr, list(closed.consts), list(args), rule)


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


# --- what each primitive means to mixed precision ---------------------------------------

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
    transpose is a scatter-add: every edge a graph's hub sends adds into the hub), so that
    sum is made in float32.
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
        "reduce_max reduce_min argmax argmin reduce_and reduce_or reduce_xor reduce_window_max "
        "reduce_window_min cummax cummin scatter-max scatter-min select_and_scatter iota "
        "random_bits random_fold_in random_gamma random_seed random_split random_wrap "
        "random_unwrap threefry2x32 rng_bit_generator rng_uniform sharding_constraint "
        "device_put optimization_barrier pvary pbroadcast axis_index mesh_cast reshard "
        "platform_index".split(),
        _FOLLOWS,
    ),
    # Sorts, and collectives (computing them again would communicate again).
    **dict.fromkeys(
        "sort top_k approx_top_k psum pmax pmin psum_invariant all_gather all_to_all ppermute "
        "ragged_all_to_all reduce_scatter".split(),
        Rule(OPERANDS, kept=True),
    ),
    **dict.fromkeys(
        "bitcast_convert_type custom_lin reduce reduce_window create_token after_all get swap "
        "empty2 name".split(),
        Rule(AS_TRACED),
    ),
    **dict.fromkeys(["custom_linear_solve", "xla_pmap"], Rule(AS_TRACED, kept=True)),
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


DIV = _primitives.div_p
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
