"""Tests for jmp_policy._loss_scaling.optimizer: loss_scaling as an optax transform."""

import itertools
import warnings

import chex
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import jmp_policy as jmp

# These tests hand `update` gradients made outside `value_and_scaled_grad` (planted infs, a
# report's fields) with a DynamicLossScale: what the misuse check warns of, once per process
# (tests/test_misuse.py asserts that warning).
_MISUSE_SAID = pytest.mark.filterwarnings(
    "ignore:loss_scaling. the gradients given to `update` were computed in another function"
    ":jmp_policy.errors.LossScalingWarning"
)
pytestmark = _MISUSE_SAID

# optax's Adam bias correction, schedules and MultiSteps mix int32 and float
# values, so tests running them use JAX's standard promotion (conftest.py).
optax_promotion = pytest.mark.standard_promotion


def make_params():
    key_w, key_v = jax.random.split(jax.random.key(0))
    return {
        "dense": {"w": jax.random.normal(key_w, (4, 3)), "b": jnp.zeros(3)},
        "out": {"w": jax.random.normal(key_v, (3, 2))},
    }


def clean_grads(step):
    """Deterministic, exactly representable gradients for step `step`."""
    params = make_params()
    key = jax.random.fold_in(jax.random.key(1), step)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    # Multiples of 2**-10: scaling by powers of two is exact.
    values = [
        jnp.round(jax.random.normal(k, x.shape) * 1024) / 1024
        for k, x in zip(keys, leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, values)


def poison(grads, value):
    return {**grads, "dense": {**grads["dense"], "w": grads["dense"]["w"].at[1, 2].set(value)}}


def make_tx(scale=None):
    schedule = optax.linear_schedule(1e-2, 1e-3, 20)
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))
    return jmp.loss_scaling(inner, scale or jmp.DynamicLossScale(2.0**12, period=3))


def train(tx, grads_per_step, params=None):
    """Feeds gradients of the scaled loss (g * S) through a jitted, donated step."""
    params = make_params() if params is None else params
    state = tx.init(params)

    @jax.jit
    def step(params, state, grads):
        scaled = jmp.get_loss_scale(state).scale(grads)
        updates, state = tx.update(scaled, state, params)
        return optax.apply_updates(params, updates), state

    for grads in grads_per_step:
        params, state = step(params, state, grads)
    return params, state, step


@optax_promotion
def test_poisoned_steps_change_nothing_bit_for_bit():
    clean = [clean_grads(i) for i in range(12)]
    poisoned = list(clean)
    for position, value in ((3, jnp.inf), (7, -jnp.inf), (10, jnp.nan)):
        poisoned.insert(position, poison(clean_grads(100 + position), value))
    params_a, state_a, _ = train(make_tx(), clean)
    params_b, state_b, _ = train(make_tx(), poisoned)
    chex.assert_trees_all_equal(params_a, params_b)  # bit for bit
    chex.assert_trees_all_equal(state_a.inner_state, state_b.inner_state)
    assert int(state_b.skipped_steps) == 3 and int(state_b.applied_steps) == 12
    assert int(state_a.skipped_steps) == 0


@optax_promotion
def test_skipped_step_leaves_everything_untouched():
    tx = make_tx()
    params = make_params()
    state = tx.init(params)
    updates, state = tx.update(clean_grads(0), state, params)
    params = optax.apply_updates(params, updates)
    updates, new_state = jax.jit(tx.update)(poison(clean_grads(1), jnp.nan), state, params)
    new_params = optax.apply_updates(params, updates)
    chex.assert_trees_all_equal(new_params, params)
    chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
    assert all(bool((u == 0).all()) for u in jax.tree.leaves(updates))
    assert bool(new_state.last_step_skipped)
    assert float(new_state.loss_scale.loss_scale) == float(state.loss_scale.loss_scale) / 2


def test_negative_zero_params_survive_a_skip():
    tx = jmp.loss_scaling(optax.sgd(0.1), jmp.DynamicLossScale(2.0))
    params = {"w": jnp.array([-0.0, 0.0, 1.0])}
    updates, _ = tx.update({"w": jnp.array([jnp.nan, 1.0, 1.0])}, tx.init(params), params)
    new = optax.apply_updates(params, updates)
    assert np.array_equal(np.signbit(new["w"]), np.signbit(params["w"]))


