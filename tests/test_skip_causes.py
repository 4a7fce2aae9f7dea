"""Every skipped step has a cause, recorded in the state and said by the report (issue 53).

A CNN with BatchNorm under `linen.mixed_precision("mixed_float16")`, trained with the loss passed
to `update` (`value=loss`): each planted cause is recorded, the scale backs off only for a
gradient overflow, and parameters, optimizer state and batch statistics stay bit for bit.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from models import CNN

import jmp_policy as jmp
from jmp_policy._loss_scaling.spikes import spread

# These tests hand `update` gradients made outside `value_and_scaled_grad` (planted infs, a
# report's fields) with a DynamicLossScale: what the misuse check warns of, once per process
# (tests/test_misuse.py asserts that warning).
_MISUSE_SAID = pytest.mark.filterwarnings(
    "ignore:loss_scaling. the gradients given to `update` were computed in another function"
    ":jmp_policy.errors.LossScalingWarning"
)
pytestmark = _MISUSE_SAID

X = jax.random.normal(jax.random.key(0), (8, 8, 8, 3))
TARGETS = jax.nn.one_hot(jnp.arange(8) % 4, 4)
MODEL = jmp.linen.mixed_precision(CNN(), jmp.get_policy("mixed_float16"))
VARIABLES = MODEL.init(jax.random.key(1), X)


def _train(scale):
    # Spike skipping on (judged after 3 applied steps).
    tx = jmp.loss_scaling(
        optax.sgd(1e-2, momentum=0.9),
        jmp.DynamicLossScale(scale),
        skip_spikes=jmp.scaling.SkipSpikes(warmup=3),
    )

    def loss_fn(params, batch_stats, x, targets, times, gradient_times):
        logits, updates = MODEL.apply(
            {"params": params, "batch_stats": batch_stats}, x, mutable=["batch_stats"]
        )
        loss = times * optax.softmax_cross_entropy(logits, targets).mean()
        # The same value, its gradients `gradient_times` as large: a gradient-norm spike.
        loss = loss + (gradient_times - 1.0) * (loss - jax.lax.stop_gradient(loss))
        return loss, updates["batch_stats"]

    @jax.jit
    def step(params, batch_stats, opt_state, x, targets, times=1.0, gradient_times=1.0):
        (loss, new_stats), grads = jmp.value_and_scaled_grad(loss_fn, has_aux=True)(
            opt_state, params, batch_stats, x, targets, times, gradient_times
        )
        updates, opt_state = tx.update(grads, opt_state, params, value=loss)
        params = optax.apply_updates(params, updates)
        return params, jmp.unless_skipped(opt_state, new_stats, batch_stats), opt_state

    return tx.init(VARIABLES["params"]), step


# planted: (initial scale, batch, targets, loss multiplier, gradient multiplier, cause)
INF = X.at[0, 0, 0, 0].set(jnp.inf)
CAUSES = {
    "an inf in the batch": (2.0**10, INF, TARGETS, 1, 1, "non-finite loss"),
    "a NaN target": (2.0**10, X, TARGETS.at[3, 1].set(jnp.nan), 1, 1, "non-finite loss"),
    "a forward overflow": (2.0**10, X * 1e5, TARGETS, 1, 1, "non-finite loss"),
    "a gradient overflow at a huge scale": (2.0**30, X, TARGETS, 1, 1, "non-finite gradients"),
    "a 10x loss spike": (2.0**10, X, TARGETS, 10.0, 1, "spike"),
    "a 10x gradient-norm spike": (2.0**10, X, TARGETS, 1, 10.0, "spike"),
}  # fmt: skip


@pytest.mark.parametrize("planted", CAUSES)
def test_each_cause_is_recorded_and_keeps_every_state(planted):
    scale, x, targets, times, gradient_times, cause = CAUSES[planted]
    opt_state, step = _train(scale)
    params, stats = VARIABLES["params"], VARIABLES["batch_stats"]
    # Clean steps first: the scale starts a growth count; spikes are judged after 3.
    for _ in range({"non-finite loss": 1, "spike": 3}.get(cause, 0)):
        params, stats, opt_state = step(params, stats, opt_state, X, TARGETS)
    before = jax.tree.map(np.asarray, (params, stats, opt_state))
    params, stats, opt_state = step(
        params, stats, opt_state, x, targets, jnp.float32(times), jnp.float32(gradient_times)
    )
    state = jmp.scaling.find_loss_scaling_state(opt_state)
    assert bool(state.last_step_skipped)
    for a, b in zip(jax.tree.leaves(before[:2]), jax.tree.leaves((params, stats)), strict=True):
        np.testing.assert_array_equal(a, b)  # parameters and batch statistics
    kept = [before[2], opt_state]
    inner = [jmp.scaling.find_loss_scaling_state(s).inner_state for s in kept]
    for a, b in zip(*map(jax.tree.leaves, inner), strict=True):
        np.testing.assert_array_equal(a, b)  # the optimizer's state
    old_scale = jmp.scaling.find_loss_scaling_state(before[2]).loss_scale
    if cause == "non-finite gradients":
        assert float(state.loss_scale.loss_scale) == float(old_scale.loss_scale) / 2
    else:
        # No scale cures it: the scale and its growth count stay as they were.
        for a, b in zip(jax.tree.leaves(old_scale), jax.tree.leaves(state.loss_scale), strict=True):
            np.testing.assert_array_equal(a, b)
    report = jmp.loss_scaling_report(opt_state)
    assert report.last_skip_cause == cause
    assert report.skip_causes == {c: int(c == cause) for c in jmp.scaling.SKIP_CAUSES}
    assert f"the last step was skipped for {cause}" in str(report)
    words = {
        "non-finite loss": ["debug_precision", "left as it was"],
        "non-finite gradients": ["backing off the scale cures"],
        "spike": ["spreads (the run's own step-to-step noise) above", "left as it was"],
    }
    assert all(w in str(report) for w in words[cause])


def test_without_the_loss_a_skip_is_counted_as_the_gradients_and_backs_off():
    # The behaviour before `value=loss`: nothing tells the two causes apart.
    tx = jmp.loss_scaling(optax.sgd(0.1), jmp.DynamicLossScale(2.0**10))
    params = {"w": jnp.ones(2)}
    _, state = jax.jit(tx.update)({"w": jnp.array([jnp.nan, 1.0])}, tx.init(params), params)
    assert state.skip_causes.tolist() == [0, 1, 0] and int(state.last_skip_cause) == 2
    assert float(jmp.get_loss_scale(state).loss_scale) == 2.0**9


@pytest.mark.standard_promotion  # reduce_on_plateau mixes int32 and float32
def test_the_loss_reaches_an_inner_transform_that_takes_it():
    # optax.contrib.reduce_on_plateau reads `value`: loss_scaling passes it on.
    inner = optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau(patience=0, factor=0.5))
    tx = jmp.loss_scaling(inner, jmp.NoOpLossScale())
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    for loss in (1.0, 2.0, 3.0):
        updates, state = tx.update({"w": jnp.ones(2)}, state, params, value=jnp.float32(loss))
    assert float(updates["w"][0]) < -0.0 and float(updates["w"][0]) > -1.0  # reduced


def test_the_step_counters_count_applied_steps():
    from flax import nnx
    from flax.training import train_state

    tx = jmp.loss_scaling(optax.sgd(0.1), jmp.DynamicLossScale(2.0**10))
    state = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx)

    @jax.jit
    def step(state, grads):
        new = state.apply_gradients(grads=grads)
        return jmp.unless_skipped(new, new, state)  # the whole TrainState, step included

    for grads in ([1.0, 1.0], [jnp.inf, 1.0], [1.0, 1.0]):
        state = step(state, {"w": jnp.array(grads)})
    report = jmp.loss_scaling_report(state)
    assert int(state.step) == report.applied_steps == 2 and report.skipped_steps == 1
    assert report.loss_scale == 2.0**9  # the skip's back-off was kept, not undone

    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def nnx_step(model, optimizer, x):
        with jmp.nnx.revert_if_skipped(model, optimizer):
            _, grads = jmp.value_and_scaled_grad(
                lambda m: jnp.sum(m(x) ** 2), grad_fn=nnx.value_and_grad
            )(optimizer, model)
            optimizer.update(model, grads)

    for x in ([[1.0, 1.0]], [[jnp.inf, 1.0]], [[1.0, 1.0]]):
        nnx_step(model, optimizer, jnp.array(x))
    assert int(optimizer.step[...]) == 2
    assert jmp.loss_scaling_report(optimizer).applied_steps == 2


# --- Spike skipping --------------------------------------------------------------------------


def _spiky(**config):
    tx = jmp.loss_scaling(
        optax.sgd(0.1, momentum=0.9),
        jmp.DynamicLossScale(2.0**4, period=1000),
        skip_spikes=jmp.scaling.SkipSpikes(**{"warmup": 5, "max_run": 3, **config}),
    )
    params = {"w": jnp.ones(4), "b": jnp.zeros(2)}
    return tx, params, tx.init(params), jax.jit(tx.update)


def _grads(size, scale=16.0):  # scaled gradients of global norm `size` (unscaled)
    return {"w": jnp.full(4, size * scale / jnp.sqrt(4.0)), "b": jnp.zeros(2)}


def _noisy(state, params, update, steps=40, loss=1.0, seed=0):
    """`steps` healthy steps: the loss and the gradient norm with 5% noise."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        jitter = 1 + 0.05 * rng.standard_normal(2)
        updates, state = update(
            _grads(float(jitter[0])), state, params, value=jnp.float32(loss * jitter[1])
        )
        params = optax.apply_updates(params, updates)
        assert not bool(state.last_step_skipped)
    return state, params


