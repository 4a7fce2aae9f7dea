"""A census of the traced program: which operations run in which dtype.

`precision_census(fun, *args)` traces `fun` (nothing runs) and counts, per
primitive, the floating dtype each equation computes in, walking into nested
programs (`jit`, `scan`, `cond`, `custom_jvp`/`custom_vjp`, remat, ...).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import jaxprs_in_params

MATMULS = frozenset({"dot_general", "conv_general_dilated"})


def iter_equations(jaxpr: Any) -> Iterator[Any]:
    """Yields every equation of a (closed) jaxpr, nested programs included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from iter_equations(sub)


def compute_dtype(eqn: Any) -> Any:
    """The floating dtype an equation computes in: its widest floating operand.

    Falls back to its outputs for equations without floating operands; None
    when nothing floating is involved (integer, bool and key arithmetic).
    """
    for group in (eqn.invars, eqn.outvars):
        dtypes = [
            v.aval.dtype
            for v in group
            if hasattr(v, "aval")
            and hasattr(v.aval, "dtype")
            and jnp.issubdtype(v.aval.dtype, jnp.floating)
        ]
        if dtypes:
            return max(dtypes, key=lambda d: jnp.finfo(d).bits)
    return None


@dataclasses.dataclass(frozen=True)
class Census:
    """Counts of equations by primitive and compute dtype.

    Attributes:
      counts: `{primitive name: {dtype name: count}}` over floating equations.
    """

    counts: dict[str, dict[str, int]]

    def total(self, dtype: str, primitives=None) -> int:
        """How many equations (of `primitives`, default all) compute in `dtype`."""
        return sum(
            by_dtype.get(dtype, 0)
            for name, by_dtype in self.counts.items()
            if primitives is None or name in primitives
        )

    def __str__(self) -> str:
        half = sum(self.total(d) for d in ("float16", "bfloat16"))
        lines = [f"ops in half precision: {half}, in float32: {self.total('float32')}"]
        for name in sorted(self.counts):
            by_dtype = ", ".join(f"{d} {n}" for d, n in sorted(self.counts[name].items()))
            lines.append(f"  {name}: {by_dtype}")
        return "\n".join(lines)


def census_of_jaxpr(jaxpr: Any) -> Census:
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for eqn in iter_equations(jaxpr):
        if list(jaxprs_in_params(eqn.params)):
            continue  # a container (pjit, scan, ...): its body is counted instead
        dtype = compute_dtype(eqn)
        if dtype is not None:
            counts[eqn.primitive.name][jnp.dtype(dtype).name] += 1
    return Census({name: dict(sorted(c.items())) for name, c in sorted(counts.items())})


def precision_census(fun: Any, *args: Any, **kwargs: Any) -> Census:
    """Traces `fun(*args, **kwargs)` and counts its operations by compute dtype.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jmp_policy as jmp
      >>> x = jnp.ones((2, 2), jnp.float16)
      >>> census = jmp.precision_census(lambda x: jnp.exp(x @ x.T).sum(), x)
      >>> census.counts["dot_general"], census.total("float16")
      ({'float16': 1}, 4)
    """
    return census_of_jaxpr(jax.make_jaxpr(fun)(*args, **kwargs))


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out


def _matmul_shape_info(eqn: Any) -> tuple[int, list[int], list[int]]:
    """FLOPs, and the GEMM sizes that tensor cores want as multiples of 8.

    For a dot: K (the contracting size) and M, N (the output sizes, batch
    dimensions aside). For a conv: its input and output channels.
    """
    out_shape = eqn.outvars[0].aval.shape
    lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    if eqn.primitive.name == "conv_general_dilated":
        rhs_spec = eqn.params["dimension_numbers"].rhs_spec
        in_features, out_features = rhs[rhs_spec[1]], rhs[rhs_spec[0]]
        window = _prod(rhs[d] for d in rhs_spec[2:])
        return 2 * _prod(out_shape) * in_features * window, [in_features], [out_features]
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
    k = _prod(lhs[d] for d in lhs_contract)
    m = _prod(lhs[d] for d in range(len(lhs)) if d not in (*lhs_contract, *lhs_batch))
    n = _prod(rhs[d] for d in range(len(rhs)) if d not in (*rhs_contract, *rhs_batch))
    return 2 * _prod(out_shape) * k, [k], [m, n]


