"""Tracing a function for a report or an integration's check: `trace` (non-array leaves
passed as they are, NNX modules as pure functions of their states) and `traced_once` (the
program, and the call evaluated from it rather than run a second time)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr

from jmp_policy._core.compat import eval_jaxpr
from jmp_policy._core.pytree import pure_nnx, split_traced


def _pure(fun: Any, args: tuple) -> tuple[Callable[..., Any], tuple]:
    """`fun(*args)` with NNX modules (`fun` itself, or among `args`) called as pure functions
    of their states (`_pytree.pure_nnx`), whatever variables they write when called. The
    state of an NNX `fun` becomes the first argument; any other `fun` stays as it is."""
    with_fun, merge = pure_nnx((fun, *args))
    if with_fun[0] is fun:  # not an NNX module: called as it is

        def pure(*inner: Any, **kwargs: Any) -> Any:
            return fun(*merge((fun, *inner))[1:], **kwargs)

        return pure, with_fun[1:]

    def pure_module(*inner: Any, **kwargs: Any) -> Any:
        module, *rest = merge(inner)
        return module(*rest, **kwargs)

    return pure_module, with_fun


def trace(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> ClosedJaxpr:
    """`jax.make_jaxpr(fun)(*args, **kwargs)`, with non-array leaves (an Equinox
    module's functions, flags) passed to `fun` as they are rather than traced. An NNX module
    is traced as a pure function of its state, whatever variables it writes."""
    fun, args = _pure(fun, args)
    arrays, rebuild = split_traced((args, kwargs))

    def run(*traced):
        a, k = rebuild(traced)
        return fun(*a, **k)

    return jax.make_jaxpr(run)(*arrays)


def traced_once(
    fun: Callable[..., Any], *args: Any, **kwargs: Any
) -> tuple[ClosedJaxpr, Callable[[], Any]]:
    """The program `fun(*args, **kwargs)` traces (as `trace`), and a function that returns
    its result from the program, evaluated on the arguments in the caller's trace (as
    `jax.core.eval_jaxpr` does: the same equations, names kept), not from a second run."""
    fun, args = _pure(fun, args)
    arrays, rebuild = split_traced((args, kwargs))

    def run(*traced):
        a, k = rebuild(traced)
        return fun(*a, **k)

    program, shape = jax.make_jaxpr(run, return_shape=True)(*arrays)

    def result() -> Any:
        out = eval_jaxpr(program.jaxpr, program.consts, *arrays)
        return jax.tree.unflatten(jax.tree.structure(shape), out)

    return program, result