@pytest.mark.parametrize("init, period", [(2.0**16, 2000), (2.0**16, 3), (2.0**10, 2), (2.0**5, 5)])
def test_closed_loop_matches_grad_scaler(init, period):
    """A gradient g*S computed in float16 overflows exactly when |g*S| > 65504."""
    rng = np.random.default_rng(period)
    magnitudes = 2.0 ** rng.integers(-8, 12, size=60)  # |g| per step, powers of two
    tx = jmp.loss_scaling(
        optax.sgd(1e-3), jmp.DynamicLossScale(init, period=period, min_loss_scale=0.0)
    )
    params = {"w": jnp.zeros(3)}
    state = tx.init(params)

    @jax.jit
    def step(state, g):
        scaled = jmp.get_loss_scale(state).scale(g)
        scaled = jax.tree.map(lambda x: x.astype(jnp.float16), scaled)  # overflow -> inf
        _, state = tx.update(scaled, state, params)
        return state

    scales, skips = [], []
    for m in magnitudes:
        state = step(state, {"w": jnp.array([m, -m / 2, 0.0], jnp.float32)})
        scales.append(float(state.loss_scale.loss_scale))
        skips.append(bool(state.last_step_skipped))
    # The reference: GradScaler's rule, closed over its own overflow decisions.
    expected_scales, expected_skips = [], []
    ref_scale, tracker = np.float32(init), 0
    for m in magnitudes:
        finite = m * float(ref_scale) <= 65504
        if finite:
            tracker += 1
            if tracker == period:
                ref_scale, tracker = np.float32(ref_scale * 2), 0
        else:
            ref_scale, tracker = np.float32(ref_scale / 2), 0
        expected_scales.append(float(ref_scale))
        expected_skips.append(not finite)
    assert skips == expected_skips
    assert scales == expected_scales
    assert any(skips) and not all(skips)


@optax_promotion
def test_no_recompilation_after_first_step():
    grads = (
        [clean_grads(i) for i in range(4)] + [poison(clean_grads(9), jnp.inf)] + [clean_grads(5)]
    )
    _, _, step = train(make_tx(), grads)
    assert step._cache_size() == 1


@optax_promotion
def test_inner_optimizer_is_traced_once():
    # Tracing is part of the compile time users pay: the skip branch must take
    # the updates' types from the apply branch's trace, not trace the inner
    # optimizer (hundreds of leaves of Adam) a second time.
    calls = []
    adam = optax.adam(1e-3)

    def update(updates, state, params=None):
        calls.append(1)
        return adam.update(updates, state, params)

    tx = jmp.loss_scaling(
        optax.GradientTransformation(adam.init, update), jmp.DynamicLossScale(2.0**15)
    )
    params = make_params()
    state = tx.init(params)
    jax.jit(tx.update).trace(clean_grads(0), state, params)
    assert len(calls) == 1
    # And the step it compiles is the same: finite applied, overflow skipped.
    step = jax.jit(tx.update)
    updates, state = step(clean_grads(0), state, params)
    assert not bool(state.last_step_skipped)
    updates, state = step(poison(clean_grads(1), jnp.inf), state, params)
    assert bool(state.last_step_skipped)
    assert all(bool(jnp.all(u == 0) & jnp.all(jnp.signbit(u))) for u in jax.tree.leaves(updates))


def test_counters_saturate():
    tx = jmp.loss_scaling(optax.sgd(0.1), jmp.DynamicLossScale(2.0))
    params = {"w": jnp.ones(2)}
    big = jnp.asarray(np.iinfo(np.int32).max, jnp.int32)
    state = tx.init(params)._replace(skipped_steps=big, nonfinite_run=big, applied_steps=big)
    _, state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, state, params)
    assert int(state.skipped_steps) == int(big) and int(state.nonfinite_run) == int(big)
    _, state = tx.update({"w": jnp.ones(2)}, state, params)
    assert int(state.applied_steps) == int(big) and int(state.nonfinite_run) == 0


