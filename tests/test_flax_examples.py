"""Models written as Flax's own examples write them (`flax_examples.py`), under each
integration that applies: `jmp.linen.mixed_precision` or `jmp.nnx.mixed_precision` (the
model wrapped) and `jmp.autocast` (the loss function rewritten, the model untouched).

Fast lane (`pytest -n 2`): float16, a few steps of each example's train step (Linen: the
mutable collections kept by `jmp.unless_skipped`, the ResNet data-parallel under `shard_map`;
NNX: the functional pattern, `nnx.split` / `nnx.merge`): forward and
backward run, >= 99% of the step's matmul FLOPs in half precision, a planted overflow is
skipped bit for bit (parameters, optimizer state, batch statistics, NNX variables), and the
precision debugger names the model's layers. Slow lane (`pytest -m slow`, in .ci/run): the
final training loss of float16 and bfloat16 against float32's, two seeds.
"""

from __future__ import annotations

import functools
import warnings

import flax_examples as ex  # noqa: E402  (after jax: conftest's XLA flags)
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from cuda_program import assert_gpu_matmuls_in_low_precision, cuda_matmuls
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from parity import assert_matches_float32, perturbed  # noqa: E402

import jmp_policy as jmp
from jmp_policy._reports.census import report_of_jaxpr

pytestmark = pytest.mark.standard_promotion  # user code: optax's Adam mixes float and int

OVERFLOW, ONE = jnp.float32(2.0**120), jnp.float32(1.0)
TASKS = [(t, i) for t in ex.LINEN_TASKS for i in ("linen.mixed_precision", "autocast")] + [
    (t, i) for t in ex.NNX_TASKS for i in ("nnx.mixed_precision", "autocast")
]


def _scale(policy: str, initial: float = 2.0**15):
    return jmp.DynamicLossScale(initial) if policy == "mixed_float16" else jmp.NoOpLossScale()


class _Trainer:
    """One example's train step and what it carries: `step(batch, rng, gain)` trains and
    returns the loss; `carried()` is `(parameters, model state, the inner optimizer's
    state)`."""

    def __init__(self, step, carry):
        self._step, self.carry = step, carry

    def jaxpr(self, batch, rng):
        return jax.make_jaxpr(self._step)(*self.carry, batch, rng, ONE)

    def gpu_matmuls(self, batch, rng):
        """The matmuls of the train step's program for CUDA (`cuda_program`)."""
        return cuda_matmuls(self._step, *self.carry, batch, rng, ONE)

    def step(self, batch, rng, gain=ONE):
        *self.carry, loss = self._step(*self.carry, batch, rng, gain)
        return loss

    def carried(self):
        params, state, opt_state = self.carry
        return params, state, jmp.scaling.find_loss_scaling_state(opt_state).inner_state

    @property
    def scaling(self):
        return jmp.scaling.find_loss_scaling_state(self.carry[2])


class _NnxTrainer(_Trainer):
    """NNX's own pattern: `nnx.jit`, `nnx.Optimizer`, `jmp.nnx.revert_if_skipped` (a model
    merged inside `jax.grad` cannot write its BatchNorm statistics or counters)."""

    def jaxpr(self, batch, rng):
        graphdef, state = nnx.split(self.carry)
        return jax.make_jaxpr(
            lambda state: self._step(*nnx.merge(graphdef, state), batch, rng, ONE)
        )(state)

    def gpu_matmuls(self, batch, rng):
        graphdef, state = nnx.split(self.carry)
        return cuda_matmuls(
            jax.jit(lambda state: self._step(*nnx.merge(graphdef, state), batch, rng, ONE)),
            state,
        )

    def step(self, batch, rng, gain=ONE):
        return self._step(*self.carry, batch, rng, gain)

    def carried(self):
        model, optimizer = self.carry
        return jax.tree.map(
            _host,
            (
                nnx.state(model, nnx.Param),
                nnx.state(model, nnx.Not(nnx.Param)),
                jmp.scaling.find_loss_scaling_state(optimizer).inner_state,
            ),
        )

    @property
    def scaling(self):
        return jmp.scaling.find_loss_scaling_state(self.carry[1])


def _rngs(seed):
    """The RNG streams the Linen examples draw from at `init`."""
    names = ("params", "dropout", "noise")
    return dict(zip(names, jax.random.split(jax.random.key(seed), len(names)), strict=True))


