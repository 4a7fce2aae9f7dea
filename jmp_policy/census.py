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
    return Census({name: dict(c) for name, c in counts.items()})


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
