"""Tests for jmp_policy._loss_scaling.scaled_grad: the one-call path for a loss-scaled step."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from flax.training import train_state

import jmp_policy as jmp

pytestmark = pytest.mark.standard_promotion  # optax's adam mixes int32 and float


def loss_fn(params, x, y):
    pred = x @ params["w"] + params["b"]
    return jnp.mean((pred - y) ** 2), {"pred_mean": pred.mean()}


def data():
    x = jax.random.normal(jax.random.key(0), (8, 3))
    return x, x @ jnp.array([1.0, -2.0, 0.5])


def test_value_is_unscaled_and_grads_are_the_scaled_losss():
    params = {"w": jnp.zeros(3), "b": jnp.zeros(())}
    tx = jmp.loss_scaling(optax.adam(0.1), jmp.DynamicLossScale(2.0**12, period=2))
    state = tx.init(params)
    x, y = data()

    @jax.jit
    def step(params, state):
        (loss, aux), grads = jmp.value_and_scaled_grad(loss_fn, has_aux=True)(state, params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss, aux, grads

    expected_loss, expected_grads = jax.value_and_grad(lambda p: loss_fn(p, x, y)[0])(params)
    _, _, loss, aux, grads = step(params, state)
    assert jnp.allclose(loss, expected_loss, rtol=1e-6) and "pred_mean" in aux  # jit vs eager
    # Powers of two scale exactly.
    chex.assert_trees_all_close(grads, jax.tree.map(lambda g: g * 2.0**12, expected_grads))

    losses = []
    for _ in range(60):
        params, state, loss, _, _ = step(params, state)
        losses.append(float(loss))
    assert step._cache_size() == 1  # the scale grew (2 steps a doubling) without recompiling
    assert float(jmp.get_loss_scale(state).loss_scale) > 2.0**12
    assert losses[-1] < 1e-3 * losses[0], losses[::10]
    print(f"one-call path: loss {losses[0]:.3f} -> {losses[-1]:.2e} in 60 steps")


def test_same_updates_as_scaling_by_hand():
    params = {"w": jnp.ones(3), "b": jnp.zeros(())}
    tx = jmp.loss_scaling(optax.adam(0.1), jmp.DynamicLossScale(2.0**7))
    state = tx.init(params)
    x, y = data()
    _, grads = jmp.value_and_scaled_grad(lambda p: loss_fn(p, x, y)[0])(state, params)
    scale = jmp.get_loss_scale(state)
    by_hand = jax.grad(lambda p: scale.scale(loss_fn(p, x, y)[0]))(params)
    chex.assert_trees_all_equal(grads, by_hand)


def test_argnums_selects_what_is_differentiated():
    params = {"w": jnp.ones(3), "b": jnp.zeros(())}
    tx = jmp.loss_scaling(optax.sgd(0.1), jmp.StaticLossScale(4.0))
    x, y = data()
    _, (g_params, g_x) = jmp.value_and_scaled_grad(
        lambda p, x: loss_fn(p, x, y)[0], argnums=(0, 1)
    )(tx.init(params), params, x)
    assert g_x.shape == x.shape and jax.tree.structure(g_params) == jax.tree.structure(params)


def test_train_state():
    params = {"w": jnp.zeros(3), "b": jnp.zeros(())}
    tx = jmp.loss_scaling(optax.adam(0.1), jmp.DynamicLossScale(2.0**10))
    ts = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    x, y = data()

    @jax.jit
    def step(ts):
        (loss, _), grads = jmp.value_and_scaled_grad(loss_fn, has_aux=True)(ts, ts.params, x, y)
        return ts.apply_gradients(grads=grads), loss

    first = None
    for _ in range(100):
        ts, loss = step(ts)
        first = float(loss) if first is None else first
    assert float(loss) < 1e-2 * first


def test_nnx_optimizer():
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    model = jmp.nnx.mixed_precision(model, jmp.get_policy("mixed_float16"))
    tx = jmp.loss_scaling(optax.adam(0.1), jmp.DynamicLossScale(2.0**10))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x, y = data()

    def loss(model):
        return jnp.mean((model(x)[:, 0] - y) ** 2)

    @nnx.jit
    def step(model, optimizer):
        value, grads = jmp.value_and_scaled_grad(loss, grad_fn=nnx.value_and_grad)(optimizer, model)
        optimizer.update(model, grads)
        return value

    values = [float(step(model, optimizer)) for _ in range(40)]
    assert values[-1] < 0.05 * values[0], values[::10]
    assert model.model.kernel[...].dtype == jnp.float32
    assert jmp.loss_scaling_report(optimizer).skipped_steps == 0


def test_bad_arguments():
    with pytest.raises(TypeError, match="`fun`"):
        jmp.value_and_scaled_grad(3)
    with pytest.raises(TypeError, match="`grad_fn`"):
        jmp.value_and_scaled_grad(loss_fn, grad_fn="jax")
    # An optimizer state without loss_scaling: both likely causes are named.
    with pytest.raises(TypeError, match=r"left out.*built without loss_scaling"):
        jmp.value_and_scaled_grad(loss_fn, has_aux=True)(optax.adam(1.0).init({}), {}, 1, 2)