def _weighted_equations(jaxpr: Any, times: int = 1) -> Iterator[tuple[Any, int]]:
    """Like `iter_equations`, with how often each runs (scan bodies: `length` times)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn, times
        inner = times * eqn.params["length"] if eqn.primitive.name == "scan" else times
        for sub in jaxprs_in_params(eqn.params):
            yield from _weighted_equations(sub, inner)


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """Where a program's work runs, by primitive and dtype.

    Attributes:
      rows: `(primitive, dtype, count, flops)` tuples, most FLOPs first.
      half_matmul_flop_share: the share of matmul/conv FLOPs in float16/bfloat16.
      misaligned: `(primitive, dtype, (K,), (M, N), where)` for every dot (or
        `(in channels,), (out channels,)` for every conv) with a size that is
        not a multiple of 8: tensor cores want multiples of 8.
      casts: the number of dtype conversions in the program.
      casts_inserted: conversions added relative to the original program
        (None when no original was given).
    """

    rows: tuple
    half_matmul_flop_share: float
    misaligned: tuple
    casts: int
    casts_inserted: int | None

    def __str__(self) -> str:
        lines = [
            f"matmul/conv FLOPs in half precision: {100 * self.half_matmul_flop_share:.1f}%",
            f"casts: {self.casts}"
            + ("" if self.casts_inserted is None else f" ({self.casts_inserted} inserted)"),
            "",
            f"{'primitive':<24}{'dtype':<10}{'count':>7}{'FLOPs':>14}",
        ]
        lines += [f"{p:<24}{d:<10}{c:>7}{f:>14,}" for p, d, c, f in self.rows]
        if self.misaligned:
            lines += ["", "matmuls/convs with sizes that are not multiples of 8:"]
            lines += [
                f"  {p} {d} K={c} M,N={o} at {w or '(top level)'}"
                for p, d, c, o, w in self.misaligned
            ]
        return "\n".join(lines)


def _convert_count(jaxpr: Any) -> int:
    return sum(
        t for e, t in _weighted_equations(jaxpr) if e.primitive.name == "convert_element_type"
    )


def precision_report(fun: Any, *args: Any, original: Any = None, **kwargs: Any) -> PrecisionReport:
    """Reports where `fun(*args, **kwargs)` does its work, by primitive and dtype.

    Args:
      fun: the function to trace (nothing runs), e.g. `autocast(loss, policy)`.
      *args: example arguments (arrays or `jax.ShapeDtypeStruct`).
      original: the function before casts (e.g. the un-autocast loss), to count
        the casts that were inserted.
      **kwargs: example keyword arguments.

    Returns:
      A `PrecisionReport`; `print(report)` shows it as a table.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jmp_policy as jmp
      >>> f = lambda w, x: jnp.tanh(x @ w).sum()
      >>> w, x = jnp.ones((6, 16)), jnp.ones((4, 6))
      >>> report = jmp.precision_report(jmp.autocast(f), w, x, original=f)
      >>> report.half_matmul_flop_share, report.casts_inserted, len(report.misaligned)
      (1.0, 3, 1)
    """
    jaxpr = jax.make_jaxpr(fun)(*args, **kwargs)
    totals: dict = collections.defaultdict(lambda: [0, 0])
    misaligned, half_flops, all_flops = [], 0, 0
    for eqn, times in _weighted_equations(jaxpr):
        if list(jaxprs_in_params(eqn.params)):
            continue
        dtype = compute_dtype(eqn)
        if dtype is None:
            continue
        name, dtype_name = eqn.primitive.name, jnp.dtype(dtype).name
        if name in MATMULS:
            flops, contract, outputs = _matmul_shape_info(eqn)
            all_flops += flops * times
            if dtype_name in ("float16", "bfloat16"):
                half_flops += flops * times
            if any(s % 8 for s in (*contract, *outputs)):
                where = str(eqn.source_info.name_stack)
                misaligned.append((name, dtype_name, tuple(contract), tuple(outputs), where))
        else:
            flops = max(
                (
                    _prod(v.aval.shape)
                    for v in (*eqn.invars, *eqn.outvars)
                    if hasattr(v.aval, "shape")
                ),
                default=0,
            )
        totals[(name, dtype_name)][0] += times
        totals[(name, dtype_name)][1] += flops * times
    rows = sorted(((p, d, c, f) for (p, d), (c, f) in totals.items()), key=lambda r: (-r[3], r[0]))
    casts = _convert_count(jaxpr)
    inserted = None
    if original is not None:
        inserted = casts - _convert_count(jax.make_jaxpr(original)(*args, **kwargs))
    return PrecisionReport(
        rows=tuple(rows),
        half_matmul_flop_share=half_flops / all_flops if all_flops else 0.0,
        misaligned=tuple(misaligned),
        casts=casts,
        casts_inserted=inserted,
    )