def _linen(task_name, integration, policy, seed, perturb):
    task = ex.LINEN_TASKS[task_name]
    data = task.batches(jax.random.key(seed + 1), task.steps)
    first = jax.tree.map(lambda a: a[0], data)
    apply = task.module.apply
    if policy != "float32" and integration == "linen.mixed_precision":
        apply = jmp.linen.mixed_precision(task.module, jmp.get_policy(policy)).apply
    variables = task.module.init(_rngs(seed), *task.example(first))
    params = perturbed(variables.pop("params"), seed, perturb)

    def loss_fn(params, state, batch, rng, gain):
        value, new_state = task.loss(apply, {"params": params, **state}, batch, rng)
        return gain * value, new_state

    if policy != "float32" and integration == "autocast":
        loss_fn = jmp.autocast(loss_fn, policy)
    axis = "batch" if task.mapped else None
    tx = jmp.loss_scaling(optax.adam(task.learning_rate), _scale(policy), axis_name=axis)

    def step(params, state, opt_state, batch, rng, gain):
        (value, new_state), grads = jmp.value_and_scaled_grad(loss_fn, has_aux=True)(
            opt_state, params, state, batch, rng, gain
        )
        if axis is not None:
            grads, value = jax.lax.pmean((grads, value), axis)
        updates, opt_state = tx.update(grads, opt_state, params)
        state = jmp.unless_skipped(opt_state, new_state, state)
        return optax.apply_updates(params, updates), state, opt_state, value

    if axis is not None:
        mesh = jax.make_mesh((len(jax.devices()),), (axis,))
        specs = (P(), P(), P(), P(axis), P(), P())
        step = jax.shard_map(step, mesh=mesh, in_specs=specs, out_specs=P())
        data = jax.device_put(data, NamedSharding(mesh, P(None, axis)))
    return _Trainer(jax.jit(step), (params, dict(variables), tx.init(params))), data


def _nnx(task_name, integration, policy, seed, perturb):
    task = ex.NNX_TASKS[task_name]
    data = task.batches(jax.random.key(seed + 1), task.steps)
    model = task.make(seed)
    if perturb:
        nnx.update(model, perturbed(nnx.state(model, nnx.Param), seed, perturb))
    if policy != "float32" and integration == "nnx.mixed_precision":
        model = jmp.nnx.mixed_precision(model, jmp.get_policy(policy))
    loss_fn = task.loss
    if policy != "float32" and integration == "autocast":
        loss_fn = jmp.autocast(loss_fn, policy)

    def gained(model, batch, gain):
        return gain * loss_fn(model, batch)

    tx = jmp.loss_scaling(optax.adam(task.learning_rate), _scale(policy, task.initial_scale))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch, rng, gain):
        del rng  # the model carries its own (nnx.Rngs)
        with jmp.nnx.revert_if_skipped(model, optimizer):
            loss, grads = jmp.value_and_scaled_grad(gained, grad_fn=nnx.value_and_grad)(
                optimizer, model, batch, gain
            )
            optimizer.update(model, grads)
        return loss

    return _NnxTrainer(step, (model, optimizer)), data


def _setup(task, integration, policy, seed=0, perturb=0.0):
    make = _linen if task in ex.LINEN_TASKS else _nnx
    return make(task, integration, policy, seed, perturb)


def _batch(data, i):
    return jax.tree.map(lambda a: a[i], data)