def _spreads_above(state, which, spreads):
    """The value `spreads` spreads above the running mean (`loss`, or a gradient norm)."""
    stats = state.spike_stats
    mean, square = (
        (stats.loss_mean, stats.loss_spread)
        if which == "loss"
        else (stats.norm_mean, stats.norm_spread)
    )
    value = mean + spreads * spread(square, mean, stats.spread_weight)
    return float(value) if which == "loss" else float(jnp.exp(value))


@pytest.mark.parametrize("spike", ["loss", "gradient norm"])
@pytest.mark.parametrize("loss", [1.0, -5.0, 1e-4], ids=["positive", "negative", "near zero"])
def test_a_jump_of_10_spreads_is_skipped_without_learning_from_it_or_backing_off(spike, loss):
    tx, params, state, update = _spiky()
    state, params = _noisy(state, params, update, loss=loss)
    before = jax.tree.map(np.asarray, (params, state))
    jumped = _spreads_above(state, spike, 10.01)  # 10 or more (float32 rounding aside)
    mean_loss = float(state.spike_stats.loss_mean)
    grads, value = (_grads(1.0), jumped) if spike == "loss" else (_grads(jumped), mean_loss)
    updates, state = update(grads, state, params, value=jnp.float32(value))
    params = optax.apply_updates(params, updates)
    report = jmp.loss_scaling_report(state)
    assert report.last_step_skipped and report.last_skip_cause == "spike"
    assert report.skip_causes == {"non-finite loss": 0, "non-finite gradients": 0, "spike": 1}
    assert "skipped for spike" in str(report)
    old = before[1]
    for a, b in zip(jax.tree.leaves(before[0]), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)  # parameters bit for bit
    for a, b in zip(
        jax.tree.leaves((old.inner_state, old.loss_scale, old.spike_stats[:-1])),
        jax.tree.leaves((state.inner_state, state.loss_scale, state.spike_stats[:-1])),
        strict=True,
    ):  # optimizer state, scale (and its growth count), statistics: as they were
        np.testing.assert_array_equal(a, b)
    # 5 spreads above is no spike, and a drop is never one.
    grads, value = _grads(1.0), mean_loss
    for spreads in (5.0, -50.0):
        below = _spreads_above(state, spike, spreads)
        if spike == "loss":
            value = below
        else:
            grads = _grads(below)
        _, state = update(grads, state, params, value=jnp.float32(value))
        assert not bool(state.last_step_skipped), spreads


