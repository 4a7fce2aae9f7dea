"""bfloat16 parameters and Adam moments: memory, accuracy and speed against a float32 master.

Variants of one AdamW train step (the forward pass in bfloat16 in every one):

- float32 master: float32 parameters and moments (the baseline);
- bfloat16, round-to-nearest: `optax.adamw` straight on bfloat16 parameters (moments follow);
- stochastic / Kahan: `low_precision_optimizer(adamw, ...)` with bfloat16 moments;
- split: `low_precision_optimizer(adamw, "split")`, float32 moments (an exact float32 master).

Memory is bytes per parameter of what the compiled step keeps between steps (its arguments minus
the batch, from `memory_analysis()`). Accuracy is the final loss on the demo's character LM
(examples/demo.py) and the Linen CNN example (examples/linen_cnn.py), as a gap to the float32
master's. Step time is a median over interleaved rounds, as a ratio to the float32 master's.

A long run shows drift that only grows with steps (a 16-bit moment that stops following the
gradients): an MLP classifier (64-256-256-10) on scikit-learn's digits, AdamW at 5e-5, 1500 steps
of batch 128, two seeds, the held-out loss every 100 steps as a gap to the float32 master's
(`--long-plot`).

    python benchmarks/bench_low_precision.py [--steps 300] [--plot low_precision.png]
        [--long-steps 1500] [--long-plot low_precision_long.png] [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import interleaved_medians, machine, xla_options  # noqa: E402

import jmp_policy as jmp  # noqa: E402

BF16 = jnp.bfloat16
VARIANTS = (
    "float32 master",
    "bfloat16, round-to-nearest",
    "stochastic rounding",
    "Kahan",
    "split (exact)",
)


def load_example(name):
    spec = importlib.util.spec_from_file_location(name, HERE.parent / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def variant(name, lr):
    """(optimizer, parameter dtype) of a variant."""
    adamw = optax.adamw(lr)
    if name == "float32 master":
        return adamw, jnp.float32
    if name == "bfloat16, round-to-nearest":
        return adamw, BF16
    rounding = {"stochastic rounding": "stochastic", "Kahan": "kahan", "split (exact)": "split"}
    return jmp.low_precision_optimizer(adamw, rounding[name]), BF16


def cast_floating(tree, dtype):
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def char_lm_task(quick, steps):
    demo = load_example("demo")
    train_ids, val_ids, vocab = demo.load_text()
    length, batch = (16, 8) if quick else (64, 32)
    dim, layers = (32, 1) if quick else (128, 2)
    model = demo.LanguageModel(vocab, dim=dim, layers=layers, length=length)
    # bfloat16 compute, float32 LayerNorm and softmax; the parameter dtype is the variant's.
    mixed = jmp.linen.mixed_precision(
        model, jmp.get_policy("params=float32,compute=bfloat16,output=float32")
    )
    stream = demo.batches(train_ids, batch, length, seed=0)
    # Every variant trains on the same batches, in the same order.
    train = [next(stream) for _ in range(steps)]
    x, _ = train[0]
    params = mixed.init(jax.random.key(0), x)["params"]

    def loss_fn(params, extra, x, y):
        logits = mixed.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), extra

    val = demo.batches(val_ids, batch, length, seed=1)
    held_out = [next(val) for _ in range(4 if quick else 20)]
    return "character LM (examples/demo.py)", params, {}, loss_fn, lambda i: train[i], held_out


def cnn_task(quick, steps):
    example = load_example("linen_cnn")
    mixed = jmp.linen.mixed_precision(
        example.CNN(), jmp.get_policy("params=float32,compute=bfloat16,output=float32")
    )
    batch = 16 if quick else 64
    x, _ = example.make_batch(jax.random.key(0), batch)
    variables = mixed.init(jax.random.key(1), x)

    def loss_fn(params, extra, x, y):
        logits, updated = mixed.apply({"params": params, **extra}, x, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), updated

    held_out = [example.make_batch(jax.random.key(9999 + i), 256) for i in range(2)]
    return (
        "Linen CNN + BatchNorm (examples/linen_cnn.py)",
        variables["params"],
        {"batch_stats": variables["batch_stats"]},
        loss_fn,
        lambda i: example.make_batch(jax.random.key(100 + i), batch),
        held_out,
    )


class DigitsMLP:
    """64-256-256-10, ReLU: the long run's classifier (plain Linen, built on first use)."""

    def __new__(cls):
        import flax.linen as nn

        class MLP(nn.Module):
            @nn.compact
            def __call__(self, x):
                for width in (256, 256):
                    x = nn.relu(nn.Dense(width)(x))
                return nn.Dense(10)(x)

        return MLP()


