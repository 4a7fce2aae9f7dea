"""Tests for jmp_policy._loss_scaling.diagnostics: host-side reports on a `loss_scaling` state."""

import jax
import jax.numpy as jnp
import optax
import pytest
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


def test_report_fields_and_log_line():
    tx = jmp.loss_scaling(optax.sgd(0.1), jmp.DynamicLossScale(2.0**4, period=2))
    params = {"a": jnp.ones(3), "b": {"c": jnp.ones(2)}}
    state = tx.init(params)
    step = jax.jit(tx.update)
    report = jmp.loss_scaling_report(state)
    causes = {"non-finite loss": 0, "non-finite gradients": 0, "spike": 0}
    assert report == jmp.scaling.LossScalingReport(
        16.0, 0, 0, 0, False, False, (), skip_causes=causes
    )
    good = jax.tree.map(jnp.ones_like, params)
    for _ in range(2):
        _, state = step(good, state, params)
    bad = {"a": jnp.ones(3), "b": {"c": jnp.array([jnp.inf, 0.0])}}
    _, state = step(bad, state, params)
    report = jmp.loss_scaling_report(state)
    print(f"\n{report}")
    assert (report.applied_steps, report.skipped_steps, report.nonfinite_run) == (2, 1, 1)
    assert report.loss_scale == 16.0  # grew to 32 after 2 clean steps, halved on the skip
    assert report.last_step_skipped and report.nonfinite_paths == ("['b']['c']",)
    assert str(report) == (
        "loss scale 2^4; applied 2, skipped 1 (current run 1); the last step was skipped for "
        "non-finite gradients: the scaled gradients overflowed, which backing off the scale "
        "cures (normal now and then; a loss not passed to update as value=loss counts here "
        "too); last non-finite gradients in ['b']['c']"
    )
    _, state = step(good, state, params)
    report = jmp.loss_scaling_report(state)
    # The paths of the last skip are kept, but the log line stops naming them.
    assert report.nonfinite_paths == ("['b']['c']",) and not report.last_step_skipped
    assert "non-finite" not in str(report)


def test_report_through_train_state_and_chain():
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        jmp.loss_scaling(optax.adam(1e-3), jmp.DynamicLossScale(2.0**15)),
    )
    state = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx)
    report = jmp.scaling.check_loss_scaling(state)
    assert report.loss_scale == 2.0**15 and report.skipped_steps == 0
    with pytest.raises(ValueError, match="loss_scaling"):
        jmp.loss_scaling_report(optax.adam(1e-3).init({"w": jnp.ones(2)}))


def test_stuck_training_becomes_visible():
    tx = jmp.loss_scaling(optax.sgd(0.1), jmp.DynamicLossScale(4.0, min_loss_scale=1.0))
    params = {"enc": {"w": jnp.ones(2)}, "dec": {"w": jnp.ones(2)}}
    state = tx.init(params)
    step = jax.jit(tx.update)
    nan_loss_grads = {"enc": {"w": jnp.array([jnp.nan, 1.0])}, "dec": {"w": jnp.ones(2)}}
    for _ in range(5):
        _, state = step(nan_loss_grads, state, params)
    with pytest.warns(jmp.errors.PrecisionWarning, match="sits at its floor"):  # not yet an error
        report = jmp.scaling.check_loss_scaling(state, max_nonfinite_run=6)
    assert report.nonfinite_run == 5 and report.at_floor
    assert jmp.loss_scaling_report(state).nonfinite_paths == ("['enc']['w']",)
    _, state = step(nan_loss_grads, state, params)
    with pytest.raises(
        jmp.errors.NonFiniteLossError,
        match=r"6 consecutive steps .* at its floor.* \['enc'\]\['w'\]",
    ):
        jmp.scaling.check_loss_scaling(state, max_nonfinite_run=6)
    with pytest.raises(ValueError, match="`max_nonfinite_run`"):
        jmp.scaling.check_loss_scaling(state, max_nonfinite_run=0)


@pytest.mark.standard_promotion  # user code: optax mixes float and int
def test_a_scale_that_never_overflows_past_2_24_points_to_value_and_scaled_grad():
    # The misuse: plain jax.grad next to loss_scaling. The gradients are S times too small once
    # unscaled, never overflow, and the scale grows without bound; the run trains 2^15x slowly.
    tx = jmp.loss_scaling(optax.sgd(0.1), jmp.DynamicLossScale(2.0**15, period=1))
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    loss_fn = lambda p: jnp.sum(p["w"] ** 2)  # noqa: E731
    step = jax.jit(lambda p, s: tx.update(jax.grad(loss_fn)(p), s, p))
    with pytest.warns(jmp.errors.LossScalingWarning, match="value_and_scaled_grad"):  # at the trace
        _, state = step(params, state)
    for _ in range(8):  # 2^15 -> 2^24: not yet past it
        _, state = step(params, state)
    assert jmp.loss_scaling_report(state).hint is None
    _, state = step(params, state)
    report = jmp.loss_scaling_report(state)
    print(f"\n{report}")
    assert report.loss_scale == 2.0**25 and report.skipped_steps == 0
    assert "value_and_scaled_grad" in report.hint and "2^25" in report.hint
    assert "not computed from the scaled loss" in str(report)
    with pytest.warns(jmp.errors.PrecisionWarning, match="value_and_scaled_grad"):
        jmp.scaling.check_loss_scaling(state)
    # Done right, the same step has no hint: the scale is what the gradients' range allows.
    right = jax.jit(lambda p, s: tx.update(jmp.value_and_scaled_grad(loss_fn)(s, p)[1], s, p))
    state = tx.init(params)
    for _ in range(3):
        _, state = right(params, state)
    assert jmp.loss_scaling_report(state).hint is None
