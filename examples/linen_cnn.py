"""A Linen CNN with BatchNorm, trained with mixed_float16 + dynamic loss scaling.

The model is plain Flax; `jmp_policy.linen.mixed_precision` runs it with
float32 master weights, float16 convolutions and float32 BatchNorm (statistics
included), and `jmp_policy.loss_scaling` makes Adam skip overflowing steps.
The task is synthetic: which quadrant of a noisy 16x16 image holds a bright
square. About 20 s on 2 CPU cores:

    python examples/linen_cnn.py [--steps 150] [--policy mixed_float16]

`--policies` trains once per policy on the same batches, prints a table
(final loss, held-out accuracy, the float8 share of matmul FLOPs) and, with
`--out DIR`, draws the loss curves to DIR/cnn_loss_curves.png, e.g.
`--policies mixed_bfloat16,mixed_float8 --out cnn_output`: under
`mixed_float8` the hidden Dense layer multiplies in float8, the convolutions
and the 4-way head in bfloat16.
"""

import argparse
import pathlib
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import jmp_policy as jmp


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        for features in (16, 32):
            x = nn.Conv(features, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.relu(x)
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.Dense(64)(x.reshape((x.shape[0], -1))))
        return nn.Dense(4, name="head")(x)


def make_batch(key, batch=64):
    k_noise, k_label, k_pos = jax.random.split(key, 3)
    labels = jax.random.randint(k_label, (batch,), 0, 4)
    images = jax.random.normal(k_noise, (batch, 16, 16, 1))
    offsets = jax.random.randint(k_pos, (batch, 2), 0, 4)
    rows = (labels // 2) * 8 + offsets[:, 0]
    cols = (labels % 2) * 8 + offsets[:, 1]
    grid = jnp.arange(16)
    in_rows = (grid[None, :] >= rows[:, None]) & (grid[None, :] < rows[:, None] + 4)
    in_cols = (grid[None, :] >= cols[:, None]) & (grid[None, :] < cols[:, None] + 4)
    square = (in_rows[:, :, None] & in_cols[:, None, :]).astype(jnp.float32)
    return images + square[..., None], labels


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--policy", default="mixed_float16")
    parser.add_argument("--policies", help="comma-separated: train under each, print a table")
    parser.add_argument("--out", help="with --policies: a folder for the loss curves' PNG")
    args = parser.parse_args(argv)
    if args.policies:
        return compare(args.policies.split(","), args.steps, args.out)
    return train(args.policy, args.steps).accuracy


class Result(NamedTuple):
    policy: str
    final_loss: float  # mean over the last 20 steps
    accuracy: float  # held out
    fp8_share: float  # of matmul/conv FLOPs in a train step
    losses: tuple  # every step's loss


def compare(policies, steps, out=None):
    """Trains under each policy on the same data; prints and returns the results."""
    results = [train(name, steps, verbose=False) for name in policies]
    print(f"{'policy':16}{'final loss':>12}{'accuracy':>10}{'fp8 FLOPs':>11}")
    for r in results:
        print(f"{r.policy:16}{r.final_loss:>12.4f}{r.accuracy:>10.3f}{100 * r.fp8_share:>10.0f}%")
    if out:
        print(f"plot: {plot(results, pathlib.Path(out))}")
    return results


def plot(results, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        window = np.ones(10) / 10
        curve = np.convolve(np.asarray(r.losses), window, mode="valid")
        ax.plot(curve, label=f"{r.policy} (final {r.final_loss:.4f}, acc {r.accuracy:.3f})")
    ax.set(xlabel="step", ylabel="train loss (10-step mean)", title="Linen CNN, one seed")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    path = out / "cnn_loss_curves.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def train(policy_name, steps, verbose=True):
    policy = jmp.get_policy(policy_name)
    model = jmp.linen.mixed_precision(CNN(), policy)  # BatchNorm stays float32
    x, y = make_batch(jax.random.key(0))
    variables = model.init(jax.random.key(1), x)
    state = train_state.TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=jmp.loss_scaling(optax.adam(3e-3), jmp.DynamicLossScale(2.0**15, period=50)),
    )
    batch_stats = variables["batch_stats"]

    @jax.jit
    def train_step(state, batch_stats, x, y):
        scale = jmp.get_loss_scale(state)

        def loss_fn(params):
            logits, updates = state.apply_fn(
                {"params": params, "batch_stats": batch_stats}, x, mutable=["batch_stats"]
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return scale.scale(loss), (loss, updates["batch_stats"])

        grads, (loss, new_stats) = jax.grad(loss_fn, has_aux=True)(state.params)
        state = state.apply_gradients(grads=grads)
        # A skipped step keeps the old statistics too: nothing is lost.
        return state, jmp.unless_skipped(state, new_stats, batch_stats), loss

    @jax.jit
    def accuracy(state, batch_stats, x, y):
        logits = state.apply_fn(
            {"params": state.params, "batch_stats": batch_stats}, x, train=False
        )
        return (logits.argmax(-1) == y).mean()

    report = jmp.precision_report(train_step, state, batch_stats, x, y)
    losses = []
    for step in range(steps):
        x, y = make_batch(jax.random.key(100 + step))
        state, batch_stats, loss = train_step(state, batch_stats, x, y)
        losses.append(loss)
        if verbose and (step % 50 == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {float(loss):.4f}  {jmp.loss_scaling_report(state)}")
    x, y = make_batch(jax.random.key(9999), batch=512)
    acc = float(accuracy(state, batch_stats, x, y))
    dtypes = sorted({a.dtype.name for a in jax.tree.leaves(batch_stats)})
    if verbose:
        print(f"policy {policy}; batch_stats dtypes {dtypes}; held-out accuracy {acc:.3f}")
    losses = [float(v) for v in losses]
    final = float(np.mean(losses[-20:]))
    return Result(policy_name, final, acc, report.fp8_matmul_flop_share, tuple(losses))


if __name__ == "__main__":
    main()
