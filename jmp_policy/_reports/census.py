"""Where a traced program does its work: which operations run in which dtype.

`precision_report(fun, *args)` traces `fun` (nothing runs) and counts, per
primitive, the floating dtype each equation computes in, walking into nested
programs (`jit`, `scan`, `cond`, `custom_jvp`/`custom_vjp`, remat, ...).

One counting rule: an equation counts once per execution. A `scan` body counts
`length` times; every other nested program (a `while` body, whose trip count is
unknown when tracing, the branches of a `cond`, a `jit`) counts once.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn

from jmp_policy._core import jaxpr as _jaxpr
from jmp_policy._core import naming as _naming
from jmp_policy._core.overrides import FLOAT32_ISLAND, FULL_PRECISION_REGION
from jmp_policy._core.tracing import trace as trace  # importable here too
from jmp_policy._core.tracing import traced_once as traced_once
from jmp_policy.block_scaled import SCOPE
from jmp_policy.errors import PrecisionWarning as PrecisionWarning  # importable here too
from jmp_policy.fp8 import fp8_eligible, fp8_excluded_by
from jmp_policy.matmul import CPU_WIDENED

MATMULS = _jaxpr.matmul_names()
"""The names of the matmul primitives (`_jaxpr.MATMULS`): dot_general, conv_general_dilated,
and the ragged dot (`lax.ragged_dot`'s primitive)."""
_BLOCK_VALUES = {"float8_e4m3fn": "mxfp8", "float8_e5m2": "mxfp8", "float4_e2m1fn": "nvfp4"}


def iter_equations(jaxpr: Jaxpr | ClosedJaxpr) -> Iterator[JaxprEqn]:
    """Yields every equation of a (closed) jaxpr, nested programs included (`_jaxpr.walk`)."""
    for eqn, _ in _jaxpr.walk(jaxpr):
        yield eqn


def _aval(var: Any) -> Any:
    """The abstract value (shape, dtype) of a jaxpr variable or literal; None if it has none."""
    return getattr(var, "aval", None)


def compute_dtype(eqn: JaxprEqn) -> np.dtype | None:
    """The floating dtype an equation computes in: its widest floating operand.

    Falls back to its outputs for equations without floating operands; None
    when nothing floating is involved (integer, bool and key arithmetic).
    """
    for group in (eqn.invars, eqn.outvars):
        dtypes = [
            d
            for d in (getattr(_aval(v), "dtype", None) for v in group)
            if d is not None and jnp.issubdtype(d, jnp.floating)
        ]
        if dtypes:
            return max(dtypes, key=lambda d: jnp.finfo(d).bits)
    return None


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out


def _matmul_shape_info(eqn: JaxprEqn) -> tuple[int, list[int], list[int]]:
    """FLOPs, and the GEMM sizes that tensor cores want as multiples of 8.

    For a dot: K (the contracting size) and M, N (the output sizes, batch
    dimensions aside). For a conv: its input and output channels.
    """
    out_shape = _aval(eqn.outvars[0]).shape
    lhs, rhs = _aval(eqn.invars[0]).shape, _aval(eqn.invars[1]).shape
    if eqn.primitive is _jaxpr.BLOCK_SCALED_MATMUL:  # (B, M, K) x (B, N, K)
        return 2 * _prod(out_shape) * lhs[-1], [lhs[-1]], [lhs[-2], rhs[-2]]
    if eqn.primitive is _jaxpr.CONV:
        rhs_spec = eqn.params["dimension_numbers"].rhs_spec
        in_features, out_features = rhs[rhs_spec[1]], rhs[rhs_spec[0]]
        window = _prod(rhs[d] for d in rhs_spec[2:])
        return 2 * _prod(out_shape) * in_features * window, [in_features], [out_features]
    groups: tuple = ()
    if eqn.primitive is _jaxpr.RAGGED_DOT:  # each row of lhs meets one group of rhs
        ragged = eqn.params["ragged_dot_dimension_numbers"]
        numbers, groups = ragged.dot_dimension_numbers, tuple(ragged.rhs_group_dimensions)
    else:
        numbers = eqn.params["dimension_numbers"]
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = numbers
    k = _prod(lhs[d] for d in lhs_contract)
    m = _prod(lhs[d] for d in range(len(lhs)) if d not in (*lhs_contract, *lhs_batch))
    n = _prod(rhs[d] for d in range(len(rhs)) if d not in (*rhs_contract, *rhs_batch, *groups))
    return 2 * _prod(out_shape) * k, [k], [m, n]


HALF = ("float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """Where a program's work runs, by primitive and dtype.

    Every figure counts an equation once per execution (a `scan` body `length`
    times; see the module docstring).

    Attributes:
      rows: `(primitive, dtype, count, flops)` tuples, most FLOPs first. For a
        matmul or conv the FLOPs are its multiply-adds times 2; for any other
        operation, the size of its largest operand or result.
      half_matmul_flop_share: the share of matmul/conv FLOPs in float16/bfloat16.
      fp8_matmul_flop_share: the share of matmul/conv FLOPs with float8 operands
        (`mixed_float8`; a float8 matmul's backward pass counts too).
      fp8_left_out: when the program has float8 matmuls, `(dtype, reason,
        where)` for every `dot_general` that does not run in float8: sizes
        float8 GEMMs do not take (`jmp_policy.fp8.fp8_eligible`), or the dtype
        it was left in (a float32 region, an override).
      misaligned: `(primitive, dtype, (K,), (M, N), where)` for every dot (or
        `(in channels,), (out channels,)` for every conv) with a size that is
        not a multiple of 8: tensor cores want multiples of 8.
      casts: the number of dtype conversions in the program.
      casts_inserted: conversions added relative to the original program
        (None when no original was given).
      float32_matmuls: `(primitive, where, why, intended)` for every matmul or
        conv that runs in float32: `intended` is True inside a float32 island
        an override asked for or a `full_precision` region, False otherwise,
        with `why` saying what put it in float32.
    """

    rows: tuple
    half_matmul_flop_share: float
    misaligned: tuple
    casts: int
    casts_inserted: int | None
    fp8_matmul_flop_share: float = 0.0
    fp8_left_out: tuple = ()
    float32_matmuls: tuple = ()

    @property
    def counts(self) -> dict[str, dict[str, int]]:
        """`{primitive: {dtype: count}}`, from `rows`."""
        counts: dict[str, dict[str, int]] = collections.defaultdict(dict)
        for primitive, dtype, count, _ in sorted(self.rows):
            counts[primitive][dtype] = count
        return dict(sorted(counts.items()))

    def total(self, dtype: str, primitives: Iterable[str] | None = None) -> int:
        """How many operations (of `primitives`, default all) compute in `dtype`."""
        wanted = None if primitives is None else frozenset(primitives)
        return sum(c for p, d, c, _ in self.rows if d == dtype and (wanted is None or p in wanted))

    def __str__(self) -> str:
        half = sum(self.total(d) for d in HALF)
        lines = [
            f"matmul/conv FLOPs in half precision: {100 * self.half_matmul_flop_share:.1f}%",
            *(
                [f"matmul/conv FLOPs in float8: {100 * self.fp8_matmul_flop_share:.1f}%"]
                if self.fp8_matmul_flop_share
                else []
            ),
            f"ops in half precision: {half}, in float32: {self.total('float32')}",
            f"casts: {self.casts}"
            + ("" if self.casts_inserted is None else f" ({self.casts_inserted} inserted)"),
            "",
            f"{'primitive':<24}{'dtype':<15}{'count':>7}{'FLOPs':>14}",
        ]
        lines += [f"{p:<24}{d:<15}{c:>7}{f:>14,}" for p, d, c, f in self.rows]
        if self.misaligned:
            lines += ["", "matmuls/convs with sizes that are not multiples of 8:"]
            lines += [
                f"  {p} {d} K={c} M,N={o} at {w or '(top level)'}"
                for p, d, c, o, w in self.misaligned
            ]
        if self.float32_matmuls and self.half_matmul_flop_share:
            intended = [m for m in self.float32_matmuls if m[3]]
            others = [m for m in self.float32_matmuls if not m[3]]
            lines += [
                "",
                f"matmuls/convs in float32: {len(intended)} by override or float32 region, "
                f"{len(others)} not",
            ]
            lines += [f"  {p} at {w or '(top level)'}: {why}" for p, w, why, _ in others[:10]]
            if len(others) > 10:
                lines.append(f"  ... and {len(others) - 10} more")
        if self.fp8_left_out:
            lines += ["", "matmuls left out of float8:"]
            lines += [f"  {d} at {w or '(top level)'}: {r}" for d, r, w in self.fp8_left_out]
        return "\n".join(lines)


def _convert_count(jaxpr: Jaxpr | ClosedJaxpr) -> int:
    return sum(t for e, t in _jaxpr.walk(jaxpr) if e.primitive is _jaxpr.CONVERT)


def _block_format(eqn: JaxprEqn, stack: str | None = None) -> str | None:
    """The format ("mxfp8", "nvfp4") of a block-scaled GEMM: JAX's, or the emulation's
    matmul (`jmp_policy.block_scaled`); else None. `stack`: the equation's whole name stack,
    where it is not the equation's own."""
    if eqn.primitive is _jaxpr.BLOCK_SCALED_MATMUL:
        return _BLOCK_VALUES.get(jnp.dtype(_aval(eqn.invars[0]).dtype).name, "block_scaled")
    stack = str(eqn.source_info.name_stack) if stack is None else stack
    if eqn.primitive is not _jaxpr.DOT_GENERAL or SCOPE not in stack:
        return None
    # The scope's name, also inside a transform's wrapping: `jvp(block_scaled_mxfp8)`.
    return re.split(r"\W", stack[stack.index(SCOPE) + len(SCOPE) :], maxsplit=1)[0]


def report_of_jaxpr(
    jaxpr: Jaxpr | ClosedJaxpr, original: Jaxpr | ClosedJaxpr | None = None
) -> PrecisionReport:
    """`precision_report` of an already traced (closed) jaxpr.

    `original`, a jaxpr too, is the program before casts, to count the casts that
    were inserted.
    """
    totals: dict = collections.defaultdict(lambda: [0, 0])
    misaligned, half_flops, fp8_flops, all_flops, not_fp8 = [], 0, 0, 0, []
    for eqn, times in _jaxpr.walk(jaxpr):
        if _jaxpr.sub_programs(eqn) or eqn.primitive is _jaxpr.CHECKPOINT_NAME:
            continue  # a container (jit, scan, ...): its body is counted instead; a name
        dtype = compute_dtype(eqn)
        if dtype is None:
            continue
        name, dtype_name = eqn.primitive.name, jnp.dtype(dtype).name
        block = _block_format(eqn)
        if block is not None:  # a block-scaled GEMM (or its emulation): a dot in its format
            name, dtype_name = _jaxpr.DOT_GENERAL.name, block
        if name in MATMULS:
            flops, contract, outputs = _matmul_shape_info(eqn)
            all_flops += flops * times
            if dtype_name in HALF:
                half_flops += flops * times
            if dtype.itemsize == 1 or block is not None:  # float8 (or 4-bit) operands
                fp8_flops += flops * times
            elif eqn.primitive is _jaxpr.DOT_GENERAL:
                not_fp8.append(eqn)
            if any(s % 8 for s in (*contract, *outputs)):
                where = module_path_of(str(eqn.source_info.name_stack))
                misaligned.append((name, dtype_name, tuple(contract), tuple(outputs), where))
        else:
            flops = max(
                (
                    _prod(_aval(v).shape)
                    for v in (*eqn.invars, *eqn.outvars)
                    if hasattr(_aval(v), "shape")
                ),
                default=0,
            )
        totals[(name, dtype_name)][0] += times
        totals[(name, dtype_name)][1] += flops * times
    rows = sorted(((p, d, c, f) for (p, d), (c, f) in totals.items()), key=lambda r: (-r[3], r[0]))
    left_out = tuple(_why_not_fp8(eqn) for eqn in not_fp8) if fp8_flops else ()
    casts = _convert_count(jaxpr)
    return PrecisionReport(
        rows=tuple(rows),
        half_matmul_flop_share=half_flops / all_flops if all_flops else 0.0,
        misaligned=tuple(misaligned),
        casts=casts,
        casts_inserted=None if original is None else casts - _convert_count(original),
        fp8_matmul_flop_share=fp8_flops / all_flops if all_flops else 0.0,
        fp8_left_out=left_out,
        float32_matmuls=tuple(float32_matmuls(jaxpr)),
    )


_REGION = FULL_PRECISION_REGION
_HALF_DTYPES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def float32_matmuls(
    jaxpr: Jaxpr | ClosedJaxpr, where: str = "", in_region: bool = False
) -> Iterator[tuple[str, str, str, bool]]:
    """`(primitive, module path, why, intended)` for each matmul/conv computing in float32.

    `intended`: inside a float32 island of an override (`FLOAT32_ISLAND` in the
    name stack) or a `full_precision` region. `why` looks at the operands: one
    cast up from half precision in the program itself, or one that is float32
    from the start.
    """
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    producers = _jaxpr.producers(jaxpr)
    inputs = set(jaxpr.invars)
    for eqn in jaxpr.eqns:
        stack = "/".join(p for p in (where, str(eqn.source_info.name_stack)) if p)
        region = in_region or eqn.params.get("name") == _REGION
        for sub in _jaxpr.sub_programs(eqn):
            yield from float32_matmuls(sub, stack, region)
        if not _jaxpr.is_matmul(eqn) or compute_dtype(eqn) != np.float32:
            continue
        if _block_format(eqn, stack) is not None:  # its format's GEMM (emulated in float32)
            continue
        intended = region or FLOAT32_ISLAND in stack.split("/")
        if region:
            why = "inside a full_precision region"
        elif intended:
            why = "a float32 island (override)"
        else:
            why = _why_float32(eqn, producers, inputs)
        yield eqn.primitive.name, module_path_of(stack), why, intended


def _why_float32(eqn: JaxprEqn, producers: dict, inputs: set) -> str:
    for var in eqn.invars[:2]:
        made = producers.get(var)
        if made is not None and made.primitive is _jaxpr.CONVERT:
            source = getattr(_aval(made.invars[0]), "dtype", None)
            if CPU_WIDENED in str(made.source_info.name_stack).split("/"):
                return (
                    "XLA:CPU has no bfloat16 x bfloat16 -> float32 matmul, so on this CPU "
                    "`jmp_policy.matmul` widens its bfloat16 operands (exactly); on a GPU or "
                    "TPU it runs in bfloat16 with a float32 result"
                )
            if source in _HALF_DTYPES:
                return (
                    f"an operand is cast from {jnp.dtype(source).name} to float32 in the "
                    "model's own code (e.g. `.astype(jnp.float32)` or `dtype=jnp.float32`)"
                )
    if any(var in inputs for var in eqn.invars[:2]):
        return (
            "an operand arrives in float32 and is not cast (an input or variable outside "
            "the policy's reach, or a layer that does not take a `dtype`)"
        )
    return (
        "an operand is computed in float32 before it (an array created with a float32 "
        "dtype, or the result of a float32 operation)"
    )


def module_path_of(name_stack: str) -> str:
    """A name stack as a module path (`_naming.module_path`, the override marker and region
    names left out; "" for none)."""
    path = _naming.module_path(name_stack, (FLOAT32_ISLAND, FULL_PRECISION_REGION))
    return "" if path == _naming.TOP_LEVEL else path


_WARNED: set[str] = set()


def warn_float32_matmuls(jaxpr: Jaxpr | ClosedJaxpr, integration: str, stacklevel: int = 3) -> None:
    """Warns (once per message) about matmuls/convs left in float32 outside islands."""
    slipped = [m for m in float32_matmuls(jaxpr) if not m[3]]
    if not slipped:
        return
    by_path: dict[str, list[str]] = collections.defaultdict(list)
    for primitive, where, why, _ in slipped:
        by_path[f"{where or '(top level)'}: {why}"].append(primitive)
    shown = [f"  {k} ({len(v)} {v[0]})" for k, v in list(by_path.items())[:8]]
    if len(by_path) > 8:
        shown.append(f"  ... and {len(by_path) - 8} more places")
    message = (
        f"{integration}: {len(slipped)} matmuls/convs still run in float32 outside overrides "
        "and float32 islands, so they get no half-precision speed or memory:\n"
        + "\n".join(shown)
        + "\nCast inside the model where it casts to float32, or name these modules in "
        "`overrides` with a float32 policy if float32 is intended; "
        "`jmp_policy.precision_report` lists them."
    )
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, PrecisionWarning, stacklevel=stacklevel)


def _why_not_fp8(eqn: JaxprEqn) -> tuple[str, str, str]:
    dtype = jnp.dtype(compute_dtype(eqn) or np.float32).name
    lhs, rhs = _aval(eqn.invars[0]).shape, _aval(eqn.invars[1]).shape
    where = module_path_of(str(eqn.source_info.name_stack))
    reason = fp8_eligible(lhs, rhs, eqn.params["dimension_numbers"])
    pattern = fp8_excluded_by(where)
    if reason is None and pattern is not None and dtype == "bfloat16":
        reason = f"module name matches {pattern!r} (jmp_policy.fp8.FP8_EXCLUDE, the default)"
    return dtype, reason or _why_left(str(eqn.source_info.name_stack), dtype), where


def _why_left(name_stack: str, dtype: str) -> str:
    """Why an eligible matmul, not excluded by name, is not in float8: its cause."""
    if FULL_PRECISION_REGION in name_stack:
        return "inside a `full_precision` region"
    if FLOAT32_ISLAND in name_stack:
        return "its module is kept in float32 by an override"
    if dtype == "float32":
        return "its operands are float32 (the model's own cast, or a layer's dtype)"
    return (
        "not a Dense/Linear layer's own matmul: linen/nnx.mixed_precision give float8 to "
        "Dense, DenseGeneral, Linear and LinearGeneral layers only (attention's scores and "
        f"weighted sum, an einsum, a layer's `x @ w` stay in {dtype})"
    )


def precision_report(
    fun: Callable[..., Any], *args: Any, original: Callable[..., Any] | None = None, **kwargs: Any
) -> PrecisionReport:
    """Reports where `fun(*args, **kwargs)` does its work, by primitive and dtype.

    Args:
      fun: the function to trace (nothing runs), e.g. `autocast(loss, policy)`. Where it
        calls NNX or Equinox modules, the report names them by their paths (`MLP/layers/0`),
        as the precision debugger does.
      *args: example arguments (arrays or `jax.ShapeDtypeStruct`); other leaves
        (functions, flags) are passed through as they are.
      original: the function before casts (e.g. the un-autocast loss), to count
        the casts that were inserted.
      **kwargs: example keyword arguments.

    Returns:
      A `PrecisionReport`; `print(report)` shows it as a table, `report.counts`
      as `{primitive: {dtype: count}}`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jmp_policy as jmp
      >>> f = lambda w, x: jnp.tanh(x @ w).sum()
      >>> w, x = jnp.ones((6, 16)), jnp.ones((4, 6))
      >>> report = jmp.precision_report(jmp.autocast(f), w, x, original=f)
      >>> report.half_matmul_flop_share, report.casts_inserted, len(report.misaligned)
      (1.0, 3, 1)
      >>> report.counts["dot_general"], report.total("float16")
      ({'float16': 1}, 3)
    """
    for name, given in (("fun", fun), ("original", original)):
        if not (callable(given) or (name == "original" and given is None)):
            raise TypeError(
                f"Expected a function (the model's forward pass or a train step) for `{name}`, "
                f"got {given!r}: `precision_report(fun, *example_args)`."
            )
    # NNX and Equinox modules are named by their paths, as the precision debugger names them.
    with _naming.module_names():
        program = trace(fun, *args, **kwargs)
        before = None if original is None else trace(original, *args, **kwargs)
    return report_of_jaxpr(program, before)
