"""The precision debugger inside loops and branches: `scan`, `while`, `cond`, remat, `custom_vjp`.

Models with a matmul inside `lax.scan` used to crash the debugger (a scan's carry cast to float16
while its body returned float32) and, under a policy, hid every layer inside a scan body. Each
model is written as its library's users write it: Equinox's GRU cell under `lax.scan`, Linen's
`nn.scan` over blocks, NNX's `nnx.scan` over `nnx.vmap`-stacked layers.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_policy as jmp

eqx = pytest.importorskip("equinox")


def _named(report, direction):
    return {s.layer for s in report.layers if s.direction == direction}


def test_a_float32_matmul_inside_scan_is_judged_not_cast():
    def loss(w, xs):
        def body(h, x):
            h = jnp.tanh(w @ h + x)
            return h, h

        _, ys = jax.lax.scan(body, jnp.zeros(4), xs)
        return jnp.sum(ys**2)

    w = jax.random.normal(jax.random.key(0), (4, 4)) * 0.5
    xs = jax.random.normal(jax.random.key(1), (5, 4))
    report = jmp.debug_precision(loss, w, xs)
    assert report.matmul_layers == ("(top level)",)
    # Every step of the loop is read: one more step adds its values to the counts.
    assert np.isclose(report.loss, float(loss(w, xs)), rtol=1e-6)
    half = jmp.debug_precision(jmp.autocast(loss, "mixed_float16"), w, xs)
    assert half.judged == "target" and half.matmul_layers == ("(top level)",)
    assert {s.direction for s in half.target_layers} == {"forward", "backward"}


def test_an_overflow_in_the_last_step_of_a_scan_is_found():
    def loss(w, xs):
        def body(h, x):
            with jax.named_scope("cell"):
                h = jnp.exp(w * x) + h
            return h, None

        h, _ = jax.lax.scan(body, jnp.zeros(3), xs)
        return jnp.sum(h)

    xs = jnp.ones((4, 3)).at[3].set(20.0)  # exp(20) = 4.9e8 overflows float16, in step 4 only
    report = jmp.debug_precision(loss, jnp.ones(3), xs)
    cell = {s.direction: s for s in report.layers if s.layer == "cell"}
    assert cell["forward"].overflow > 0 and cell["forward"].amax > 4e8
    assert report.advice()["overrides"].get("cell") == "float32"


class RNN(eqx.Module):  # as Equinox's RNN example writes it: a GRU cell under lax.scan
    cell: eqx.nn.GRUCell
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.cell = eqx.nn.GRUCell(3, 8, key=k1)
        self.head = eqx.nn.Linear(8, 1, key=k2)

    def __call__(self, xs):
        def step(h, x):
            return self.cell(x, h), None

        h, _ = jax.lax.scan(step, jnp.zeros(8), xs)
        return self.head(h)


@pytest.mark.parametrize("policy", [None, "mixed_float16"])
def test_equinox_gru_under_scan_is_named_both_ways(policy):
    model = RNN(jax.random.key(0))
    if policy:
        model = jmp.eqx.mixed_precision(model, policy)
    xs = jax.random.normal(jax.random.key(1), (4, 5, 3))
    report = jmp.debug_precision(lambda m, xs: jnp.mean(jax.vmap(m)(xs) ** 2), model, xs)
    assert {"RNN/cell", "RNN/head"} <= set(report.matmul_layers)
    assert {"RNN/cell", "RNN/head"} <= _named(report, "forward") & _named(report, "backward")
    assert report.judged == ("target" if policy else "all")


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + nn.Dense(8)(nn.LayerNorm()(x)), None


class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8)(x)
        blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        x, _ = blocks()(x, None)
        return nn.Dense(1)(x)


@pytest.mark.parametrize("policy", [None, "mixed_float16"])
def test_linen_nn_scan_layers_are_named(policy):
    model = Stack() if policy is None else jmp.linen.mixed_precision(Stack(), policy)
    x = jnp.ones((2, 4))
    params = model.init(jax.random.key(0), x)["params"]
    report = jmp.debug_precision(lambda p: jnp.mean(model.apply({"params": p}, x) ** 2), params)
    inside = "Stack/ScanBlock_0/Dense_0"
    assert inside in report.matmul_layers
    assert inside in _named(report, "forward") & _named(report, "backward")
    # Under the policy, the norm inside the scan is kept in float32 and not judged.
    if policy:
        assert "Stack/ScanBlock_0/LayerNorm_0" in report.float32_layers


class Layer(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return x + nnx.tanh(self.lin(x))


class Scanned(nnx.Module):
    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Layer(rngs)

        self.layers = make(rngs)
        self.head = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, layer):
            return layer(x)

        return self.head(run(x, self.layers))


@pytest.mark.parametrize("policy", [None, "mixed_float16"])
def test_nnx_scan_layers_are_named(policy):
    model = Scanned(nnx.Rngs(0))
    if policy:
        model = jmp.nnx.mixed_precision(model, jmp.get_policy(policy))
    report = jmp.debug_precision(lambda m: jnp.mean(m(jnp.ones((2, 8))) ** 2), model)
    # A layer rebuilt inside the scan is named by the attribute path it was rebuilt from, the
    # path `overrides` take, with or without a policy (it was `Scanned/Layer/lin` without).
    inside = "Scanned/layers/lin"
    assert inside in report.matmul_layers, report.matmul_layers
    assert inside in _named(report, "forward") & _named(report, "backward")


@jax.custom_vjp
def _clipped(x):
    return x


_clipped.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1.0, 1.0),))


def _controlled(w, x):
    with jax.named_scope("pre"):  # a while loop over data (not differentiated)
        x = jax.lax.while_loop(lambda v: jnp.sum(v * v) > 1.0, lambda v: v * 0.5, x)
    with jax.named_scope("branch"):  # the untaken branch overflows; it must not count
        h = jax.lax.cond(
            jnp.sum(x) > 100.0,
            lambda h: jnp.exp(h @ w) * 1e9,
            lambda h: jnp.tanh(h @ w),
            x,
        )
    with jax.named_scope("ckpt"):
        h = jax.checkpoint(lambda h: jnp.sin(h @ w))(h)
    with jax.named_scope("custom"):
        h = _clipped(h @ w)
    return jnp.sum(h**2)


@pytest.mark.parametrize("policy", [None, "mixed_float16"])
def test_while_cond_remat_and_custom_vjp_bodies_are_named(policy):
    w = jax.random.normal(jax.random.key(0), (4, 4)) * 0.5
    x = jax.random.normal(jax.random.key(1), (3, 4)) * 4.0  # the while loop halves it 3 times
    fn = _controlled if policy is None else jmp.autocast(_controlled, policy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no NumPy "overflow encountered in cast"
        report = jmp.debug_precision(fn, w, x)
    assert report.matmul_layers == ("branch", "ckpt", "custom")
    forward, backward = _named(report, "forward"), _named(report, "backward")
    assert {"branch", "ckpt", "custom"} <= forward & backward
    if policy is None:
        assert "pre" in forward
        pre = next(s for s in report.layers if s.layer == "pre")
        assert pre.amax <= 4.0 * float(jnp.abs(x).max())  # the loop's values, not its inputs
    assert report.origin is None and all(s.overflow == 0 for s in report.layers)
    assert "ckpt/ckpt" not in forward | backward  # JAX's repeated remat scope is one layer


def test_the_table_under_a_policy_shows_what_it_holds_in_half_precision():
    def loss(w, x):
        with jax.named_scope("wide"):
            big = jnp.sum(jnp.exp(x * 12.0))  # 1.6e5: kept in float32 by autocast
        with jax.named_scope("dense"):
            h = x @ w
        return jnp.sum(h**2) + big * 1e-6

    report = jmp.debug_precision(jmp.autocast(loss, "mixed_float16"), jnp.ones((3, 3)), jnp.ones(3))
    table = str(report)
    assert report.judged == "target"
    assert any(s.layer == "wide" and s.headroom < 0 for s in report.layers)
    assert "\nwide " not in table and "\ndense " in table
    assert "values the policy holds in float16" in table