def test_clipping_sees_unscaled_gradients():
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    tx = jmp.loss_scaling(inner, jmp.StaticLossScale(2.0**10))
    params = {"w": jnp.zeros(3)}
    grads = {"w": jnp.array([0.5, 0.25, 0.125])}  # norm < 1: clipping must not bite
    updates, _ = tx.update(jmp.StaticLossScale(2.0**10).scale(grads), tx.init(params), params)
    chex.assert_trees_all_equal(updates, jax.tree.map(lambda g: -g, grads))


def test_update_is_differentiable_in_both_modes():
    # Meta-learning differentiates through a step (the loss after it, with
    # respect to the learning rate and the starting parameters). On a finite
    # step the derivatives are plain optax's: the skip must not block either
    # mode (a loop with a data-dependent trip count would block reverse mode).
    x = jnp.array([[1.0, -2.0], [0.5, 3.0], [-1.0, 0.25]])
    y = jnp.array([1.0, -1.0, 0.5])

    def loss(params):
        return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)

    def loss_after_step(lr, params, scaled):
        inner = optax.sgd(lr, momentum=0.9)
        if not scaled:
            grads = jax.grad(loss)(params)
            updates, _ = inner.update(grads, inner.init(params), params)
        else:
            tx = jmp.loss_scaling(inner, jmp.DynamicLossScale(2.0**10))
            state = tx.init(params)
            scale = jmp.get_loss_scale(state)
            grads = jax.grad(lambda p: scale.scale(loss(p)))(params)
            updates, _ = tx.update(grads, state, params)
        return loss(optax.apply_updates(params, updates))

    params = {"w": jnp.array([0.3, -0.2]), "b": jnp.array(0.1)}
    lr = jnp.array(0.05)

    def derivatives(scaled):
        def forward(lr):
            return jax.jvp(lambda lr: loss_after_step(lr, params, scaled), (lr,), (1.0,))[1]

        reverse = jax.grad(lambda lr, p: loss_after_step(lr, p, scaled), argnums=(0, 1))
        return jax.jit(reverse)(lr, params), jax.jit(forward)(lr)

    (d_lr, d_params), forward = derivatives(scaled=True)
    print(f"d loss / d lr: reverse {float(d_lr):.6f}, forward {float(forward):.6f}")
    chex.assert_trees_all_close(((d_lr, d_params), forward), derivatives(scaled=False), rtol=1e-6)
    assert float(d_lr) < 0 and float(jnp.abs(d_params["w"]).max()) > 0


@optax_promotion
def test_schedule_does_not_advance_on_skipped_steps():
    schedule = optax.piecewise_constant_schedule(1.0, {2: 0.1})
    inner = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
    tx = jmp.loss_scaling(inner, jmp.DynamicLossScale(1.0))
    params = {"w": jnp.zeros(1)}
    state = tx.init(params)
    lrs = []
    for g in [1.0, jnp.nan, jnp.inf, 1.0, 1.0, 1.0]:
        updates, state = tx.update({"w": jnp.array([g])}, state, params)
        lrs.append(float(state.inner_state.hyperparams["learning_rate"]))
    # The learning rate in the state is the one used by the latest applied step.
    assert lrs == pytest.approx([1.0, 1.0, 1.0, 1.0, 0.1, 0.1])
    assert int(state.inner_state.count) == 4


def test_inject_hyperparams_outside():
    scale = jmp.DynamicLossScale(2.0**4)
    tx = optax.inject_hyperparams(
        lambda learning_rate: jmp.loss_scaling(optax.sgd(learning_rate), scale)
    )(learning_rate=0.5)
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    state.hyperparams["learning_rate"] = jnp.asarray(0.25)
    assert float(jmp.get_loss_scale(state).loss_scale) == 16.0
    updates, state = jax.jit(tx.update)({"w": jnp.full(2, 16.0)}, state, params)
    chex.assert_trees_all_close(updates, {"w": jnp.full(2, -0.25)})
    updates, state = jax.jit(tx.update)({"w": jnp.array([jnp.inf, 1.0])}, state, params)
    assert float(jmp.get_loss_scale(state).loss_scale) == 8.0
    assert bool((updates["w"] == 0).all())


