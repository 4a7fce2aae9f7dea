"""What `jmp_policy._core.compat` reads of JAX's private API: each test fails on a release that
moves it (CI runs this file on the oldest supported stack too)."""

import jax
import jax.numpy as jnp

from jmp_policy._core.compat import (
    eval_jaxpr,
    source_info,
    staged_trace,
)


def test_the_trace_a_jit_is_staging_is_readable():
    seen = {}

    @jax.jit
    def step(params, grads, scale):
        made = jax.tree.map(lambda p: p * 2.0, params)  # computed in the step
        seen["arrived"] = staged_trace(grads, params, scale)
        seen["made"] = staged_trace(made, params, scale)
        return made

    step({"w": jnp.ones(2)}, {"w": jnp.ones(2)}, jnp.float32(4.0))
    arrived, made = seen["arrived"], seen["made"]
    assert arrived is not None and made is not None
    # Gradients passed in are inputs of the trace (position 1: after the parameters' leaf).
    assert [arrived.inputs.get(v) for v in arrived.vars[0]] == [1]
    assert arrived.untraced == [0, 0, 0]
    # A value computed in it is the output of one of its equations.
    assert made.vars[0][0] not in made.inputs
    assert any(made.vars[0][0] in eqn.outvars for eqn in made.eqns)
    # Outside a trace, and with a tree of no traced value, there is nothing to read.
    assert staged_trace({"w": jnp.ones(2)}, jnp.ones(1)) is None


def test_the_name_stack_and_source_context_are_readable():
    # `_jaxpr.bind` keeps a rewritten operation's module names with these.
    assert source_info is not None
    with jax.named_scope("outer"):
        assert "outer" in str(source_info.current_name_stack())
    assert callable(source_info.user_context)


def test_eval_jaxpr_binds_a_program_in_the_callers_trace():
    program = jax.make_jaxpr(lambda x: jnp.sin(x) * 2.0)(1.0)
    (out,) = eval_jaxpr(program.jaxpr, program.consts, jnp.float32(0.5))
    assert float(out) == float(jnp.sin(jnp.float32(0.5)) * 2.0)
    # Inside another trace it binds the same equations there.
    traced = jax.make_jaxpr(lambda x: eval_jaxpr(program.jaxpr, program.consts, x))(1.0)
    assert [e.primitive.name for e in traced.eqns] == ["sin", "mul"]


def test_is_staged_sees_a_program_under_grad_and_vmap_and_not_an_eager_transform():
    from jmp_policy._core.compat import is_staged

    seen = {}

    def f(name):
        def inner(x):
            seen[name] = is_staged(x)
            return x * 2.0

        return inner

    x, xs = jnp.float32(1.0), jnp.ones(2)
    jax.grad(f("eager grad"))(x)
    jax.vmap(f("eager vmap"))(xs)
    jax.jit(f("jit"))(x)
    jax.jit(jax.grad(f("grad in jit")))(x)
    jax.jit(jax.vmap(jax.grad(f("grad in vmap in jit"))))(xs)
    jax.lax.scan(lambda c, v: (f("scan body")(c), None), x, None, length=2)
    assert seen == {
        "eager grad": False,
        "eager vmap": False,
        "jit": True,
        "grad in jit": True,
        "grad in vmap in jit": True,
        "scan body": True,
    }
    assert not is_staged(x)
