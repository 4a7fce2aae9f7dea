"""autocast, `precision_report` and `debug_precision` from 8 threads at once (issue 71,
point 6): each call gets what it gets alone (the debugger's layer names included), and every
module class is left with its own `__call__`."""

from __future__ import annotations

import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_policy as jmp

eqx = pytest.importorskip("equinox")


class _EqxMLP(eqx.Module):
    layers: tuple

    def __init__(self, key):
        keys = jax.random.split(key, 3)
        self.layers = tuple(eqx.nn.Linear(8, 8, key=k) for k in keys)

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(jax.vmap(layer)(x))
        return jnp.sum(x**2)


class _NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.first = nnx.Linear(8, 8, rngs=rngs)
        self.second = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return jnp.sum(jnp.tanh(self.second(jnp.tanh(self.first(x)))) ** 2)


def _calls(model, x):
    """The three routes on one model: what each gives, in a form to compare."""
    if isinstance(model, nnx.Module):
        graphdef, state = nnx.split(model)

        def loss(state, x):
            return nnx.merge(graphdef, state)(x)

        args = (state, x)
    else:
        loss, args = (lambda m, x: m(x)), (model, x)
    debug = jmp.debug_precision(loss, *args)
    report = jmp.precision_report(jmp.autocast(loss), *args)
    out = jmp.autocast(loss)(*args)
    return (
        tuple((s.layer, s.direction, s.count, s.amax) for s in debug.layers),
        tuple(sorted((k, tuple(sorted(v.items()))) for k, v in report.counts.items())),
        np.asarray(out).tobytes(),
    )


def _own_calls() -> dict:
    classes, todo = {}, [eqx.Module, nnx.Module]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if "__call__" in vars(cls):
            classes[cls] = vars(cls)["__call__"]
    return classes


@pytest.mark.parametrize("kind", ["equinox", "nnx"])
def test_eight_threads_get_the_single_threaded_results_and_leave_every_class_as_it_was(kind):
    model = _EqxMLP(jax.random.key(0)) if kind == "equinox" else _NnxMLP(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (4, 8))
    before = _own_calls()
    alone = _calls(model, x)
    names = {layer for layer, *_ in alone[0]}
    assert len(names) >= 3, names  # the layers are named, so a lost name shows
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: _calls(model, x), range(16)))
    assert all(r == alone for r in results), [r == alone for r in results]
    after = _own_calls()
    assert after.keys() == before.keys()
    assert all(after[cls] is own for cls, own in before.items())


def test_the_nnx_policy_from_eight_threads_gets_the_single_threaded_results():
    """One `nnx.mixed_precision` model called, reported and debugged from 8 threads at once:
    each call runs on its own copy of the model's graph, so each gets what it gets alone, and
    the user's modules keep their classes. The jitted call is traced from the wrapper's state
    (`nnx.split` once, `nnx.merge` inside `jax.jit`), not by `nnx.jit(f)(wrapped, x)`: Flax's
    `nnx.jit` writes its module arguments back in place after each call, so concurrent
    `nnx.jit` calls on one module race inside Flax itself (with a bare `nnx.Linear` too: a
    thread finds it emptied, `AttributeError: 'Linear' object has no attribute 'kernel'`)."""
    model = _NnxMLP(nnx.Rngs(0))
    wrapped = jmp.nnx.mixed_precision(model, "mixed_float16")
    x = jax.random.normal(jax.random.key(1), (4, 8))
    graphdef, state = nnx.split(wrapped)
    before = _own_calls()

    def calls(_):
        debug = jmp.debug_precision(lambda m, x: m(x), wrapped, x)
        report = jmp.precision_report(wrapped, x)
        return (
            tuple((s.layer, s.direction, s.count, s.amax) for s in debug.layers),
            tuple(sorted((k, tuple(sorted(v.items()))) for k, v in report.counts.items())),
            np.asarray(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)).tobytes(),
        )

    alone = calls(None)
    assert {"_NnxMLP/first", "_NnxMLP/second"} <= {layer for layer, *_ in alone[0]}, alone[0]
    assert dict(alone[1])["dot_general"] == (("float16", 2),)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(calls, range(16)))
    assert all(r == alone for r in results), [r == alone for r in results]
    assert _own_calls() == before
    assert type(model) is _NnxMLP and type(model.first) is nnx.Linear


def test_naming_changes_no_class_and_no_other_threads_profile_and_puts_back_the_callers():
    """While a thread names module calls, every class keeps its own `__call__` (nothing
    process-wide is patched), another thread's profile function is its own, and the caller's
    profile function (a profiler's) is back afterwards, also after an exception."""
    import sys
    import threading

    from jmp_policy._core import naming as _naming

    model = _NnxMLP(nnx.Rngs(0))
    before, seen = _own_calls(), []

    def callers_profile(frame, event, arg):
        return None

    sys.setprofile(callers_profile)
    try:
        with pytest.raises(RuntimeError, match="inside"), _naming.module_names():
            assert _own_calls() == before
            assert sys.getprofile() is not callers_profile  # this thread's calls are seen
            thread = threading.Thread(target=lambda: seen.append(sys.getprofile()))
            thread.start()
            thread.join()
            jax.make_jaxpr(model)(jnp.ones((2, 8)))
            raise RuntimeError("inside")
        assert sys.getprofile() is callers_profile
    finally:
        sys.setprofile(None)
    assert seen == [None]
    assert not _naming.active()


def test_the_debugger_under_cprofile_names_layers_and_leaves_the_profiler_running():
    """A user profiling their script with cProfile asks the debugger: it names the NNX layers
    as without the profiler, and the profiler (on Python 3.10 and 3.11 the thread's profile
    function, an object `sys.setprofile` cannot take back) runs again afterwards and keeps
    what it measured before."""
    import cProfile
    import pstats
    import sys

    model = _NnxMLP(nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def loss(state, x):
        return nnx.merge(graphdef, state)(x)

    expected = [s.layer for s in jmp.debug_precision(loss, state, jnp.ones((2, 8))).layers]
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        _before_the_debugger()
        held = sys.getprofile()
        layers = [s.layer for s in jmp.debug_precision(loss, state, jnp.ones((2, 8))).layers]
        assert sys.getprofile() is held  # the profiler's own callback again (None on 3.12+)
        _after_the_debugger()
    finally:
        profiler.disable()
    assert layers == expected and "_NnxMLP/first" in layers
    functions = {name for _, _, name in pstats.Stats(profiler).stats}
    assert {"_before_the_debugger", "_after_the_debugger"} <= functions


def _before_the_debugger():
    return None


def _after_the_debugger():
    return None