def digits_task(quick, steps, seed):
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    order = np.random.default_rng(1234).permutation(len(labels))  # one held-out split
    images = (images[order] / 16.0).astype(np.float32)
    labels = labels[order].astype(np.int32)
    cut = len(labels) * 4 // 5
    train_x, train_y = jnp.asarray(images[:cut]), jnp.asarray(labels[:cut])
    mixed = jmp.linen.mixed_precision(
        DigitsMLP(), jmp.get_policy("params=float32,compute=bfloat16,output=float32")
    )
    params = mixed.init(jax.random.key(seed), train_x[:1])["params"]
    batch = 16 if quick else 128
    picks = np.random.default_rng(seed).integers(0, cut, (steps, batch))

    def loss_fn(params, extra, x, y):
        logits = mixed.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), extra

    held_out = [(jnp.asarray(images[cut:]), jnp.asarray(labels[cut:]))]
    batch_at = lambda i: (train_x[picks[i]], train_y[picks[i]])  # noqa: E731
    return f"digits MLP, seed {seed}", params, {}, loss_fn, batch_at, held_out


def long_run(quick, steps, lr, seeds=(0, 1), every=100, compiler_options=None):
    """Held-out loss gaps to the float32 master at every `every` steps, per variant and seed."""
    every = min(every, steps)
    gaps = {name: [] for name in VARIANTS}
    finals = {name: [] for name in VARIANTS}
    memory = {}
    for seed in seeds:
        task = digits_task(quick, steps, seed)
        curves = {}
        for name in VARIANTS:
            _, final, memory[name], _, curves[name] = train(
                task, name, steps, lr, compiler_options, eval_every=every
            )
            finals[name].append(final)
        base = np.asarray(curves["float32 master"])
        for name in VARIANTS:
            gaps[name].append(100 * (np.asarray(curves[name]) / base - 1))
    return gaps, finals, memory, every


