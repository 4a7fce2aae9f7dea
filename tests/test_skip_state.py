"""A skipped step changes nothing a step returns: parameters, optimizer state and model state.

A forward pass that overflows (one inf in the input is enough) writes NaN batch statistics. The
step is skipped; `jmp.unless_skipped` (Linen, Equinox) and `jmp.nnx.revert_if_skipped` (NNX)
carry that decision to the model state, so the next clean step trains. Each model is written as
its library's own examples write it: Equinox's BatchNorm with `mode` unset (its "ema" default)
and "batch", an `eqx.nn.State`; Linen's `TrainState` with `batch_stats`; NNX's `BatchNorm` and
`Dropout` (RNG counts are state too).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state
from models import NNXBatchNormNet, ScanMLP

import jmp_policy as jmp

eqx = pytest.importorskip("equinox")

pytestmark = pytest.mark.standard_promotion  # user code: optax's Adam mixes float and int


def _host(x):
    x = jnp.asarray(x)
    return np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)


def _copy(tree):
    return jax.tree.map(lambda x: np.array(_host(x), copy=True), tree)


def _assert_same(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b) > 0
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_array_equal(_host(x), _host(y))


def _all_finite(tree):
    return all(
        bool(np.isfinite(np.asarray(x)).all())
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)
    )


def _batches():
    x = jax.random.normal(jax.random.key(0), (8, 4))
    y = (x.sum(axis=1) > 0).astype(jnp.int32)
    return x, x.at[0, 0].set(jnp.inf), y


# --- Equinox -----------------------------------------------------------------------------


class _EqxNet(eqx.Module):
    up: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    head: eqx.nn.Linear

    def __init__(self, mode, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(4, 16, key=k1)
        # As Equinox's examples write it: `mode` unset is "ema" (with a warning of Equinox's).
        kwargs = {} if mode is None else {"mode": mode}
        self.norm = eqx.nn.BatchNorm(16, axis_name="batch", **kwargs)
        self.head = eqx.nn.Linear(16, 2, key=k2)

    def __call__(self, x, state):
        x, state = self.norm(jax.nn.relu(self.up(x)), state)
        return self.head(x), state


def _eqx_loss(model, state, x, y):
    batched = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    logits, state = batched(x, state)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), state


@pytest.mark.parametrize("mode", [None, "batch"])
def test_equinox_forward_overflow_keeps_model_state(mode):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Equinox's own: `mode` unset
        net, state = eqx.nn.make_with_state(_EqxNet)(mode, jax.random.key(1))
    model = jmp.eqx.mixed_precision(net, "mixed_float16")
    tx = jmp.loss_scaling(optax.adam(1e-2), jmp.DynamicLossScale(2.0**15))
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    grad = jmp.eqx.filter_value_and_scaled_grad(_eqx_loss, has_aux=True)

    @eqx.filter_jit
    def train_step(model, opt_state, state, x, y):
        (loss, new_state), grads = grad(opt_state, model, state, x, y)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        state = jmp.unless_skipped(opt_state, new_state, state)
        return eqx.apply_updates(model, updates), opt_state, state, loss

    x, bad, y = _batches()
    model, opt_state, state, _ = train_step(model, opt_state, state, x, y)  # a clean first step
    before = _copy((eqx.filter(model, eqx.is_inexact_array), opt_state.inner_state, state))
    model, opt_state, state, loss = train_step(model, opt_state, state, bad, y)
    assert not np.isfinite(float(loss)) and bool(opt_state.last_step_skipped)
    _assert_same(before, (eqx.filter(model, eqx.is_inexact_array), opt_state.inner_state, state))
    losses = []
    for _ in range(5):  # the next clean steps train
        model, opt_state, state, loss = train_step(model, opt_state, state, x, y)
        losses.append(float(loss))
    assert not bool(opt_state.last_step_skipped) and int(opt_state.skipped_steps) == 1
    assert _all_finite(state) and np.isfinite(losses).all() and losses[-1] < losses[0]


# --- Linen -------------------------------------------------------------------------------


class _LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.relu(nn.Dense(16)(x))
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dense(2)(x)


class _State(train_state.TrainState):
    batch_stats: dict


def test_linen_forward_overflow_keeps_batch_stats_under_donation():
    model = jmp.linen.mixed_precision(_LinenNet(), "mixed_float16")
    x, bad, y = _batches()
    variables = model.init(jax.random.key(1), x)
    state = _State.create(
        apply_fn=model.apply,
        params=variables["params"],
        batch_stats=variables["batch_stats"],
        tx=jmp.loss_scaling(optax.adam(1e-2), jmp.DynamicLossScale(2.0**15)),
    )

    def loss_fn(params, batch_stats, x, y):
        logits, updates = model.apply(
            {"params": params, "batch_stats": batch_stats}, x, mutable=["batch_stats"]
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, updates["batch_stats"]

    def train_step(state, x, y):
        (loss, batch_stats), grads = jmp.value_and_scaled_grad(loss_fn, has_aux=True)(
            state, state.params, state.batch_stats, x, y
        )
        new = state.apply_gradients(grads=grads)
        return new.replace(
            batch_stats=jmp.unless_skipped(new, batch_stats, state.batch_stats)
        ), loss

    donated = jax.jit(train_step, donate_argnums=0)  # the state's buffers reused
    state, _ = donated(state, x, y)
    inner = lambda s: jmp.scaling.find_loss_scaling_state(s.opt_state).inner_state  # noqa: E731
    before = _copy((state.params, inner(state), state.batch_stats))
    state, loss = donated(state, bad, y)
    assert not np.isfinite(float(loss))
    assert bool(jmp.scaling.find_loss_scaling_state(state.opt_state).last_step_skipped)
    _assert_same(before, (state.params, inner(state), state.batch_stats))
    losses = []
    for _ in range(6):  # the next clean steps train
        state, loss = donated(state, x, y)
        losses.append(float(loss))
    assert _all_finite(state.batch_stats) and np.isfinite(losses).all() and losses[-1] < losses[0]


# --- NNX ---------------------------------------------------------------------------------


def test_nnx_forward_overflow_keeps_batch_stats_and_rng_counts():
    model = jmp.nnx.mixed_precision(
        NNXBatchNormNet(nnx.Rngs(0, dropout=1)), jmp.get_policy("mixed_float16")
    )
    optimizer = nnx.Optimizer(
        model, jmp.loss_scaling(optax.adam(1e-2), jmp.DynamicLossScale(2.0**15)), wrt=nnx.Param
    )

    def loss_fn(model, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    @nnx.jit
    def train_step(model, optimizer, x, y):
        with jmp.nnx.revert_if_skipped(model, optimizer):
            loss, grads = jmp.value_and_scaled_grad(loss_fn, grad_fn=nnx.value_and_grad)(
                optimizer, model, x, y
            )
            optimizer.update(model, grads)
        return loss

    x, bad, y = _batches()
    train_step(model, optimizer, x, y)
    inner = lambda: jmp.scaling.find_loss_scaling_state(optimizer).inner_state  # noqa: E731
    state = lambda: nnx.state(model, nnx.Not(nnx.Param))  # noqa: E731
    before = _copy((nnx.state(model, nnx.Param), inner(), state()))
    assert len(jax.tree.leaves(before[2])) >= 3  # batch mean, variance and an RNG count
    loss = train_step(model, optimizer, bad, y)
    assert not np.isfinite(float(loss))
    assert bool(jmp.scaling.find_loss_scaling_state(optimizer).last_step_skipped)
    _assert_same(before, (nnx.state(model, nnx.Param), inner(), state()))
    losses = [float(train_step(model, optimizer, x, y)) for _ in range(6)]
    assert _all_finite(state()) and np.isfinite(losses).all() and losses[-1] < losses[0]


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_nnx_scan_over_layers_with_a_float32_batchnorm_trains_and_skips_bit_for_bit(policy):
    # The BatchNorm island hands its output back in the compute dtype, so nnx.scan's carry
    # keeps its type (it raised "carry input and carry output must have equal types").
    model = jmp.nnx.mixed_precision(ScanMLP(10, n_layers=5, rngs=nnx.Rngs(0)), policy)
    optimizer = nnx.Optimizer(
        model, jmp.loss_scaling(optax.sgd(0.05), jmp.DynamicLossScale(2.0**15)), wrt=nnx.Param
    )

    @nnx.jit
    def train_step(model, optimizer, x, y):
        with jmp.nnx.revert_if_skipped(model, optimizer):
            loss, grads = jmp.value_and_scaled_grad(
                lambda m: jnp.mean((m(x) - y) ** 2), grad_fn=nnx.value_and_grad
            )(optimizer, model)
            optimizer.update(model, grads)
        return loss

    x = jax.random.normal(jax.random.key(0), (16, 10))
    y = jnp.sin(x)
    losses = [float(train_step(model, optimizer, x, y)) for _ in range(20)]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    inner = lambda: jmp.scaling.find_loss_scaling_state(optimizer).inner_state  # noqa: E731
    state = lambda: nnx.state(model, nnx.Not(nnx.Param))  # noqa: E731
    before = _copy((nnx.state(model, nnx.Param), inner(), state()))
    assert len(jax.tree.leaves(nnx.state(model, nnx.BatchStat))) == 2  # mean, var of 5 layers
    train_step(model, optimizer, x.at[0, 0].set(jnp.inf), y)
    assert bool(jmp.scaling.find_loss_scaling_state(optimizer).last_step_skipped)
    _assert_same(before, (nnx.state(model, nnx.Param), inner(), state()))


def test_unless_skipped_needs_the_same_structure_and_a_loss_scaling_state():
    tx = jmp.loss_scaling(optax.sgd(0.1), jmp.DynamicLossScale(2.0**10))
    opt_state = tx.init({"w": jnp.ones(2)})
    with pytest.raises(ValueError, match="same structure"):
        jmp.unless_skipped(opt_state, {"a": jnp.ones(2)}, {"b": jnp.ones(2)})
    with pytest.raises(ValueError, match="loss_scaling"):
        jmp.unless_skipped(optax.adam(1e-3).init({"w": jnp.ones(2)}), jnp.ones(2), jnp.ones(2))
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="nnx.Optimizer"):
        with jmp.nnx.revert_if_skipped(model, opt_state):
            pass


def test_unless_skipped_follows_each_member_of_a_batched_state():
    tx = jmp.loss_scaling(optax.sgd(0.1), jmp.DynamicLossScale(2.0**10))
    params = {"w": jnp.ones((2, 3))}  # two ensemble members
    opt_state = jax.vmap(tx.init)(params)
    grads = {"w": jnp.array([[1.0, 1.0, 1.0], [1.0, jnp.nan, 1.0]])}
    _, opt_state = jax.vmap(tx.update)(grads, opt_state, params)
    kept = jmp.unless_skipped(opt_state, jnp.full((2, 3), 5.0), jnp.zeros((2, 3)))
    assert kept.tolist() == [[5.0] * 3, [0.0] * 3]