@optax_promotion
def test_multisteps_outside_skips_the_whole_window():
    """MultiSteps(loss_scaling(...)): S is constant over a window; any overflow skips it.

    optax 0.2.8's MultiSteps then resets its accumulator as `(1 - emit) * acc`,
    which turns the inf into a NaN that skips every later window too. That is
    why README recommends MultiSteps *inside* loss_scaling; the last block pins
    the upstream behaviour so a fixed optax shows up here.
    """
    tx = optax.MultiSteps(
        jmp.loss_scaling(optax.sgd(1.0), jmp.DynamicLossScale(4.0)), every_k_schedule=3
    )
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    step = jax.jit(tx.update)
    seen_scales = []
    for g in ([1.0, 1.0], [jnp.inf, 1.0], [1.0, 1.0]):
        seen_scales.append(float(jmp.get_loss_scale(state).loss_scale))
        updates, state = step({"w": jnp.array(g) * 4.0}, state, params)
        params = optax.apply_updates(params, updates)
    assert seen_scales == [4.0, 4.0, 4.0]
    chex.assert_trees_all_equal(params, {"w": jnp.zeros(2)})
    assert float(jmp.get_loss_scale(state).loss_scale) == 2.0
    assert int(jmp.scaling.find_loss_scaling_state(state).skipped_steps) == 1
    assert bool(jnp.isnan(state.acc_grads["w"][0]))  # optax's reset: inf * 0
    for g in ([1.0, 1.0], [3.0, 1.0], [2.0, 1.0]):  # a clean window, still skipped
        updates, state = step({"w": jnp.array(g) * 2.0}, state, params)
        params = optax.apply_updates(params, updates)
    chex.assert_trees_all_equal(params, {"w": jnp.zeros(2)})
    assert int(jmp.scaling.find_loss_scaling_state(state).skipped_steps) == 2


@optax_promotion
def test_multisteps_inside_skips_only_the_bad_minibatch():
    """loss_scaling(MultiSteps(...)): a bad mini-step is dropped; k finite ones make a window."""
    tx = jmp.loss_scaling(
        optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2), jmp.DynamicLossScale(4.0)
    )
    params = {"w": jnp.zeros(1)}
    state = tx.init(params)
    step = jax.jit(tx.update)
    for g in (1.0, jnp.nan, 3.0):
        scaled = jmp.get_loss_scale(state).scale({"w": jnp.array([g])})
        updates, state = step(scaled, state, params)
        params = optax.apply_updates(params, updates)
    chex.assert_trees_all_close(params, {"w": jnp.array([-2.0])})  # mean of 1 and 3
    assert int(state.skipped_steps) == 1 and int(state.applied_steps) == 2


def test_get_loss_scale_everywhere():
    scale = jmp.DynamicLossScale(2.0**7)
    params = {"w": jnp.ones(2)}
    chained = optax.chain(optax.add_decayed_weights(1e-4), jmp.loss_scaling(optax.sgd(0.1), scale))
    multi = optax.MultiSteps(jmp.loss_scaling(optax.adam(1e-3), scale), 4)
    injected = optax.inject_hyperparams(
        lambda learning_rate: jmp.loss_scaling(optax.sgd(learning_rate), scale)
    )(learning_rate=0.1)
    for tx in (chained, multi, injected):
        assert float(jmp.get_loss_scale(tx.init(params)).loss_scale) == 2.0**7
    ts = train_state.TrainState.create(
        apply_fn=None, params=params, tx=jmp.loss_scaling(optax.sgd(0.1), scale)
    )
    assert float(jmp.get_loss_scale(ts).loss_scale) == 2.0**7
    with pytest.raises(ValueError, match=r"found none.*loss_scaling"):
        jmp.get_loss_scale(optax.adam(1e-3).init(params))


def test_train_state_apply_gradients():
    scale = jmp.DynamicLossScale(2.0**8)
    params = {"w": jnp.ones(2)}
    ts = train_state.TrainState.create(
        apply_fn=None, params=params, tx=jmp.loss_scaling(optax.sgd(0.5), scale)
    )

    @jax.jit
    def step(ts, g):
        return ts.apply_gradients(grads=jmp.get_loss_scale(ts).scale(g))

    ts = step(ts, {"w": jnp.array([1.0, 2.0])})
    chex.assert_trees_all_close(ts.params, {"w": jnp.array([0.5, 0.0])})
    before = ts.params
    ts = step(ts, {"w": jnp.array([jnp.nan, 2.0])})
    chex.assert_trees_all_equal(ts.params, before)
    assert float(jmp.get_loss_scale(ts).loss_scale) == 2.0**7