def plot_long(gaps, every, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, per_seed in gaps.items():
        if name == "float32 master":
            continue
        runs = np.asarray(per_seed)
        x = every * np.arange(1, runs.shape[1] + 1)
        (line,) = ax.plot(x, runs.mean(axis=0), label=name)
        for run in runs:
            ax.plot(x, run, color=line.get_color(), alpha=0.3, linewidth=0.8)
    ax.axhline(0.0, color="grey", linewidth=0.5)
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set(
        title="digits MLP, AdamW 5e-5: held-out loss against the float32 master",
        xlabel="step",
        ylabel="held-out loss gap (%; mean of seeds, seeds faint)",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def make_step(tx, loss_fn):
    @jax.jit
    def step(params, opt_state, extra, x, y):
        (loss, extra), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, extra, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, extra, loss

    return step


def train(task, name, steps, lr, compiler_options=None, eval_every=None):
    _, params, extra, loss_fn, batch_at, held_out = task
    tx, dtype = variant(name, lr)
    params = cast_floating(params, dtype)
    opt_state = tx.init(params)
    batch = batch_at(0)
    # Compiled once, ahead of time: the same executable trains and reports its memory.
    lowered = make_step(tx, loss_fn).lower(params, opt_state, extra, *batch)
    step = lowered.compile(compiler_options)
    kept = step.memory_analysis().argument_size_in_bytes - sum(b.nbytes for b in batch)
    kept -= sum(x.nbytes for x in jax.tree.leaves(extra))
    bytes_per_param = kept / sum(x.size for x in jax.tree.leaves(params))
    evaluate = jax.jit(lambda p, e, x, y: loss_fn(p, e, x, y)[0])

    def held_out_loss():
        return float(np.mean([float(evaluate(params, extra, *b)) for b in held_out]))

    losses, checkpoints = [], []
    for i in range(steps):
        params, opt_state, extra, loss = step(params, opt_state, extra, *batch_at(i))
        losses.append(loss)
        if eval_every and (i + 1) % eval_every == 0:
            checkpoints.append(held_out_loss())
    final = held_out_loss()
    losses = np.asarray(jax.device_get(losses), np.float64)
    stepper = (step, (params, opt_state, extra, *batch))
    if eval_every:
        return losses, final, bytes_per_param, stepper, checkpoints
    return losses, final, bytes_per_param, stepper


def plot(curves, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4), squeeze=False)
    for ax, (title, by_variant) in zip(axes[0], curves.items(), strict=True):
        base = by_variant["float32 master"]
        window = max(1, len(base) // 20)
        kernel = np.ones(window) / window
        for name, losses in by_variant.items():
            gap = np.convolve(losses - base, kernel, mode="valid")
            ax.plot(gap, label=name)
        ax.axhline(0.0, color="grey", linewidth=0.5)
        ax.set(
            title=title,
            xlabel="step",
            ylabel=f"train loss minus float32 master's ({window}-step mean)",
        )
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300, help="character LM steps")
    parser.add_argument(
        "--cnn-steps",
        type=int,
        default=40,
        help="CNN steps (its loss is 0.015 by 40, 0.006 by 80: near 0, relative gaps grow)",
    )
    parser.add_argument("--tasks", default="lm,cnn", help="of lm, cnn, digits")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--plot", default=None, help="PNG of the loss gap to the float32 master")
    parser.add_argument("--long-steps", type=int, default=1500, help="steps of the digits run")
    parser.add_argument("--long-lr", type=float, default=5e-5)
    parser.add_argument("--long-plot", default=None, help="PNG of the long run's gap by step")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    args = parser.parse_args(argv)
    steps = {"lm": 4 if args.quick else args.steps, "cnn": 4 if args.quick else args.cnn_steps}
    tasks = {"lm": char_lm_task, "cnn": cnn_task, "digits": lambda q, n: digits_task(q, n, 0)}
    steps["digits"] = 4 if args.quick else args.steps

    rows, curves, results = [], {}, {}
    # The fast mode (the test suite's) runs this table on the long run's digits MLP only:
    # the same training, timing and table code as the LM and CNN, a third of the compile time.
    for key in ["digits"] if args.quick else args.tasks.split(","):
        task = tasks[key](args.quick, steps[key])
        title = task[0]
        finals, memory, steppers = {}, {}, {}
        curves[title] = {}
        for name in VARIANTS:
            losses, final, memory[name], steppers[name] = train(
                task, name, steps[key], args.lr, xla_options(args.quick)
            )
            curves[title][name] = losses
            finals[name] = final
        times = interleaved_medians(
            {n: s for n, (s, _) in steppers.items()},
            {n: a for n, (_, a) in steppers.items()},
            rounds=1 if args.quick else args.rounds,
            repeats=2 if args.quick else 10,
        )
        base = "float32 master"
        for name in VARIANTS:
            gap = 100 * (finals[name] / finals[base] - 1)
            rows.append((title, name, memory[name], finals[name], gap, times[name] / times[base]))
        results[title] = finals
    lines = [
        "Low-precision parameters and optimizer state: AdamW, bytes per parameter, final loss, step time",
        f"AdamW at learning rate {args.lr:g}, "
        + (
            f"{steps['digits']} steps (digits MLP), "
            if args.quick
            else f"{steps['lm']} steps (LM) and {steps['cnn']} (CNN), "
        )  # fmt: skip
        + "the forward pass in bfloat16 in every variant; "
        f"{machine()}. Bytes: what the compiled step keeps between steps (parameters and optimizer "
        "state), per parameter. Targets: stochastic <= 8, Kahan <= 10; final loss within 1% of the "
        "float32 master's.",
        "",
        "| task | variant | bytes/param | final held-out loss | vs float32 master | step time |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {t} | {n} | {b:.2f} | {f:.4f} | {g:+.2f}% | {r:.2f}x |" for t, n, b, f, g, r in rows
    ]
    if args.plot:
        plot(curves, args.plot)
        lines += ["", f"![loss gap to the float32 master]({pathlib.Path(args.plot).name})"]
    long_steps = 10 if args.quick else args.long_steps
    seeds = (0,) if args.quick else (0, 1)  # the quick mode: the same loop, one seed
    gaps, long_finals, long_memory, every = long_run(
        args.quick, long_steps, args.long_lr, seeds=seeds, every=5 if args.quick else 100,
        compiler_options=xla_options(args.quick),
    )  # fmt: skip
    lines += [
        "",
        f"Long run: MLP 64-256-256-10 on scikit-learn's digits, AdamW at {args.long_lr:g} "
        f"(weight decay 1e-4), {long_steps} steps of batch {16 if args.quick else 128}, bfloat16 "
        f"compute, seeds {' and '.join(map(str, seeds))}. Held-out loss against the float32 master's: the mean of the two "
        "seeds at the end, each seed, and the gap at the first checkpoint "
        f"(step {every}) and halfway, to show whether it grows with steps.",
        "",
        "| variant | bytes/param | final held-out loss | vs float32 master (mean) | seeds "
        f"| at step {every} | at step {every * (long_steps // every // 2 or 1)} |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in VARIANTS:
        runs = np.asarray(gaps[name])
        final_gaps = [
            100 * (f / b - 1)
            for f, b in zip(long_finals[name], long_finals["float32 master"], strict=True)
        ]
        half = max(runs.shape[1] // 2 - 1, 0)
        lines.append(
            f"| {name} | {long_memory[name]:.2f} | {np.mean(long_finals[name]):.4f} "
            f"| {np.mean(final_gaps):+.2f}% | {', '.join(f'{g:+.2f}%' for g in final_gaps)} "
            f"| {runs[:, 0].mean():+.2f}% | {runs[:, half].mean():+.2f}% |"
        )
        rows.append(("digits MLP (long run)", name, long_memory[name],
                     float(np.mean(long_finals[name])), float(np.mean(final_gaps)), float("nan")))  # fmt: skip
    if args.long_plot:
        plot_long(gaps, every, args.long_plot)
        lines += ["", f"![long-run gap by step]({pathlib.Path(args.long_plot).name})"]
    text = "\n".join(lines)
    print(text)
    return text, rows


if __name__ == "__main__":
    main()
