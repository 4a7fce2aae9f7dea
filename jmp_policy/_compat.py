"""What moved between the JAX and Flax releases this library supports, and nothing else.

The supported window is about a year of releases: jax >= 0.8.3, flax >= 0.12.2, optax >= 0.2.6
(pyproject.toml; CI runs the core tests on the oldest of them). Each function papers over one
API that older releases lack; nothing else in the library tests versions.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
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
