"""Equinox, first class: models with function leaves, `eqx.filter_jit`, `eqx.nn.State`."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from user_models import image_batches, make_eqx_cnn, make_eqx_transformer, token_batches

import jmp_policy as jmp
from jmp_policy._reports.census import compute_dtype, iter_equations

eqx = pytest.importorskip("equinox")

pytestmark = pytest.mark.standard_promotion  # user code: optax's Adam mixes float and int


def _half_share(jaxpr, primitives=("dot_general", "conv_general_dilated")):
    dtypes = [compute_dtype(e) for e in iter_equations(jaxpr) if e.primitive.name in primitives]
    return sum(d == jnp.float16 for d in dtypes) / len(dtypes), len(dtypes)


def _trainer(model, loss_fn, scale, *, has_aux=False, lr=3e-3):
    """The Equinox way: filter_jit, filter_value_and_grad, eqx.filter for optax, apply_updates."""
    tx = jmp.loss_scaling(optax.adam(lr), scale)
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    grad = jmp.eqx.filter_value_and_scaled_grad(loss_fn, has_aux=has_aux)

    @eqx.filter_jit
    def step(model, opt_state, *batch):
        value, grads = grad(opt_state, model, *batch)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, value

    return step, opt_state


def _lm_loss(model, tokens):
    logits = jax.vmap(model)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def _train_transformer(policy_name, steps=60):
    model = make_eqx_transformer(jax.random.key(0))
    if policy_name != "float32":
        model = jmp.eqx.mixed_precision(model, policy_name)
    scale = jmp.DynamicLossScale(2.0**15) if policy_name == "mixed_float16" else jmp.NoOpLossScale()
    step, opt_state = _trainer(model, _lm_loss, scale)
    tokens = token_batches(jax.random.key(1), steps)
    jaxpr = eqx.filter_make_jaxpr(step)(model, opt_state, tokens[0])[0]
    losses = []
    for i in range(steps):
        model, opt_state, loss = step(model, opt_state, tokens[i])
        losses.append(float(loss))
    return model, opt_state, step, jaxpr, float(np.mean(losses[-5:])), losses


def _assert_skipped_bit_for_bit(step, model, opt_state, batch):
    new_model, new_state, _ = step(model, opt_state, *batch)
    assert bool(new_state.last_step_skipped)
    assert int(new_state.skipped_steps) == int(opt_state.skipped_steps) + 1
    for a, b in zip(jax.tree.leaves(eqx.filter(new_model, eqx.is_array)),
                    jax.tree.leaves(eqx.filter(model, eqx.is_array)), strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(new_state.inner_state), jax.tree.leaves(opt_state.inner_state),
                    strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    return new_state


def test_equinox_transformer_trains_in_float16_with_dynamic_loss_scaling():
    model, opt_state, step, jaxpr, final16, losses = _train_transformer("mixed_float16")
    *_, final32, _ = _train_transformer("float32")
    share, count = _half_share(jaxpr)
    print(f"matmuls in float16: {share:.0%} of {count}; final loss {final16:.4f} against "
          f"float32's {final32:.4f}")  # fmt: skip
    assert share >= 0.9
    assert final16 < 0.5 * losses[0]
    assert abs(final16 / final32 - 1) < 0.02
    assert model.model.blocks[0].mlp.activation is jax.nn.gelu  # function leaves kept
    assert model.model.head.weight.dtype == jnp.float32  # master weights
    # A planted overflow: a loss scale no float16 backward pass survives.
    planted = eqx.tree_at(
        lambda s: s.loss_scale.loss_scale, opt_state, jnp.asarray(2.0**100, jnp.float32)
    )
    batch = (token_batches(jax.random.key(2), 1)[0],)
    after = _assert_skipped_bit_for_bit(step, model, planted, batch)
    assert float(after.loss_scale.loss_scale) == 2.0**99


def _cnn_loss(model, state, x, y):
    batched = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    logits, state = batched(x, state)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), state


def _train_cnn(policy_name, steps=40):
    model, state = make_eqx_cnn(jax.random.key(0))
    if policy_name != "float32":
        model = jmp.eqx.mixed_precision(model, policy_name)
    scale = jmp.DynamicLossScale(2.0**15) if policy_name == "mixed_float16" else jmp.NoOpLossScale()
    step, opt_state = _trainer(model, _cnn_loss, scale, has_aux=True)
    images, labels = image_batches(jax.random.key(1), steps, size=16)
    images = jnp.moveaxis(images, -1, 2)  # Equinox convs take channels first
    jaxpr = eqx.filter_make_jaxpr(step)(model, opt_state, state, images[0], labels[0])[0]
    losses = []
    for i in range(steps):
        model, opt_state, (loss, state) = step(model, opt_state, state, images[i], labels[i])
        losses.append(float(loss))
    return model, opt_state, state, step, jaxpr, float(np.mean(losses[-5:])), losses, images


def test_equinox_cnn_with_batchnorm_trains_in_float16_and_keeps_float32_statistics():
    model, opt_state, state, step, jaxpr, final16, losses, images = _train_cnn("mixed_float16")
    *_, final32, _, _ = _train_cnn("float32")
    share, count = _half_share(jaxpr)
    print(f"convs/matmuls in float16: {share:.0%} of {count}; final loss {final16:.4f} against "
          f"float32's {final32:.4f}")  # fmt: skip
    assert share >= 0.9
    assert final16 < losses[0]
    assert abs(final16 / final32 - 1) < 0.02
    statistics = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert len(statistics) == 4  # running mean and variance of two BatchNorms
    assert all(x.dtype == jnp.float32 for x in statistics)
    # A planted overflow: one pixel beyond float16's range makes the step non-finite.
    x = images[0].at[0, 0, 0, 0].set(1e6)
    labels = jnp.zeros(images.shape[1], jnp.int32)
    _assert_skipped_bit_for_bit(step, model, opt_state, (state, x, labels))


def test_autocast_passes_non_array_leaves_through():
    seen = {}

    def f(x, fn, n, name, nothing):
        seen.update(fn=fn, n=n, name=name, nothing=nothing)
        return fn(x @ x)[:n]

    out = jmp.autocast(f)(jnp.ones((4, 4)), jnp.tanh, 2, "block", None)
    assert out.shape == (2, 4) and out.dtype == jnp.float32
    assert seen == {"fn": jnp.tanh, "n": 2, "name": "block", "nothing": None}
    model = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))
    report = jmp.precision_report(jmp.autocast(lambda m, x: m(x)), model, jnp.ones(4))
    assert report.counts["dot_general"] == {"float16": 2}


def test_policies_cast_equinox_modules():
    model = eqx.nn.MLP(4, 2, 8, 1, activation=jax.nn.gelu, key=jax.random.key(0))
    half = jmp.get_policy("mixed_float16").cast_to_compute(model)
    assert half.layers[0].weight.dtype == jnp.float16
    assert half.activation is jax.nn.gelu and half.in_size == 4
    assert jmp.cast_to_full(half).layers[1].bias.dtype == jnp.float32


def test_value_and_scaled_grad_with_equinox_grad_functions():
    model = eqx.nn.MLP(2, 1, 4, 1, key=jax.random.key(0))
    tx = jmp.loss_scaling(optax.sgd(0.1), jmp.DynamicLossScale(2.0**4))
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    loss_fn = lambda m, x: jnp.sum(m(x) ** 2)  # noqa: E731
    grad = jmp.value_and_scaled_grad(loss_fn, grad_fn=eqx.filter_value_and_grad)
    loss, grads = eqx.filter_jit(grad)(opt_state, model, jnp.ones(2))
    plain = eqx.filter_grad(loss_fn)(model, jnp.ones(2))
    assert float(loss) == pytest.approx(float(loss_fn(model, jnp.ones(2))))
    for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(plain), strict=True):
        np.testing.assert_allclose(np.asarray(g), 16 * np.asarray(p), rtol=1e-6)
    with pytest.raises(ValueError, match="argnums=0"):
        jmp.value_and_scaled_grad(loss_fn, argnums=1, grad_fn=eqx.filter_value_and_grad)


def test_states_pass_through_partition_combine_and_filter_jit():
    model = eqx.nn.MLP(2, 1, 4, 1, key=jax.random.key(0))
    tx = jmp.loss_scaling(optax.adam(1e-3), jmp.DynamicLossScale(2.0**15, hysteresis=2))
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    arrays, static = eqx.partition(opt_state, eqx.is_array)
    combined = eqx.combine(arrays, static)
    assert jax.tree.structure(combined) == jax.tree.structure(opt_state)
    scale = eqx.filter_jit(lambda s: jmp.get_loss_scale(s))(opt_state)
    assert float(scale.loss_scale) == 2.0**15 and scale.hysteresis == 2