def test_a_healthy_signed_noisy_loss_is_never_a_spike():
    """What `loss > 10 * mean` got wrong: once the running mean is negative, every ordinary
    loss lies above 10 times it. 300 noisy steps around -1 (and around 1e-3, three times
    noisier than its mean) skip none."""
    for loss in (-1.0, 1e-3):
        tx, params, state, update = _spiky()
        rng = np.random.default_rng(3)
        for _ in range(300):
            value = loss + abs(loss) * (0.3 if loss < 0 else 3.0) * rng.standard_normal()
            updates, state = update(_grads(1.0), state, params, value=jnp.float32(value))
            params = optax.apply_updates(params, updates)
        assert int(state.skip_causes[2]) == 0, loss


def test_spikes_are_judged_only_after_the_warm_up_and_a_run_ends_after_max_run():
    """A new regime (every step 100x) is skipped `max_run` times, then taken, and the
    statistics start again from it with a new warm-up."""
    tx, params, state, update = _spiky(warmup=3, max_run=2)
    _, state = update(_grads(1.0), state, params, value=jnp.float32(1.0))
    _, state = update(_grads(50.0), state, params, value=jnp.float32(1.0))  # warming up
    assert not bool(state.last_step_skipped)
    _, state = update(_grads(1.0), state, params, value=jnp.float32(1.0))
    taken = []
    for _ in range(4):  # a change of regime: every step 100x
        _, state = update(_grads(100.0), state, params, value=jnp.float32(100.0))
        taken.append(not bool(state.last_step_skipped))
    assert taken == [False, False, True, True]  # 2 skipped, then taken (and learnt from)
    assert int(state.skip_causes[2]) == 2
    assert int(state.spike_stats.seen) == 2  # warming up again


