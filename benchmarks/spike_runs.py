"""Healthy, noisy training runs on which spike skipping must skip nothing (issue: spike
skipping that never hurts a healthy run), shared by `bench_spikes.py` and the tests.

Each run is `Run(init(seed) -> (params, batches), loss(params, batch, key))`, trained with
Adam: a classifier driven to a near-zero training loss at batch 16 (scikit-learn's digits), a
Gaussian negative log-likelihood whose loss goes below zero (heteroscedastic regression), and
an RL-style signed objective (a contextual bandit's policy-gradient surrogate, minus the mean
reward). `train` runs one with `loss_scaling` (optionally with spike skipping and planted
corrupted batches) and returns its losses, gradient norms, skips and held-out loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_policy as jmp


def _mlp_init(key, sizes):
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {
            "w": jax.random.normal(k, (a, b)) * np.sqrt(2.0 / a),
            "b": jnp.zeros(b),
        }
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def _mlp(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


# --- a classifier trained to a near-zero loss (digits, batch 16) ----------------------------


def _digits():
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    return x, data.target.astype(np.int32)


def digits_init(seed, steps, batch=16):
    x, y = _digits()
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(x))
    train, held = order[:1400], order[1400:]
    picks = rng.integers(0, len(train), (steps, batch))
    batches = (x[train][picks], y[train][picks])
    params = _mlp_init(jax.random.key(seed), [64, 128, 10])
    return params, batches, (x[held], y[held])


def digits_loss(params, batch, key):
    del key
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(_mlp(params, x), y).mean()


def digits_corrupt(batch):
    """Inputs x 30, labels shifted: a corrupted batch."""
    x, y = batch
    return x * 30.0, (y + 3) % 10


# --- a Gaussian NLL that goes negative (heteroscedastic regression, batch 32) --------------


def gaussian_init(seed, steps, batch=32):
    rng = np.random.default_rng(seed)

    def sample(n):
        x = rng.uniform(-2, 2, (n, 1)).astype(np.float32)
        noise = (0.05 + 0.2 * np.abs(x)) * rng.normal(size=(n, 1)).astype(np.float32)
        return x, (np.sin(3 * x) + noise).astype(np.float32)

    xs, ys = sample(steps * batch)
    batches = (xs.reshape(steps, batch, 1), ys.reshape(steps, batch, 1))
    params = _mlp_init(jax.random.key(seed), [1, 64, 64, 2])
    return params, batches, sample(2000)


def gaussian_loss(params, batch, key):
    del key
    x, y = batch
    out = _mlp(params, x)
    mean, log_var = out[:, :1], out[:, 1:]
    return jnp.mean(0.5 * (log_var + (y - mean) ** 2 * jnp.exp(-log_var)))


def gaussian_corrupt(batch):
    x, y = batch
    return x * 30.0, -y * 30.0


# --- an RL-style signed objective (a contextual bandit, batch 32) ---------------------------

_ARMS, _CONTEXT = 4, 8


def bandit_init(seed, steps, batch=32):
    rng = np.random.default_rng(seed)
    best = rng.normal(size=(_CONTEXT, _ARMS)).astype(np.float32)
    contexts = rng.normal(size=(steps, batch, _CONTEXT)).astype(np.float32)
    held = rng.normal(size=(2000, _CONTEXT)).astype(np.float32)
    params = _mlp_init(jax.random.key(seed), [_CONTEXT, 64, _ARMS])
    batches = (contexts, np.broadcast_to(best, (steps, *best.shape)), np.ones(steps, np.float32))
    return params, batches, (held, best)


def _rewards(context, best, actions, key):
    good = actions == jnp.argmax(context @ best, axis=-1)
    return jnp.where(good, 1.0, -0.3) + 0.3 * jax.random.normal(key, actions.shape)


def bandit_loss(params, batch, key):
    """The policy-gradient surrogate (as PPO's at ratio 1): its value is minus the batch's
    mean reward, negative once the policy is good; its gradient is REINFORCE's."""
    context, best, reward_scale = batch
    k1, k2 = jax.random.split(key)
    logits = _mlp(params, context)
    actions = jax.random.categorical(k1, jax.lax.stop_gradient(logits))
    rewards = reward_scale * _rewards(context, best, actions, k2)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), actions[:, None], axis=-1)[:, 0]
    ratio = jnp.exp(logp - jax.lax.stop_gradient(logp))
    return -jnp.mean(ratio * rewards)


def bandit_held_out(params, held):
    context, best = held
    probs = jax.nn.softmax(_mlp(params, context))
    good = jax.nn.one_hot(jnp.argmax(context @ best, axis=-1), _ARMS)
    return -jnp.mean(jnp.sum(probs * jnp.where(good > 0, 1.0, -0.3), axis=-1))


def bandit_corrupt(batch):
    """A reward bug: rewards x -30."""
    context, best, reward_scale = batch
    return context, best, -30.0 * reward_scale


@dataclasses.dataclass(frozen=True)
class Run:
    init: Callable[..., Any]
    loss: Callable[..., Any]
    corrupt: Callable[..., Any]
    held_out: Callable[..., Any]
    steps: int
    lr: float


RUNS = {
    "digits": Run(
        digits_init,
        digits_loss,
        digits_corrupt,
        lambda p, held: digits_loss(p, held, None),
        3000,
        1e-3,
    ),
    "gaussian nll": Run(
        gaussian_init,
        gaussian_loss,
        gaussian_corrupt,
        lambda p, held: gaussian_loss(p, held, None),
        2000,
        1e-3,
    ),
    "bandit": Run(bandit_init, bandit_loss, bandit_corrupt, bandit_held_out, 2000, 3e-3),
}


def train(
    name: str,
    seed: int,
    skip_spikes: jmp.scaling.SkipSpikes | None = None,
    corrupt_at: tuple[int, ...] = (),
) -> dict:
    """One run: its per-step losses and gradient norms (float32), the steps skipped as
    spikes, and the held-out loss at the end."""
    run = RUNS[name]
    params, batches, held = run.init(seed, run.steps)
    tx = jmp.loss_scaling(optax.adam(run.lr), jmp.NoOpLossScale(), skip_spikes=skip_spikes)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch, key):
        loss, grads = jax.value_and_grad(run.loss)(params, batch, key)
        updates, opt_state = tx.update(grads, opt_state, params, value=loss)
        norm = optax.tree.norm(grads)
        return optax.apply_updates(params, updates), opt_state, loss, norm

    losses, norms, skipped = [], [], []
    key = jax.random.key(seed + 1000)
    for i in range(run.steps):
        batch = jax.tree.map(lambda a, i=i: a[i], batches)
        if i in corrupt_at:
            batch = run.corrupt(batch)
        key, sub = jax.random.split(key)
        params, opt_state, loss, norm = step(params, opt_state, batch, sub)
        losses.append(float(loss))
        norms.append(float(norm))
        if bool(opt_state.last_step_skipped):
            skipped.append(i)
    return {
        "losses": np.array(losses),
        "norms": np.array(norms),
        "skipped": skipped,
        "held_out": float(run.held_out(params, held)),
        "report": jmp.loss_scaling_report(opt_state),
    }
