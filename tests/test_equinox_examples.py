"""Models written as Equinox's documentation examples write them (`equinox_examples.py`),
under each integration that applies: `jmp.eqx.mixed_precision` (the model wrapped) and
`jmp.autocast` (the loss function rewritten, the model untouched).

Fast lane (`pytest -n 2`): float16, a few steps of the Equinox train step (`eqx.filter_jit`,
`filter_value_and_scaled_grad`, `loss_scaling`): forward and backward run, >= 99% of the
step's matmul FLOPs (forward and backward) in half precision, and a planted overflow is
skipped bit for bit. Slow lane (`pytest -m slow`, in .ci/run): the final training loss of
float16 and bfloat16 against float32's, two seeds.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_policy as jmp
from jmp_policy._reports.census import report_of_jaxpr

eqx = pytest.importorskip("equinox")
import equinox_examples as ex  # noqa: E402
from cuda_program import assert_gpu_matmuls_in_low_precision, cuda_matmuls  # noqa: E402
from parity import assert_matches_float32  # noqa: E402

pytestmark = pytest.mark.standard_promotion  # user code: optax's Adam mixes float and int

INTEGRATIONS = ("eqx.mixed_precision", "autocast")
# A loss gain whose scaled gradients overflow half precision; an array, so that the planted
# step reuses the compiled train step (`eqx.filter_jit` makes a Python float static).
OVERFLOW, ONE = jnp.float32(2.0**120), jnp.float32(1.0)


def _setup(task: str, integration: str, policy: str, seed: int = 0, perturb: float = 0.0):
    make, batches, loss = ex.TASKS[task]
    model = make(jax.random.key(seed))
    if perturb:  # float32's own noise: every weight moved by a relative `perturb`
        leaves = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
        keys = iter(jax.random.split(jax.random.key(seed + 100), len(leaves)))
        model = jax.tree.map(
            lambda w: (
                w * (1 + perturb * jax.random.normal(next(keys), w.shape))
                if eqx.is_inexact_array(w)
                else w
            ),
            model,
        )

    def loss_fn(model, inputs, targets, key, gain):
        return gain * loss(model, inputs, targets, key)

    if policy != "float32":
        if integration == "eqx.mixed_precision":
            model = jmp.eqx.mixed_precision(model, policy)
        else:
            loss_fn = jmp.autocast(loss_fn, policy)
    scale = jmp.DynamicLossScale(2.0**15) if policy == "mixed_float16" else jmp.NoOpLossScale()
    tx = jmp.loss_scaling(optax.adam(2e-3), scale)
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    grad = jmp.eqx.filter_value_and_scaled_grad(loss_fn)

    @eqx.filter_jit
    def step(model, opt_state, inputs, targets, key, gain):  # always passed: one trace
        value, grads = grad(opt_state, model, inputs, targets, key, gain)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = tx.update(grads, opt_state, params, value=value)
        return eqx.apply_updates(model, updates), opt_state, value

    return model, opt_state, step, batches(jax.random.key(seed + 1), 200)


def _batch(data, i):
    return jax.tree.map(lambda a: a[i], data)


def _assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("integration", INTEGRATIONS)
@pytest.mark.parametrize("task", sorted(ex.TASKS))
def test_example_trains_in_half_precision_and_skips_an_overflow(task, integration):
    model, opt_state, step, (inputs, targets) = _setup(task, integration, "mixed_float16")
    key = jax.random.key(7)
    first = (_batch(inputs, 0), targets[0], key, ONE)
    jaxpr = eqx.filter_make_jaxpr(step)(model, opt_state, *first)[0]
    share = report_of_jaxpr(jaxpr).half_matmul_flop_share
    assert share >= 0.99, f"{task} under {integration}: {share:.1%} of matmul FLOPs in half"
    for i in range(3):
        model, opt_state, loss = step(model, opt_state, _batch(inputs, i), targets[i], key, ONE)
        assert np.isfinite(float(loss)) and not bool(opt_state.last_step_skipped)
    # A planted overflow: the step is skipped, and nothing it returns has changed.
    new_model, new_state, _ = step(model, opt_state, _batch(inputs, 3), targets[3], key, OVERFLOW)
    assert bool(new_state.last_step_skipped)
    _assert_same(new_model, model)
    _assert_same(new_state.inner_state, opt_state.inner_state)
    assert float(jmp.get_loss_scale(new_state).loss_scale) == 2.0**14


@pytest.mark.slow
@pytest.mark.parametrize("integration", INTEGRATIONS)
@pytest.mark.parametrize("task", sorted(ex.TASKS))
def test_the_gpu_program_multiplies_in_16_bits(task, integration):
    """The train step as a GPU compiles it (exported for CUDA on this machine): its matmuls
    on bfloat16 operands, none taking a float32 operand beside a 16-bit one."""
    model, opt_state, step, (inputs, targets) = _setup(task, integration, "mixed_bfloat16")
    arrays, static = eqx.partition((model, opt_state), eqx.is_array)

    def of_arrays(arrays, inputs, targets, key):
        return step(*eqx.combine(arrays, static), inputs, targets, key, ONE)

    found = cuda_matmuls(
        jax.jit(of_arrays), arrays, _batch(inputs, 0), targets[0], jax.random.key(7)
    )
    assert_gpu_matmuls_in_low_precision(found, f"{task} under {integration}")


@pytest.mark.parametrize("integration", INTEGRATIONS)
def test_dcgan_with_batchnorm_state_trains_and_skips_bit_for_bit(integration):
    """The DCGAN's generator keeps BatchNorm statistics in an `eqx.nn.State`: a skipped step
    keeps them too (`jmp.unless_skipped`)."""
    policy = "mixed_float16"
    model, state = ex.make_gan(jax.random.key(0))
    loss_fn = ex.gan_loss
    if integration == "eqx.mixed_precision":  # each network, as a user wraps them
        model = eqx.tree_at(
            lambda m: (m.generator, m.discriminator),
            model,
            (
                jmp.eqx.mixed_precision(model.generator, policy),
                jmp.eqx.mixed_precision(model.discriminator, policy),
            ),
        )
    else:
        loss_fn = jmp.autocast(loss_fn, policy)

    def scaled_loss(model, state, real, z, gain):
        value, state = loss_fn(model, state, real, z)
        return gain * value, state

    tx = jmp.loss_scaling(optax.adam(2e-4), jmp.DynamicLossScale(2.0**15))
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    grad = jmp.eqx.filter_value_and_scaled_grad(scaled_loss, has_aux=True)

    @eqx.filter_jit
    def step(model, state, opt_state, real, z, gain):  # always passed: one trace
        (value, new_state), grads = grad(opt_state, model, state, real, z, gain)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = tx.update(grads, opt_state, params)
        new_state = jmp.unless_skipped(opt_state, new_state, state)
        return eqx.apply_updates(model, updates), new_state, opt_state, value

    real, z = ex.real_image_batches(jax.random.key(1), 4)
    jaxpr = eqx.filter_make_jaxpr(step)(model, state, opt_state, real[0], z[0], ONE)[0]
    assert report_of_jaxpr(jaxpr).half_matmul_flop_share >= 0.99
    for i in range(3):
        model, state, opt_state, loss = step(model, state, opt_state, real[i], z[i], ONE)
        assert np.isfinite(float(loss)) and not bool(opt_state.last_step_skipped)
    new_model, new_state, new_opt, _ = step(model, state, opt_state, real[3], z[3], OVERFLOW)
    assert bool(new_opt.last_step_skipped)
    _assert_same(new_model, model)
    _assert_same(new_state, state)
    _assert_same(new_opt.inner_state, opt_state.inner_state)


# --- slow lane: parity with float32 ---------------------------------------------------------

STEPS = 150
TOLERANCE = {"mixed_float16": 0.02, "mixed_bfloat16": 0.05}


@functools.cache
def _final_loss(task, integration, policy, seed, perturb=0.0):
    model, opt_state, step, (inputs, targets) = _setup(task, integration, policy, seed, perturb)
    key, losses = jax.random.key(seed + 3), []
    for i in range(STEPS):
        key, sub = jax.random.split(key)
        model, opt_state, loss = step(model, opt_state, _batch(inputs, i), targets[i], sub, ONE)
        losses.append(float(loss))
    return float(np.mean(losses[-20:]))


@pytest.mark.slow
@pytest.mark.parametrize("policy", sorted(TOLERANCE))
@pytest.mark.parametrize("integration", INTEGRATIONS)
@pytest.mark.parametrize("task", sorted(ex.TASKS))
def test_example_final_loss_matches_float32(task, integration, policy):
    """Within 2% (float16) / 5% (bfloat16) of float32's final loss, or, where float32 itself
    moves more under a 2^-11 perturbation of its initial weights, within that noise."""
    assert_matches_float32(_final_loss, task, integration, policy, TOLERANCE[policy])