def test_spike_states_are_data_under_vmap_and_tree_map():
    tx, params, state, _ = _spiky(warmup=1)
    states = jax.tree.map(lambda *x: jnp.stack(x), state, state)
    both = jax.tree.map(lambda *x: jnp.stack(x), params, params)
    update = jax.jit(jax.vmap(tx.update))  # one program, not each operation on its own
    grads = jax.tree.map(lambda *x: jnp.stack(x), _grads(1.0), _grads(1.0))
    _, states = update(grads, states, both)
    spiky = jax.tree.map(lambda *x: jnp.stack(x), _grads(1.0), _grads(50.0))
    _, states = update(spiky, states, both)
    assert states.last_step_skipped.tolist() == [False, True]  # each member decides alone
    assert isinstance(states.spike_stats, jmp.scaling.SpikeStats)


@pytest.mark.parametrize(
    ("config", "error", "match"),
    [
        ({"threshold": 0.0}, ValueError, "threshold"),
        ({"spread_decay": 1.0}, ValueError, "spread_decay"),
        ({"mean_decay": 0.0}, ValueError, "mean_decay"),
        ({"threshold": "8"}, TypeError, "threshold"),
        ({"max_run": 0}, ValueError, "max_run"),
        ({"factor": 10.0}, TypeError, "no longer takes `factor`.*`threshold`"),
        ({"decay": 0.99}, TypeError, "no longer takes"),
    ],
)
def test_skip_spikes_is_checked_at_construction(config, error, match):
    with pytest.raises(error, match=match):
        jmp.scaling.SkipSpikes(**config)


