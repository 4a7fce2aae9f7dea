"""Why loss scaling exists: float16 gradients of a small loss flush to zero.

Gradients below float16's smallest subnormal become 0, made visible. A small MLP regresses a target
with a *small* loss (the mean squared error times a loss weight of 1e-6, as
when a loss term is weighted down or averaged over many elements). In float16
the backward pass then carries values below float16's smallest subnormal
(6e-8), which become 0. Three runs, same seed, SGD with the learning rate
scaled up by the same factor:

- float32: the reference;
- mixed_float16 without loss scaling: most gradient entries are exactly 0 and
  the model does not learn;
- mixed_float16 with dynamic loss scaling: the gradients survive and the
  curve matches float32.

Prints the fraction of gradient entries that underflow (exactly 0 where
float32's are not) and writes a plot. About 12 s on 2 CPU cores:

    python examples/underflow.py [--steps 300] [--loss-weight 1e-6]
"""

from __future__ import annotations

import argparse
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_policy as jmp

RUNS = {
    "float32": ("float32", None),
    "float16, no loss scaling": ("mixed_float16", None),
    "float16 + dynamic loss scaling": ("mixed_float16", "dynamic"),
}


def make_task(key, n=512, d=16):
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (n, d))
    y = jnp.sin(x @ jax.random.normal(kw, (d, 1)))
    return x, y


def run(name, args, x, y, reference_grad_fn):
    policy_name, scaling = RUNS[name]
    model = jmp.linen.mixed_precision(
        nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(64), nn.relu, nn.Dense(1)]),
        jmp.get_policy(policy_name),
    )
    params = model.init(jax.random.key(0), x)["params"]
    scale = jmp.DynamicLossScale(2.0**15) if scaling else jmp.NoOpLossScale()
    tx = jmp.loss_scaling(optax.sgd(args.lr / args.loss_weight), scale)
    opt_state = tx.init(params)

    def loss_fn(params):
        return args.loss_weight * jnp.mean((model.apply({"params": params}, x) - y) ** 2)

    def grads_of(params, opt_state):
        s = jmp.get_loss_scale(opt_state)
        return s.unscale(jax.grad(lambda p: s.scale(loss_fn(p)))(params))

    @jax.jit
    def step(params, opt_state):
        s = jmp.get_loss_scale(opt_state)
        loss, grads = jax.value_and_grad(lambda p: s.scale(loss_fn(p)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        # Report the unweighted MSE, so all runs share one scale.
        return (
            optax.apply_updates(params, updates),
            opt_state,
            loss / s.loss_scale / args.loss_weight,
        )

    @jax.jit
    def underflow_fraction(params, opt_state):
        mine = jax.tree.leaves(grads_of(params, opt_state))
        reference = jax.tree.leaves(reference_grad_fn(params))
        lost = sum(jnp.sum((g == 0) & (r != 0)) for g, r in zip(mine, reference, strict=True))
        return lost / sum(g.size for g in mine)

    fractions, losses = [], []
    for i in range(args.steps):
        if i % 50 == 0:
            fractions.append(float(underflow_fraction(params, opt_state)))
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    return {
        "losses": losses,
        "underflow": float(np.mean(fractions)),
        "skipped": int(opt_state.skipped_steps),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--loss-weight", type=float, default=1e-6)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--out", default="demo_output")
    args = parser.parse_args(argv)

    x, y = make_task(jax.random.key(1))
    reference = jmp.linen.mixed_precision(
        nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(64), nn.relu, nn.Dense(1)]),
        jmp.get_policy("float32"),
    )

    def reference_grad_fn(params):
        # float32 gradients of the same loss at the same parameters.
        return jax.grad(
            lambda p: args.loss_weight * jnp.mean((reference.apply({"params": p}, x) - y) ** 2)
        )(params)

    results = {name: run(name, args, x, y, reference_grad_fn) for name in RUNS}
    base = results["float32"]["losses"][-1]
    print(
        f"loss weight {args.loss_weight:g}; float16's smallest subnormal is {float(jnp.finfo(jnp.float16).smallest_subnormal):.1e}\n"
    )
    print(
        f"{'run':<32}{'gradient entries flushed to 0':>31}{'final MSE':>11}{'vs float32':>12}{'skipped':>9}"
    )
    for name, r in results.items():
        final = r["losses"][-1]
        print(
            f"{name:<32}{100 * r['underflow']:>30.1f}%{final:>11.4f}{100 * (final / base - 1):>+11.1f}%{r['skipped']:>9}"
        )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, r), style in zip(results.items(), ("--", "-", ":"), strict=True):
        ax.plot(
            r["losses"], style, label=f"{name} ({100 * r['underflow']:.1f}% of gradients flushed)"
        )
    ax.set(
        xlabel="step",
        ylabel="mean squared error",
        yscale="log",
        title=f"A small loss (x{args.loss_weight:g}): float16 gradients underflow without scaling",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "underflow.png", dpi=120)
    plt.close(fig)
    print(f"\nplot: {out / 'underflow.png'}")
    return results


if __name__ == "__main__":
    main()
