"""jmp_policy's main demo: one small transformer language model, three precisions.

A character-level Flax transformer learns Python's own language reference
(`pydoc_data.topics`, shipped with Python, so nothing is downloaded). The same
model with the same seed is trained three times:

- float32;
- mixed_float16: float16 matmuls, float32 master weights, float32 LayerNorm
  and softmax, and a dynamic loss scale that skips overflowing steps;
- mixed_bfloat16: the same in bfloat16 (no loss scaling needed).

It prints a summary table and writes two plots: the loss curves and the loss
scale's trajectory with skipped steps marked. About 2 minutes on 2 CPU cores (124 s measured):

    python examples/demo.py [--steps 300] [--policies float32,mixed_float16,mixed_bfloat16]
    python examples/demo.py --policies float32,mixed_bfloat16,mixed_float8  # float8 matmuls
    python examples/demo.py --policies mixed_float8 --fp8-scaling delayed  # TE's delayed scales
    python examples/demo.py --policies float32,mixed_float16 --advice  # debug_precision's overrides
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import textwrap
import time
from pydoc_data.topics import topics

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import jmp_policy as jmp


class Block(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x, mask):
        dim = x.shape[-1]
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
        h = nn.LayerNorm()(x)
        return x + nn.Dense(dim)(nn.gelu(nn.Dense(4 * dim)(h)))


class LanguageModel(nn.Module):
    """A small GPT: token + position embeddings, pre-norm blocks, tied-free head."""

    vocab: int
    dim: int = 128
    layers: int = 2
    heads: int = 4
    length: int = 64

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.dim)(tokens)
        x = x + self.param("position", nn.initializers.normal(0.02), (self.length, self.dim))
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.layers):
            x = Block(self.heads)(x, mask)
        return nn.Dense(self.vocab, name="head")(nn.LayerNorm()(x))


@dataclasses.dataclass
class Run:
    policy: str
    losses: list
    scales: list
    skipped_at: list
    val_loss: float = float("nan")
    step_ms: float = float("nan")
    half_share: float = 0.0
    fp8_share: float = 0.0
    cpu_widened: int = 0  # float32 matmuls only because XLA:CPU has no bf16 x bf16 -> f32 dot
    skipped: int = 0
    final_scale: float = 1.0


def load_text(val_fraction=0.1):
    text = "".join(topics[k] for k in sorted(topics))
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    ids = np.fromiter((lookup[c] for c in text), np.int32, len(text))
    cut = int(len(ids) * (1 - val_fraction))
    return ids[:cut], ids[cut:], len(chars)


def batches(ids, batch, length, seed):
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(ids) - length - 1, batch)
        window = np.stack([ids[s : s + length + 1] for s in starts])
        yield window[:, :-1], window[:, 1:]


def precision_advice(train_ids, vocab, args, dtype):
    """`debug_precision` on the float32 model and one batch: the report, its advice printed,
    its heat map written to `args.out`/precision_heat_map.png."""
    model = LanguageModel(vocab, length=args.length)
    x, y = next(batches(train_ids, 8, args.length, seed=0))
    params = model.init(jax.random.key(0), x)["params"]

    def loss_fn(params, x, y):
        logits = model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    report = jmp.debug_precision(loss_fn, params, x, y, dtype=dtype)
    advice = report.advice()
    print(f"advice for {dtype}: overrides {advice['overrides']}")
    print(f"  float32 islands {advice['islands']}")
    if getattr(args, "out", None):
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        print(f"  heat map: {report.plot(out / 'precision_heat_map.png')}")
    return report


def train(policy_name, train_ids, val_ids, vocab, args, overrides=None):
    policy = jmp.get_policy(policy_name)
    seed = getattr(args, "seed", 0)
    scaling = getattr(args, "fp8_scaling", "tensorwise")
    if scaling == "recipe":  # NVIDIA's NVFP4 training recipe, its draws from the run's seed
        scaling = jmp.nvfp4.Recipe(seed=seed)
    delayed = policy.compute_dtype.itemsize == 1 and (
        isinstance(scaling, jmp.nvfp4.Recipe) or scaling == "delayed"
    )
    if policy.compute_dtype.itemsize == 1:
        # float8 matmuls run through autocast, which scales each operand: from the operand
        # itself (tensorwise), or from earlier steps' amaxes (delayed: a state per matmul);
        # NVFP4's recipe keeps a key per matmul as its state.
        model = LanguageModel(vocab, length=args.length)
        exclude = getattr(args, "fp8_exclude", jmp.fp8.FP8_EXCLUDE)
        apply = jmp.autocast(model.apply, policy, fp8_scaling=scaling, fp8_exclude=exclude)
    else:
        model = jmp.linen.mixed_precision(
            LanguageModel(vocab, length=args.length),
            policy,
            jmp.linen.NORMS_IN_FLOAT32 if overrides is None else overrides,
        )
        apply = model.apply
    data = batches(train_ids, args.batch, args.length, seed=seed)
    x, _ = next(batches(train_ids, args.batch, args.length, seed=seed))
    params = model.init(jax.random.key(seed), x)["params"]
    if delayed:  # trained with the parameters: its gradient is its next value
        params = {"params": params, "fp8_state": apply.init_fp8_state({"params": params}, x)}
    if policy.compute_dtype == jnp.float16:
        # GradScaler's start (2^16) and a short period, so the scale's climb
        # and its back-offs show within a demo-length run.
        scale = jmp.DynamicLossScale(2.0**16, period=args.period)
    else:
        scale = jmp.NoOpLossScale()  # float32 and bfloat16 need none
    tx = jmp.loss_scaling(
        optax.chain(
            optax.clip_by_global_norm(1.0),
            optax.adamw(optax.cosine_decay_schedule(3e-3, args.steps)),
        ),
        scale,
    )
    opt_state = tx.init(params)

    def loss_fn(params, x, y):
        if delayed:
            logits = apply({"params": params["params"]}, x, fp8_state=params["fp8_state"])
        else:
            logits = apply({"params": params}, x)
        logits = logits.astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(params, opt_state, x, y):
        s = jmp.get_loss_scale(opt_state)

        def scaled_loss(p):
            loss = loss_fn(p, x, y)
            return s.scale(loss), loss

        grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        state = jmp.scaling.find_loss_scaling_state(opt_state)
        return (
            optax.apply_updates(params, updates),
            opt_state,
            loss,
            state.loss_scale.loss_scale,
            state.last_step_skipped,
        )

    run = Run(policy_name, [], [], [])
    report = jmp.precision_report(lambda p: jax.grad(loss_fn)(p, x, x), params)
    run.half_share = report.half_matmul_flop_share
    run.fp8_share = report.fp8_matmul_flop_share
    run.cpu_widened = sum("XLA:CPU" in why for _, _, why, _ in report.float32_matmuls)
    bar = tqdm(range(args.steps), desc=f"{policy_name:>15}", disable=args.quiet, ncols=110)
    history = []
    start = None
    for i in bar:
        if i == 1:
            jax.block_until_ready(params)
            start = time.perf_counter()  # after compilation
        params, opt_state, loss, scale_value, skipped = step(params, opt_state, *next(data))
        history.append((loss, scale_value, skipped))
        if i % 25 == 0 or i == args.steps - 1:
            # Wait for the device first: steps are dispatched asynchronously, so
            # the clock alone would count queued steps as done.
            jax.block_until_ready(loss)
            done = i  # steps finished since the clock started (after compiling)
            tokens_s = (
                done * args.batch * args.length / (time.perf_counter() - start) if done > 0 else 0.0
            )
            skipped_so_far = int(jmp.scaling.find_loss_scaling_state(opt_state).skipped_steps)
            bar.set_postfix(
                loss=f"{float(loss):.3f}",
                scale=f"{format_scale(float(scale_value)):>5}",
                skipped=f"{skipped_so_far:>3}",
                tok_s=f"{tokens_s:>7,.0f}",
            )
    jax.block_until_ready(params)
    run.step_ms = 1e3 * (time.perf_counter() - start) / max(args.steps - 1, 1)
    for i, (loss, scale_value, skipped) in enumerate(jax.device_get(history)):
        run.losses.append(float(loss))
        run.scales.append(float(scale_value))
        if bool(skipped):
            run.skipped_at.append(i)
    run.skipped = len(run.skipped_at)
    run.final_scale = run.scales[-1]
    evaluate = jax.jit(loss_fn)
    val = batches(val_ids, args.batch, args.length, seed=1)  # the same batches for every run
    run.val_loss = float(
        np.mean([float(evaluate(params, *next(val))) for _ in range(args.val_batches)])
    )
    return run


def format_scale(value: float) -> str:
    """A loss scale in fixed width: `2^20` for powers of two, else 3 significant digits."""
    exponent = math.log2(value) if value > 0 else None
    if exponent is not None and exponent.is_integer():
        return f"2^{exponent:.0f}"
    return f"{value:.3g}"


def smoothed(values, window=10):
    values = np.asarray(values)
    kernel = np.ones(min(window, len(values))) / min(window, len(values))
    return np.convolve(values, kernel, mode="valid")


def plot(runs, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, (ax, diff) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(2, 1))
    reference = next((r for r in runs if r.policy == "float32"), None)
    # The curves lie on top of each other: each precision has its own dash and markers, and
    # float32's wide line is drawn under them, so every one shows.
    styles = [("-", None), ("--", "o"), (":", "s"), ("-.", "^"), ((0, (5, 1, 1, 1)), "D")]
    for i, run in enumerate(runs):
        dash, marker = styles[i % len(styles)]
        wide = run is reference
        curve = smoothed(run.losses)
        every = max(1, len(curve) // 12)
        common = dict(linestyle=dash, marker=marker, markevery=every, markersize=4, color=f"C{i}")
        ax.plot(
            curve,
            label=f"{run.policy} (val {run.val_loss:.4f})",
            linewidth=3.0 if wide else 1.2,
            alpha=0.45 if wide else 1.0,
            **common,
        )
        if reference is not None and not wide:
            losses, base = np.asarray(run.losses), np.asarray(reference.losses)
            diff.plot(smoothed(100 * (losses - base) / base), label=run.policy, **common)
    ax.set(ylabel="train loss (10-step mean)", title="Same model, same seed, three precisions")
    ax.legend()
    diff.axhline(0.0, color="grey", linewidth=0.5)
    diff.set(xlabel="step", ylabel="vs float32's loss (%)")
    if len(diff.get_lines()) > 1:
        diff.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png", dpi=120)
    plt.close(fig)

    scaled = [r for r in runs if any(s != 1.0 for s in r.scales)]
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in scaled:
        ax.step(range(len(run.scales)), run.scales, where="post", label=f"{run.policy}: loss scale")
        ax.scatter(
            run.skipped_at,
            [run.scales[i] * 2 for i in run.skipped_at],
            marker="x",
            color="red",
            label=f"skipped step ({run.skipped})",
            zorder=3,
        )
    ax.set_yscale("log", base=2)
    ax.set(
        xlabel="step",
        ylabel="loss scale",
        title="Dynamic loss scale: grow after clean steps, back off on overflow",
    )
    if scaled:
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss_scale.png", dpi=120)
    plt.close(fig)
    return [out / "loss_curves.png", out / "loss_scale.png"]


def summary(runs) -> str:
    lines = [
        f"{'policy':<16}{'train loss':>11}{'val loss':>10}{'vs f32':>8}{'skipped':>9}{'final scale':>13}"
        f"{'step ms':>9}{'half matmul FLOPs':>19}"
        + (f"{'fp8 matmul FLOPs':>18}" if any(r.fp8_share for r in runs) else ""),
    ]
    base = next((r.val_loss for r in runs if r.policy == "float32"), None)
    for r in runs:
        rel = f"{100 * (r.val_loss / base - 1):+.1f}%" if base else "-"
        train_loss = float(np.mean(r.losses[-20:]))
        lines.append(
            f"{r.policy:<16}{train_loss:>11.4f}{r.val_loss:>10.4f}{rel:>8}{r.skipped:>9}{format_scale(r.final_scale):>13}"
            f"{r.step_ms:>9.1f}{100 * r.half_share:>18.0f}%"
            + (f"{100 * r.fp8_share:>17.0f}%" if any(r.fp8_share for r in runs) else "")
        )
    return "\n".join(lines)


def conclusion(runs) -> str:
    """What the run shows, in words, from its own figures."""
    base = next((r for r in runs if r.policy == "float32"), None)
    if base is None:
        return ""
    parts = []
    for r in runs:
        if r is base:
            continue
        gap = 100 * (r.val_loss / base.val_loss - 1)
        skips = f", skipping {r.skipped} overflowing steps" if r.skipped else ""
        parts.append(f"{r.policy} ended {gap:+.1f}% from float32's validation loss{skips}")
        if r.cpu_widened:
            parts.append(
                f"{r.policy}'s {r.cpu_widened} float32 matmuls are weight gradients this CPU "
                "cannot run as bfloat16 x bfloat16 -> float32 (jmp_policy.matmul widens their "
                "operands here); a GPU or TPU runs them in bfloat16"
            )
    speed = ", ".join(f"{r.policy} {r.step_ms:.0f} ms" for r in runs)
    backend = jax.default_backend()
    if backend == "cpu":
        timing = (
            f"Step times ({speed}) show no gain: CPUs have no fast half-precision matmuls, so on a "
            "CPU mixed precision saves memory, not time. Speed shows on a GPU or TPU: run "
            "benchmarks/gpu_transformer.py there."
        )
    else:
        timing = f"Step times on this {backend}: {speed}."
    return "What this run shows: " + "; ".join(parts) + ". " + timing


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument(
        "--period", type=int, default=25, help="loss-scale growth period (float16 run)"
    )
    parser.add_argument("--policies", default="float32,mixed_float16,mixed_bfloat16")
    parser.add_argument("--val-batches", type=int, default=20)
    parser.add_argument("--out", default="demo_output", help="folder for the PNG plots")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--seed", type=int, default=0, help="parameters and batch order")
    parser.add_argument(
        "--fp8-scaling",
        choices=("tensorwise", "delayed", "recipe"),
        default="tensorwise",
        help="mixed_float8's scales: from each operand (tensorwise) or from earlier steps' "
        "amaxes (delayed, TransformerEngine's recipe: a state trained with the parameters); "
        "recipe: mixed_nvfp4 as NVIDIA's NVFP4 training recipe (all three GEMMs of each "
        "linear layer in NVFP4, jmp_policy.nvfp4)",
    )
    parser.add_argument(
        "--advice",
        action="store_true",
        help="train the float16 policies with the overrides jmp.debug_precision advises "
        "instead of the default float32 norms",
    )
    args = parser.parse_args(argv)

    train_ids, val_ids, vocab = load_text()
    print(
        f"Python language reference: {len(train_ids):,} training / {len(val_ids):,} validation characters, "
        f"vocabulary {vocab}; {args.steps} steps of {args.batch}x{args.length} tokens per policy"
    )
    advised = None
    if args.advice:  # {module path: "float32"}: the advice's overrides, as they are
        advised = precision_advice(train_ids, vocab, args, "float16").advice()["overrides"]
    runs = [
        train(
            name.strip(),
            train_ids,
            val_ids,
            vocab,
            args,
            advised if jmp.get_policy(name.strip()).compute_dtype == jnp.float16 else None,
        )
        for name in args.policies.split(",")
    ]
    print()
    print(summary(runs))
    print()
    print(textwrap.fill(conclusion(runs), width=100))
    paths = plot(runs, pathlib.Path(args.out))
    print("\nplots: " + ", ".join(str(p) for p in paths))
    return runs


if __name__ == "__main__":
    main()