def _host(x):
    """`x` copied to the host (a PRNG key as its data)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def _assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(_host(x), _host(y))


@pytest.mark.parametrize(("task", "integration"), TASKS)
def test_example_trains_in_half_precision_and_skips_an_overflow(task, integration):
    trainer, data = _setup(task, integration, "mixed_float16")
    rng = jax.random.key(7)
    share = report_of_jaxpr(trainer.jaxpr(_batch(data, 0), rng)).half_matmul_flop_share
    assert share >= 0.99, f"{task} under {integration}: {share:.1%} of matmul FLOPs in half"
    # Training: at most the first steps skipped while the dynamic scale backs off from its
    # start, then applied.
    for i in range(5):
        assert np.isfinite(float(trainer.step(_batch(data, i), rng)))
    assert int(trainer.scaling.applied_steps) >= 3 and not bool(trainer.scaling.last_step_skipped)
    scale = float(trainer.scaling.loss_scale.loss_scale)
    # A planted overflow: the step is skipped, and nothing it carries has changed
    # (parameters, batch statistics and other model state, the optimizer's state).
    before = jax.tree.map(_host, trainer.carried())
    trainer.step(_batch(data, 5), rng, OVERFLOW)
    assert bool(trainer.scaling.last_step_skipped)
    _assert_same(trainer.carried(), before)
    assert float(trainer.scaling.loss_scale.loss_scale) == scale / 2


@pytest.mark.slow
@pytest.mark.parametrize(("task", "integration"), TASKS)
def test_the_gpu_program_multiplies_in_16_bits(task, integration):
    """The train step as a GPU compiles it (exported for CUDA on this machine): its matmuls
    on bfloat16 operands, none taking a float32 operand beside a 16-bit one."""
    trainer, data = _setup(task, integration, "mixed_bfloat16")
    found = trainer.gpu_matmuls(_batch(data, 0), jax.random.key(7))
    assert_gpu_matmuls_in_low_precision(found, f"{task} under {integration}")


# The policies' own routes (autocast gives a reason only for sizes and names: test_fp8.py).
OWN_ROUTES = [(t, i) for t, i in TASKS if i != "autocast"]


@pytest.mark.parametrize(("task", "integration"), OWN_ROUTES)
def test_every_matmul_left_out_of_float8_has_a_cause(task, integration):
    """`precision_report`'s reason for each matmul of the train step not in float8 names its
    cause (a size, FP8_EXCLUDE, a float32 operand, a layer the policy does not give float8),
    never only the dtype it stayed in."""
    with warnings.catch_warnings():
        # A head the examples name like any layer runs in float8: the warning is asserted in
        # tests/test_float8_reports.py.
        warnings.filterwarnings(
            "ignore", "jmp_policy. .* is the last matmul", jmp.errors.PrecisionWarning
        )
        trainer, data = _setup(task, integration, "mixed_float8")
        report = report_of_jaxpr(trainer.jaxpr(_batch(data, 0), jax.random.key(7)))
    # ResNet's matmuls are convolutions and a 10-wide head; the toy MLP's are 1 wide.
    assert report.fp8_matmul_flop_share > 0 or task in ("resnet", "nnx_toy"), task
    causes = ("multiple of", "blocks", "FP8_EXCLUDE", "float32", "Dense, DenseGeneral")
    for dtype, reason, where in report.fp8_left_out:
        assert reason != f"left in {dtype}", (where, reason)
        assert any(cause in reason for cause in causes), (where, reason)


# The names each model's layers carry, some of which the debugger must report.
LAYERS = {
    "lm1b": "block_0",
    "wmt": "decoder_0",
    "sst2": "classifier_hidden",
    "seq2seq": "decoder",
    "vae": "encoder_fc1",
    "gemma": "layers/0",
    "nnx_toy": "linear1",
}


@pytest.mark.parametrize("task", sorted(LAYERS))
def test_the_debugger_names_the_example_layers(task):
    """(ResNet's BatchNorm averages over the "batch" axis: it runs only under a mapped axis,
    where the debugger does not.)"""
    data = _batch((ex.LINEN_TASKS.get(task) or ex.NNX_TASKS[task]).batches(jax.random.key(1), 1), 0)
    if task in ex.LINEN_TASKS:
        spec = ex.LINEN_TASKS[task]
        variables = spec.module.init(
            _rngs(0),
            *spec.example(data),
        )
        rng = jax.random.key(2)

        def loss(params):
            return spec.loss(spec.module.apply, {**variables, "params": params}, data, rng)[0]

        report = jmp.debug_precision(loss, variables["params"], dtype="float16")
    else:
        model = ex.NNX_TASKS[task].make(0)
        report = jmp.debug_precision(ex.NNX_TASKS[task].loss, model, data, dtype="float16")
    layers = {s.layer for s in report.layers}
    assert any(LAYERS[task] in name for name in layers), sorted(layers)


# --- slow lane: parity with float32 ---------------------------------------------------------

TOLERANCE = {"mixed_float16": 0.02, "mixed_bfloat16": 0.05}


@functools.cache
def _final_loss(task, integration, policy, seed, perturb=0.0):
    trainer, data = _setup(task, integration, policy, seed, perturb)
    rng, losses = jax.random.key(seed + 3), []
    for i in range((ex.LINEN_TASKS.get(task) or ex.NNX_TASKS[task]).steps):
        rng, sub = jax.random.split(rng)
        losses.append(float(trainer.step(_batch(data, i), sub)))
    return float(np.mean(losses[-20:]))


@pytest.mark.slow
@pytest.mark.parametrize("policy", sorted(TOLERANCE))
@pytest.mark.parametrize(("task", "integration"), TASKS)
def test_example_final_loss_matches_float32(task, integration, policy):
    """Within 2% (float16) / 5% (bfloat16) of float32's final loss, or, where float32 itself
    moves more under a 2^-11 perturbation of its initial weights, within that noise."""
    assert_matches_float32(_final_loss, task, integration, policy, TOLERANCE[policy])