def test_skip_spikes_must_be_a_skip_spikes():
    with pytest.raises(TypeError, match="skip_spikes"):
        jmp.loss_scaling(optax.sgd(0.1), jmp.NoOpLossScale(), skip_spikes=True)


# --- healthy noisy runs (benchmarks/spike_runs.py): nothing skipped, corruption skipped -------


def _spike_runs():
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "spike_runs.py"
    if "spike_runs" not in sys.modules:
        spec = importlib.util.spec_from_file_location("spike_runs", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["spike_runs"] = module
        spec.loader.exec_module(module)
    return sys.modules["spike_runs"]


def _healthy_and_corrupted(name, seed):
    runs = _spike_runs()
    steps = runs.RUNS[name].steps
    without = runs.train(name, seed)
    clean = runs.train(name, seed, jmp.scaling.SkipSpikes())
    corrupted = runs.train(name, seed, jmp.scaling.SkipSpikes(), corrupt_at=(1000, steps - 1))
    # At most 0.1% of a healthy run's steps skipped, its held-out loss kept.
    assert len(clean["skipped"]) <= steps // 1000, clean["skipped"]
    assert abs(clean["held_out"] / without["held_out"] - 1) <= 0.005
    # The corrupted batches (inputs x 30, labels shifted; a reward bug) skipped.
    assert {1000, steps - 1} <= set(corrupted["skipped"]), corrupted["skipped"]
    assert len(corrupted["skipped"]) <= 2 + steps // 1000
    return clean


@pytest.mark.slow  # three 2,000-step runs (8 s): .ci/run's slow lane
@pytest.mark.standard_promotion  # optax's Adam mixes float and int
def test_a_gaussian_nll_below_zero_skips_nothing_but_corrupted_batches():
    """A Gaussian NLL goes below zero as it trains (to about -0.8): `loss > 10 * mean` skipped
    1,439 of its 2,000 healthy steps; the spread test skips none."""
    clean = _healthy_and_corrupted("gaussian nll", 0)
    assert clean["losses"][-100:].mean() < -0.5  # it did go below zero


@pytest.mark.slow
@pytest.mark.standard_promotion
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", ["digits", "gaussian nll", "bandit"])
def test_healthy_noisy_runs_skip_nothing_but_corrupted_batches(name, seed):
    """A classifier driven to a near-zero loss at batch 16, a Gaussian NLL below zero, a
    policy-gradient objective: two seeds each (BENCHMARKS.md has the table)."""
    _healthy_and_corrupted(name, seed)


def test_many_spikes_warn_once():
    """A rate of spike skips no healthy run shows (over 1%, at least 5) warns once, naming
    the likely wrong setting."""
    tx, params, state, update = _spiky(warmup=3, max_run=100)
    state, params = _noisy(state, params, update, steps=10)
    for _ in range(6):
        _, state = update(_grads(1.0), state, params, value=jnp.float32(1e3))
    with pytest.warns(jmp.errors.PrecisionWarning, match="6 of 16 steps as spikes"):
        jmp.loss_scaling_report(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jmp.loss_scaling_report(state)  # once


def test_spike_skipping_state_is_donated_under_jit():
    """Each field of the spike statistics is its own buffer: a donated state may not hold one
    twice (`SpikeStats.empty` once shared one zero between six fields)."""
    tx, params, state, _ = _spiky(warmup=2)
    leaves = jax.tree.leaves(state)
    assert len({id(x) for x in leaves}) == len(leaves)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, grads, loss):
        updates, state = tx.update(grads, state, params, value=loss)
        return optax.apply_updates(params, updates), state

    for i in range(4):
        params, state = step(params, state, _grads(1.0 + 0.01 * i), jnp.float32(1.0 + 0.01 * i))
    assert int(state.applied_steps) == 4
