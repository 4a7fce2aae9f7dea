"""What moved between the JAX and Flax releases this library supports, and nothing else.

The supported window is about a year of releases: jax >= 0.8.3, flax >= 0.12.2, optax >= 0.2.6
(pyproject.toml; CI runs the core tests on the oldest of them). Each function papers over one
API that older releases lack; nothing else in the library tests versions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
from jax.core import Tracer
from jax.extend import core as _core


def _jaxprs_in(params: dict[str, Any]) -> Iterator[Any]:
    # jax < 0.9: no `jax.extend.core.jaxprs_in_params`. Sub-programs sit in an equation's
    # params as a (closed) jaxpr, or in a tuple or list of them (cond's branches).
    kinds = (_core.Jaxpr, _core.ClosedJaxpr)
    for value in params.values():
        values = value if isinstance(value, (tuple, list)) else (value,)
        for v in values:
            if isinstance(v, kinds):
                yield v


# The (closed) jaxprs in an equation's params: JAX's own function where it has it.
jaxprs_in_params = getattr(_core, "jaxprs_in_params", _jaxprs_in)


def variable_value(variable: Any) -> Any:
    """An `nnx.Variable`'s value (`get_value()` where Flax has it, `.value` before)."""
    get = getattr(variable, "get_value", None)
    return get() if get is not None else variable.value


def set_variable_value(variable: Any, value: Any) -> None:
    """Sets an `nnx.Variable`'s value (`set_value()` where Flax has it, `.value =` before)."""
    setter = getattr(variable, "set_value", None)
    if setter is not None:
        setter(value)
    else:
        variable.value = value


def pure(tree: Any) -> Any:
    """A tree with every `nnx.Variable` replaced by its value (`nnx.as_pure` where Flax has it)."""
    from flax import nnx  # only for NNX users: Flax loads with `jmp_policy.nnx`

    as_pure = getattr(nnx, "as_pure", None)
    if as_pure is not None:
        return as_pure(tree)
    is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    return jax.tree.map(
        lambda x: variable_value(x) if is_variable(x) else x, tree, is_leaf=is_variable
    )


def bind_params(primitive: Any, params: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """`(subfuns, params)` to bind `primitive` with, as `jax.core.eval_jaxpr` does.

    jax < 0.9's `get_bind_params` returns both; later releases return the params alone.
    """
    out = primitive.get_bind_params(params)
    if isinstance(out, tuple):
        subfuns, params = out
        return list(subfuns), params
    return [], out


def _drop_var_type() -> type:
    drop_var = getattr(_core, "DropVar", None)
    if drop_var is None:  # jax < 0.9: not in jax.extend.core yet
        from jax._src import core as _src_core

        drop_var = _src_core.DropVar
    return drop_var


DropVar = _drop_var_type()
"""The type of a jaxpr's unused outputs (`_`): `jax.extend.core.DropVar`."""


# Private: JAX has no public API for the trace a value is being staged into. The misuse check
# of `loss_scaling` (`_misuse`) reads it; tests/test_compat.py fails on a release that moves it.
try:
    from jax._src.interpreters.partial_eval import DynamicJaxprTracer as _StagedTracer
except ImportError:  # pragma: no cover (a release that moved it: the misuse check sees nothing)
    _StagedTracer = None


def is_staged(x: Any) -> bool:
    """Whether `x` is being staged into a program (`jit`, `make_jaxpr`, a `scan` body), under
    any `grad` or `vmap` on top; False for a concrete value and an eager transform's tracer
    (`jax.grad` or `jax.vmap` called outside `jit`)."""
    if _StagedTracer is None:  # pragma: no cover (a release that moved it: staged if traced)
        return isinstance(x, Tracer)
    while not isinstance(x, _StagedTracer):
        inner = getattr(x, "primal", getattr(x, "val", None))  # JVP/linearize, vmap tracers
        if inner is None or inner is x or not isinstance(x, Tracer):
            return False
        x = inner
    return True


@dataclasses.dataclass(frozen=True)
class StagedTrace:
    """What a `jit` being traced has staged so far, read from the values given: `inputs`
    (each input variable's position), `eqns` (its equations so far), `vars` (for each tree
    given, the variables of its traced leaves) and `untraced` (each tree's other leaves)."""

    inputs: dict
    eqns: list
    vars: list
    untraced: list


def staged_trace(*trees: Any) -> StagedTrace | None:
    """The `StagedTrace` of the one jaxpr trace that the traced leaves of `trees` belong to;
    None when a tree has no such leaf, when they belong to several traces (a `cond` branch
    inside the step), or when this JAX does not expose what is read."""
    if _StagedTracer is None:
        return None
    leaves = [jax.tree.leaves(t) for t in trees]
    traced = [[x for x in ls if isinstance(x, _StagedTracer)] for ls in leaves]
    if not all(traced):
        return None
    trace = getattr(traced[0][0], "_trace", None)
    one = all(getattr(x, "_trace", None) is trace for t in traced for x in t)
    frame = getattr(trace, "frame", None)
    if not one or frame is None or not hasattr(frame, "get_eqns"):
        return None
    return StagedTrace(
        {v: i for i, v in enumerate(frame.invars)},
        list(frame.get_eqns()),
        [[getattr(x, "val", None) for x in t] for t in traced],
        [len(ls) - len(t) for ls, t in zip(leaves, traced, strict=True)],
    )


# Private, but what `jax.core.eval_jaxpr` uses to keep names: a rewritten program keeps each
# operation's traceback and module names (`_jaxpr.bind`); without it, names are lost.
try:
    from jax._src import source_info_util as source_info
except ImportError:  # pragma: no cover
    source_info = None


# --- undocumented APIs the library relies on, each tested in tests/test_compat.py -----------

# `jax.core.eval_jaxpr`: a program's equations bound in the caller's trace (names kept).
from jax.core import eval_jaxpr as eval_jaxpr  # noqa: E402
