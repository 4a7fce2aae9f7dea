"""Spike skipping (`loss_scaling(..., skip_spikes=SkipSpikes())`): what it skips, and its cost.

1. Healthy noisy runs (`spike_runs.py`: a classifier driven to a near-zero loss at batch 16,
   a Gaussian NLL that goes below zero, a policy-gradient objective), two seeds: with the
   default `SkipSpikes()` against the same run without spike skipping (skips, held-out loss),
   and with two corrupted batches planted (skipped exactly?).
2. The demo's character LM (examples/demo.py, `linen.mixed_precision("mixed_float16")`,
   dynamic loss scaling), two seeds: the run without spike skipping, the same with it on
   (which should skip nothing and end where it ends), and with a spike planted every 300
   steps (the loss, so its gradients, times 20 on that step), which should skip exactly
   those. Validation loss is the mean over 20 fixed held-out batches.
3. Step time of `loss_scaling` with the loss passed (`value=loss`) and spike skipping on,
   against the same without spike skipping, on the suite's shapes (`shapes.py`): medians over
   interleaved rounds, as `bench_train_step.py` measures them.

    python benchmarks/bench_spikes.py [--steps 2000] [--quick]
        [--healthy | --demo | --step-time (one table only)]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_policy as jmp

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
import bench_train_step  # noqa: E402
import demo  # noqa: E402
import shapes  # noqa: E402
import spike_runs  # noqa: E402

EVERY = 300
PLANTED = 20.0


def run_demo(steps: int, seed: int, planted: bool, batch=32, length=64, skip=True):
    train_ids, val_ids, vocab = demo.load_text()
    model = jmp.linen.mixed_precision(
        demo.LanguageModel(vocab, length=length), jmp.get_policy("mixed_float16")
    )
    data = demo.batches(train_ids, batch, length, seed=seed)
    params = model.init(jax.random.key(seed), next(data)[0])["params"]
    tx = jmp.loss_scaling(
        optax.chain(
            optax.clip_by_global_norm(1.0), optax.adamw(optax.cosine_decay_schedule(3e-3, steps))
        ),
        jmp.DynamicLossScale(2.0**15),
        skip_spikes=jmp.scaling.SkipSpikes() if skip else None,
    )
    opt_state = tx.init(params)

    def loss_fn(params, x, y, times):
        logits = model.apply({"params": params}, x).astype(jnp.float32)
        return times * optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(params, opt_state, x, y, times):
        loss, grads = jmp.value_and_scaled_grad(loss_fn)(opt_state, params, x, y, times)
        updates, opt_state = tx.update(grads, opt_state, params, value=loss)
        state = jmp.scaling.find_loss_scaling_state(opt_state)
        return (
            optax.apply_updates(params, updates),
            opt_state,
            state.last_skip_cause,
            (state.last_step_skipped),
        )

    spikes_at, other_skips = [], []
    for i in range(steps):
        times = PLANTED if planted and i > 0 and i % EVERY == 0 else 1.0
        params, opt_state, cause, skipped = step(params, opt_state, *next(data), jnp.float32(times))
        if bool(skipped):
            (spikes_at if int(cause) == 3 else other_skips).append(i)
        if i % 500 == 0:
            print(
                f"  demo seed {seed} {'planted' if planted else 'clean'} skip={skip}: step {i}",
                file=sys.stderr,
                flush=True,
            )
    evaluate = jax.jit(lambda p, x, y: loss_fn(p, x, y, 1.0))
    val = demo.batches(val_ids, batch, length, seed=1)
    val_loss = float(np.mean([float(evaluate(params, *next(val))) for _ in range(20)]))
    return val_loss, spikes_at, other_skips


def demo_table(steps: int) -> str:
    lines = [
        "| seed | run | spike skips | other skips | validation loss | vs without |",
        "|---|---|---|---|---|---|",
    ]
    for seed in (0, 1):
        without = run_demo(steps, seed, planted=False, skip=False)
        clean = run_demo(steps, seed, planted=False)
        spiky = run_demo(steps, seed, planted=True)
        planted_at = [i for i in range(1, steps) if i % EVERY == 0]
        runs = (("without spike skipping", without), ("clean", clean), ("planted", spiky))
        for name, (val, spikes, other) in runs:
            exact = (
                ""
                if name != "planted"
                else (
                    " (exactly the planted steps)"
                    if spikes == planted_at
                    else f" (planted {planted_at})"
                )
            )
            lines.append(
                f"| {seed} | {name} | {len(spikes)}{exact} | {len(other)} | {val:.4f} | "
                f"{100 * (val / without[0] - 1):+.2f}% |"
            )
    return "\n".join(lines)


def healthy_table(quick: bool = False) -> str:
    """Per healthy run and seed: steps skipped as spikes with the defaults, the held-out loss
    against the same run without spike skipping, and which of two planted corrupted batches
    were skipped."""
    lines = [
        "| run | seed | steps | spike skips (clean) | held-out, without / with | vs without "
        "| corrupted at | skipped |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, run in spike_runs.RUNS.items():
        for seed in (0,) if quick else (0, 1):
            without = spike_runs.train(name, seed)
            clean = spike_runs.train(name, seed, jmp.scaling.SkipSpikes())
            planted = (1000, run.steps - 1)
            corrupted = spike_runs.train(name, seed, jmp.scaling.SkipSpikes(), corrupt_at=planted)
            change = abs(clean["held_out"] / without["held_out"] - 1)
            lines.append(
                f"| {name} | {seed} | {run.steps} | {len(clean['skipped'])} | "
                f"{without['held_out']:.4f} / {clean['held_out']:.4f} | {100 * change:.2f}% | "
                f"{list(planted)} | {corrupted['skipped']} |"
            )
    return "\n".join(lines)


def step_time_table(quick: bool) -> str:
    def make(optimizer, loss):
        return {
            bench_train_step.BASELINE: bench_train_step.spike_skipping_variant(optimizer, loss),
            # The baseline compiled and run again as its own variant: this run's noise.
            bench_train_step.AGAIN: bench_train_step.spike_skipping_variant(optimizer, loss),
            "skip_spikes": bench_train_step.spike_skipping_variant(
                optimizer, loss, jmp.scaling.SkipSpikes()
            ),
        }

    lines = [
        "| shape | step time, skip_spikes / without | without, again / without (noise) |",
        "|---|---|---|",
    ]
    for shape in shapes.all_shapes(quick):
        results = bench_train_step.measure(shape, rounds=3 if quick else 7, make_variants=make)
        base = results[bench_train_step.BASELINE][2]
        again = results[bench_train_step.AGAIN][2] / base
        lines.append(f"| {shape.name} | {results['skip_spikes'][2] / base:.3f}x | {again:.3f}x |")
    return "\n".join(lines)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 301 demo steps")
    parser.add_argument("--step-time", action="store_true", help="only the step-time table")
    parser.add_argument("--healthy", action="store_true", help="only the healthy-runs table")
    parser.add_argument("--demo", action="store_true", help="only the demo's table")
    args = parser.parse_args(argv)
    steps = 301 if args.quick else args.steps
    if args.step_time or args.healthy or args.demo:
        tables = [
            step_time_table(args.quick) if args.step_time else None,
            healthy_table(args.quick) if args.healthy else None,
            demo_table(steps) if args.demo else None,
        ]
    else:
        tables = [healthy_table(args.quick), demo_table(steps), step_time_table(args.quick)]
    text = "\n\n".join(t for t in tables if t is not None)
    print(text)
    return text


if __name__ == "__main__":
    main()
