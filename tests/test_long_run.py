"""A long run with planted bad batches and checkpoint restarts (issue 72's fault test).

2,000 steps of a small float16 regression model under `loss_scaling` with a dynamic scale and
spike skipping; 20 planted batches (NaN inputs, inf inputs, targets x1000). Exactly the planted
steps are skipped, each for its cause, and a run restarted from orbax checkpoints every 500
steps ends bit-identical to the uninterrupted one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_policy as jmp
from jmp_policy import scaling

# optax.adam mixes float and int32 in its bias correction; .ci/run runs the slow lane.
pytestmark = [pytest.mark.slow, pytest.mark.standard_promotion]

STEPS, RESTART_EVERY = 2000, 500
PLANTED = {  # step: what the batch holds
    **{s: "nan" for s in range(150, 2000, 300)},
    **{s: "inf" for s in range(250, 2000, 300)},
    **{s: "x1000" for s in range(350, 2000, 300)},
    1999: "inf",  # the last step
}
# What each planted batch can be skipped for: a NaN input reaches the loss; an inf input may
# not (tanh(inf) is 1) while its gradient is NaN; a target x1000 is a spike, or its gradients
# overflow float16 first at the current scale.
CAUSES = {
    "nan": {"non-finite loss"},
    "inf": {"non-finite loss", "non-finite gradients"},
    "x1000": {"spike", "non-finite gradients"},
}


def _batch(step: int):
    rng = np.random.default_rng(step)
    x = rng.normal(size=(32, 8)).astype(np.float32)
    y = np.sin(x.sum(axis=1)).astype(np.float32)
    kind = PLANTED.get(step)
    if kind == "nan":
        x[3, 2] = np.nan
    elif kind == "inf":
        x[5, 1] = np.inf
    elif kind == "x1000":
        y = y * 1000
    return jnp.asarray(x), jnp.asarray(y)


def _loss(params, x, y):
    h = jnp.tanh(x.astype(jnp.float16) @ params["w1"].astype(jnp.float16))
    pred = (h @ params["w2"].astype(jnp.float16)).astype(jnp.float32)[:, 0]
    return jnp.mean((pred - y) ** 2)


TX = jmp.loss_scaling(
    optax.adam(3e-3),
    jmp.DynamicLossScale(2.0**15, period=200),
    skip_spikes=scaling.SkipSpikes(warmup=100),
)


@jax.jit
def _step(params, opt_state, x, y):
    loss, grads = jmp.value_and_scaled_grad(_loss)(opt_state, params, x, y)
    updates, opt_state = TX.update(grads, opt_state, params, value=loss)
    return optax.apply_updates(params, updates), opt_state


def _run(start, params, opt_state, stop):
    skipped = {}
    for step in range(start, stop):
        before = (int(opt_state.skip_causes.sum()), params)
        params, opt_state = _step(params, opt_state, *_batch(step))
        if bool(opt_state.last_step_skipped):
            skipped[step] = scaling.SKIP_CAUSES[int(opt_state.last_skip_cause) - 1]
            # A skip changes no parameter, bit for bit.
            assert jax.tree.all(jax.tree.map(jnp.array_equal, params, before[1]))
    return params, opt_state, skipped


def test_a_long_run_skips_exactly_the_planted_batches_and_restarts_bit_identically(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    keys = jax.random.split(jax.random.key(0))
    params = {
        "w1": jax.random.normal(keys[0], (8, 32)) / 3,
        "w2": jax.random.normal(keys[1], (32, 1)) / 6,
    }
    whole, whole_state, skipped = _run(0, params, TX.init(params), STEPS)
    assert sorted(skipped) == sorted(PLANTED)  # no healthy step skipped, no planted one taken
    assert all(skipped[s] in CAUSES[kind] for s, kind in PLANTED.items()), skipped
    report = jmp.loss_scaling_report(whole_state)
    assert report.skipped_steps == len(PLANTED) == 20
    assert report.applied_steps == STEPS - 20

    state = (params, TX.init(params))
    restarted: dict = {}
    checkpointer = ocp.StandardCheckpointer()
    for start in range(0, STEPS, RESTART_EVERY):
        *state, part = _run(start, *state, start + RESTART_EVERY)
        restarted.update(part)
        path = tmp_path / f"step_{start + RESTART_EVERY}"
        checkpointer.save(path, tuple(state))
        checkpointer.wait_until_finished()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tuple(state))
        state = checkpointer.restore(path, abstract)
    assert restarted == skipped
    leaves = jax.tree.leaves((whole, whole_state))
    assert all(
        np.array_equal(a, b) for a, b in zip(leaves, jax.tree.leaves(tuple(state)), strict=True)
    )