@optax_promotion
def test_nnx_optimizer():
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(
        model, jmp.loss_scaling(optax.adam(1e-2), jmp.DynamicLossScale(2.0**10)), wrt=nnx.Param
    )
    x = jnp.ones((4, 3))

    @nnx.jit
    def step(model, optimizer, x, poison):
        scale = jmp.get_loss_scale(optimizer)

        def loss_fn(model):
            return scale.scale(jnp.mean(model(x) ** 2) * poison)

        grads = nnx.grad(loss_fn)(model)
        optimizer.update(model, grads)

    kernel = model.kernel[...]
    step(model, optimizer, x, jnp.float32(1.0))
    assert not np.array_equal(model.kernel[...], kernel)
    kernel = model.kernel[...]
    step(model, optimizer, x, jnp.float32(jnp.inf))
    np.testing.assert_array_equal(model.kernel[...], kernel)
    report = jmp.loss_scaling_report(optimizer)
    assert report.skipped_steps == 1 and report.applied_steps == 1 and report.loss_scale == 2.0**9


@optax_promotion
def test_donation_and_init_copies():
    scale = jmp.DynamicLossScale(2.0**8)
    tx = make_tx(scale)
    params = make_params()
    state_a = tx.init(params)
    state_b = tx.init(make_params())

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(jmp.get_loss_scale(state).scale(grads), state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(step, donate_argnums=(0, 1))
    for i in range(30):
        grads = poison(clean_grads(i), jnp.nan) if i % 7 == 3 else clean_grads(i)
        params, state_a = step(params, state_a, grads)
    assert int(state_a.applied_steps) + int(state_a.skipped_steps) == 30
    # The loss scale passed to both inits, and the second state, are still alive.
    assert float(scale.loss_scale) == 2.0**8
    assert float(state_b.loss_scale.loss_scale) == 2.0**8
    assert not any(x.is_deleted() for x in jax.tree.leaves(state_b))


def test_half_precision_master_weights_warn():
    with pytest.warns(UserWarning, match="master weights"):
        jmp.loss_scaling(optax.adam(1e-3), jmp.DynamicLossScale(2.0**8)).init(
            {"w": jnp.ones(2, jnp.float16)}
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jmp.loss_scaling(optax.adam(1e-3), jmp.DynamicLossScale(2.0**8)).init({"w": jnp.ones(2)})


def test_bad_arguments():
    with pytest.raises(TypeError, match="`inner`"):
        jmp.loss_scaling("adam", jmp.NoOpLossScale())
    with pytest.raises(TypeError, match="`loss_scale`"):
        jmp.loss_scaling(optax.adam(1e-3), 2.0**15)


def test_axis_name_agrees_across_devices():
    tx = jmp.loss_scaling(optax.sgd(1.0), jmp.DynamicLossScale(1.0), axis_name="d")
    local = jmp.loss_scaling(optax.sgd(1.0), jmp.DynamicLossScale(1.0))
    params = {"w": jnp.zeros(2)}
    grads = jnp.array([[1.0, 1.0], [jnp.nan, 1.0], [1.0, 1.0]])

    def per_device(tx):
        def run(g):
            updates, state = tx.update({"w": g}, tx.init(params), params)
            return updates["w"], state.last_step_skipped

        return run

    _, skipped = jax.vmap(per_device(tx), axis_name="d")(grads)
    assert skipped.tolist() == [True, True, True]
    _, skipped = jax.vmap(per_device(local))(grads)
    assert skipped.tolist() == [False, True, False]


@optax_promotion
def test_checkpoint_round_trip_and_resume(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    grads = [clean_grads(i) if i % 4 else poison(clean_grads(i), jnp.inf) for i in range(10)]
    final_params, final_state, _ = train(make_tx(), grads)

    params, state, step = train(make_tx(), grads[:5])
    restored_flax = flax.serialization.from_bytes(state, flax.serialization.to_bytes(state))
    chex.assert_trees_all_equal(restored_flax, state)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
    with ocp.StandardCheckpointer() as checkpointer:
        target = jax.tree.map(
            ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": state}
        )
        restored = checkpointer.restore(tmp_path / "ckpt", target)
    chex.assert_trees_all_equal(restored["opt_state"], state)
    for source in (restored, {"params": params, "opt_state": restored_flax}):
        p, s = source["params"], source["opt_state"]
        for g in grads[5:]:
            p, s = step(p, s, g)
        chex.assert_trees_all_equal(p, final_params)
        chex.assert_trees_all_equal(s, final_state)


# Leaves of 2**16 values are reduced one by one; small leaves of one shape are
# stacked and reduced together.
LARGE, SMALL = 2**16, 3


@pytest.mark.parametrize("size", [SMALL, LARGE])
def test_huge_finite_gradients_are_applied(size):
    # Their squares (and their sum) overflow; the check must still find them
    # finite.
    tx = jmp.loss_scaling(optax.sgd(1e-30), jmp.DynamicLossScale(1.0))
    params = {"a": jnp.ones(size), "b": jnp.ones(size)}
    huge = {"a": jnp.ones(size).at[:2].set([1e30, -3e38]), "b": jnp.ones(size)}
    updates, state = jax.jit(tx.update)(huge, tx.init(params), params)
    assert not bool(state.last_step_skipped) and int(state.applied_steps) == 1
    np.testing.assert_allclose(updates["a"][:3], [-1.0, 3e8, -1e-30], rtol=1e-6)
    # ... and a NaN beside them is still found, in its own leaf only.
    poisoned = {**huge, "b": jnp.ones(size).at[1].set(jnp.nan)}
    updates, state = jax.jit(tx.update)(poisoned, state, params)
    assert bool(state.last_step_skipped) and int(state.skipped_steps) == 1
    assert jax.tree.map(bool, state.nonfinite_leaves.tree()) == {"a": False, "b": True}
    assert state.nonfinite_leaves.paths() == ("['b']",)
    assert all(bool((u == 0).all()) for u in jax.tree.leaves(updates))
    # A clean step afterwards keeps the flags of the last skipped step.
    _, state = jax.jit(tx.update)(huge, state, params)
    assert not bool(state.last_step_skipped)
    assert state.nonfinite_leaves.paths() == ("['b']",)


def test_unscaling_by_a_scale_below_one_can_overflow_and_is_skipped():
    tx = jmp.loss_scaling(optax.sgd(1.0), jmp.StaticLossScale(0.25))
    params = {"w": jnp.ones(2)}
    # Finite as given, but 3e38 / 0.25 is inf in float32.
    updates, state = jax.jit(tx.update)({"w": jnp.array([3e38, 1.0])}, tx.init(params), params)
    assert bool(state.last_step_skipped)
    chex.assert_trees_all_equal(optax.apply_updates(params, updates), params)
    updates, state = jax.jit(tx.update)({"w": jnp.array([2e37, 1.0])}, state, params)
    assert not bool(state.last_step_skipped)
    np.testing.assert_allclose(updates["w"], [-8e37, -4.0], rtol=1e-6)


def _bfloat16_sgd():
    # Updates of another dtype than the gradients: `loss_scaling` must then
    # use a `cond` rather than its loop (whose carry keeps one type).
    def update(updates, state, params=None):
        return jax.tree.map(lambda g: (-0.5 * g).astype(jnp.bfloat16), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _params_of_size(size):
    return jax.tree.map(lambda x: jnp.resize(x, (size,)), make_params())


def _grads_of_size(step, size, poisoned=False):
    grads = jax.tree.map(lambda x: jnp.resize(x, (size,)), clean_grads(step))
    if poisoned:
        grads["dense"]["w"] = grads["dense"]["w"].at[1].set(jnp.nan)
    return grads


@optax_promotion
@pytest.mark.parametrize(
    "inner, size",
    [
        (optax.adam(1e-2), LARGE),
        (optax.adam(1e-2), SMALL),
        # Updates of another dtype than the gradients.
        (_bfloat16_sgd(), LARGE),
        (_bfloat16_sgd(), SMALL),
    ],
)
def test_skip_is_exact_for_large_and_small_leaves(inner, size):
    tx = jmp.loss_scaling(inner, jmp.DynamicLossScale(2.0**4))
    params = _params_of_size(size)
    jmp.get_loss_scale(tx.init(params))  # the gradients' scale read, as scaling them reads it
    jaxpr = jax.make_jaxpr(tx.update)(_grads_of_size(0, size), tx.init(params), params)
    primitives = [eqn.primitive.name for eqn in jaxpr.jaxpr.eqns]
    # One cond around the optimizer step; the flags of the bad leaves come
    # from the check itself, with no cond or loop of their own.
    assert (primitives.count("while"), primitives.count("cond")) == (0, 1)
    clean = [_grads_of_size(i, size) for i in range(6)]
    poisoned = clean[:2] + [_grads_of_size(50, size, poisoned=True)] + clean[2:]
    params_a, state_a, _ = train(tx, clean, params)
    params_b, state_b, _ = train(tx, poisoned, params)
    chex.assert_trees_all_equal(params_a, params_b)
    chex.assert_trees_all_equal(state_a.inner_state, state_b.inner_state)
    assert (int(state_b.skipped_steps), int(state_b.applied_steps)) == (1, 6)
    assert state_b.nonfinite_leaves.paths() == ("['dense']['w']",)
    assert not jax.tree.all(jax.tree.map(jnp.array_equal, params_a, params))


@optax_promotion
@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_step_memory_is_no_more_than_apply_if_finite(policy):
    # Not a timing: XLA's buffer assignment is deterministic. The check reads
    # the scaled gradients and the unscaled ones take their buffers, so a step
    # needs no more temporary memory than optax.apply_if_finite, which checks
    # gradients it is given already unscaled, and under one extra
    # gradient-sized buffer over plain optax (float32: 0.76 gradients' worth;
    # mixed_float16: 0.40).
    sizes = [512, 1024, 1024, 1024, 10]  # benchmarks/shapes.py's MLP
    keys = jax.random.split(jax.random.key(0), len(sizes) - 1)
    params = [
        {"w": jax.random.normal(k, (m, n)) / m**0.5, "b": jnp.zeros(n)}
        for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]
    x, y = jnp.ones((256, sizes[0])), jnp.arange(256) % 10
    cast = jmp.get_policy(policy).cast_to_compute

    def loss_fn(params, scale=1.0):
        h = cast(x)
        for layer in cast(params[:-1]):
            h = jax.nn.relu(h @ layer["w"] + layer["b"])
        head = cast(params[-1])
        logits = (h @ head["w"] + head["b"]).astype(jnp.float32)
        return scale * optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def temp_bytes(tx, scaled=False):
        def step(params, state):
            scale = jmp.get_loss_scale(state).loss_scale if scaled else 1.0
            updates, state = tx.update(jax.grad(loss_fn)(params, scale), state, params)
            return optax.apply_updates(params, updates), state

        jitted = jax.jit(step, donate_argnums=(0, 1))
        compiled = jitted.lower(params, tx.init(params)).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    plain = temp_bytes(optax.adam(1e-3))
    guarded = temp_bytes(optax.apply_if_finite(optax.adam(1e-3), 10))
    ours = temp_bytes(
        jmp.loss_scaling(optax.adam(1e-3), jmp.DynamicLossScale(2.0**15)), scaled=True
    )
    grad_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    ours_extra, guarded_extra = (ours - plain) / grad_bytes, (guarded - plain) / grad_bytes
    print(
        f"{policy}: extra temp over plain optax, in gradients' worth: loss_scaling "
        f"{ours_extra:.2f}, apply_if_finite {guarded_extra:.2f}"
    )
    assert ours <= guarded + 1024  # give or take a few scalars of state
    assert ours - plain < grad_bytes


@optax_promotion
def test_program_grows_linearly_with_the_number_of_leaves():
    # Compile cost, measured deterministically: the number of instructions in
    # XLA's optimised program of `update`, beyond plain Adam's, for N leaves of
    # N different shapes (so no two are checked together: the worst case). The
    # per-leaf flags and the skip must add a constant per leaf, not more.
    def instructions(tx, n):
        params = [jnp.ones((i + 1,)) for i in range(n)]
        compiled = jax.jit(tx.update).lower(params, tx.init(params), params).compile()
        return sum(1 for line in compiled.as_text().splitlines() if " = " in line)

    adam = optax.adam(1e-3)
    ours = jmp.loss_scaling(adam, jmp.DynamicLossScale(2.0**15))
    extra = {n: instructions(ours, n) - instructions(adam, n) for n in (32, 48, 64)}
    counts = sorted(extra)
    # The cost of one more leaf, between consecutive sizes: constant, not growing.
    marginal = [(extra[b] - extra[a]) / (b - a) for a, b in itertools.pairwise(counts)]
    print(f"instructions beyond plain Adam, by leaf count: {extra}; per added leaf: {marginal}")
    assert all(0 < m <= 1.1 * marginal[0] for m in marginal), marginal


@optax_promotion
@pytest.mark.parametrize("size", [SMALL, LARGE])
@pytest.mark.parametrize(
    "scale",
    [jmp.DynamicLossScale(2.0**4, period=2, hysteresis=2, warmup=True), jmp.StaticLossScale(4)],
)
def test_ensemble_under_vmap_one_member_overflows(size, scale):
    tx = jmp.loss_scaling(optax.adam(1e-2), scale)
    one = _params_of_size(size)
    stacked = jax.tree.map(lambda x: jnp.stack([x, 2 * x]), one)
    state = jax.vmap(tx.init)(stacked)  # a batched state unflattens: no re-validation
    grads = jax.tree.map(lambda x: jnp.stack([x, x]), _grads_of_size(0, size))
    grads["dense"]["w"] = grads["dense"]["w"].at[1, 1].set(jnp.inf)  # member 1 overflows

    @jax.jit
    def step(params, state, grads):
        def one_member(p, s, g):
            updates, s = tx.update(jmp.get_loss_scale(s).scale(g), s, p)
            return optax.apply_updates(p, updates), s

        return jax.vmap(one_member)(params, state, grads)

    new_params, new_state = step(stacked, state, grads)
    assert new_state.last_step_skipped.tolist() == [False, True]
    assert new_state.applied_steps.tolist() == [1, 0]
    # Member 1 is untouched bit for bit (params and Adam state); member 0 moved.
    member = lambda tree, i: jax.tree.map(lambda x: x[i], tree)  # noqa: E731
    chex.assert_trees_all_equal(member(new_params, 1), member(stacked, 1))
    chex.assert_trees_all_equal(member(new_state.inner_state, 1), member(state.inner_state, 1))
    assert not jnp.array_equal(new_params["out"]["w"][0], stacked["out"]["w"][0])
    flags = new_state.nonfinite_leaves
    assert flags.flags.shape == (2, 3) and flags.paths() == ("['dense']['w']",)
    if isinstance(scale, jmp.DynamicLossScale):
        assert new_state.loss_scale.loss_scale.shape == (2,)
        # Warm-up grows member 0; hysteresis 2 keeps member 1 for one bad step.
        assert new_state.loss_scale.loss_scale.tolist() == [32.0, 16.0]
    # The batched state runs again without recompiling, and a member of it,
    # taken out with a tree map that changes shapes, runs on its own.
    step(new_params, new_state, grads)
    assert step._cache_size() == 1
    single = member(new_state, 0)
    updates, _ = jax.jit(tx.update)(_grads_of_size(1, size), single, member(new_params, 0))
    assert jax.tree.structure(updates) == jax.tree.structure(one)


@optax_promotion
def test_states_stack_for_pipelines():
    tx = make_tx()
    states = [tx.init(make_params()) for _ in range(3)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)  # unflattens batched leaves
    assert stacked.loss_scale.loss_scale.shape == (3,)
    assert stacked.loss_scale.period == 3  # configuration survives as static metadata
    expanded = jax.tree.map(lambda x: x[None], states[0])
    assert expanded.loss_scale.counter.shape == (1,)
    restored = jax.tree.map(lambda x: x[1], stacked)
    chex.assert_trees_all_equal(restored, states[1])
