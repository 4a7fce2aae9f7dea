"""Cost of a loss-scaled, skip-on-overflow Adam step on every model shape, as ratios to plain optax.

For each shape in `shapes.py` (an MLP, a GPT written as a loop of blocks at 12
and 24 layers, the same GPT under `nn.scan`, a CNN with BatchNorm, an NNX
GPT), every variant computes the same mixed_float16 loss and gradients, under
`jit` with parameters, optimizer state and batch statistics donated. They
differ in how the step is scaled, checked and skipped:

- plain optax: no scaling, no check (the baseline);
- plain optax, again: the baseline's step compiled and run a second time as
  its own variant (an A/A test): its ratios show how far this machine's noise
  alone moves a ratio in this run;
- optax.apply_if_finite: a dynamic scale outside, apply_if_finite inside;
- flax DynamicScale: its value_and_grad, then a select over params and state;
- jmp recipe: scale, unscale, all_finite, select_tree over params and state;
- hand-written cond: unscale, isfinite per leaf, `lax.cond` around the
  optimizer step and `apply_updates` (what a user writes in 15 lines);
- jmp_policy.loss_scaling: one optax transform;
- skip on the loss alone (floor): `loss_scaling`'s structure (scale, unscale,
  a `lax.cond` around the optimizer, `apply_updates` outside it) decided by
  the loss value alone, with no gradient check. Not a usable design (a finite
  loss with an overflowing gradient goes through): it is what the skip costs
  before any check.

Reports trace+compile time and XLA's compile time alone (each the best of
interleaved compilations), the median step time over interleaved rounds and
XLA's temp bytes (`memory_analysis()`), each as a ratio to plain optax in the
same run. `--sweep` adds compile time against the number of leaves (GPT loops
of 3 to 50 blocks: 53 to 805 leaves; the best of `--compiles` interleaved
compilations too) and draws it to a PNG.

    python benchmarks/bench_train_step.py [--quick] [--rounds 7] [--sweep PNG]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import shapes  # noqa: E402
from common import interleaved_medians, machine, xla_options  # noqa: E402

import jmp_policy  # noqa: E402

INITIAL_SCALE = 2.0**15
BASELINE = "plain optax"
AGAIN = "plain optax, again (noise)"
FLOOR = "skip on the loss alone (floor)"


def scaled_loss_grad(loss, scale, params, extra, batch):
    """Gradients of `scale.scale(loss)`, the new `extra` and the loss value (unscaled)."""

    def scaled(p, e, b):
        value, e = loss(p, e, b)
        return scale.scale(value), (e, value)

    grads, (extra, value) = jax.grad(scaled, has_aux=True)(params, extra, batch)
    return grads, extra, value


def loss_scaling_variant(jmp_module, optimizer, loss):
    """(init, step) of `jmp_module.loss_scaling` around `optimizer`: one optax transform.

    `jmp_module` is `jmp_policy` itself, or another revision of it
    (`bench_against_revision.py`).
    """
    tx = jmp_module.loss_scaling(optimizer, jmp_module.DynamicLossScale(INITIAL_SCALE))

    def step(params, opt_state, extra, batch):
        scale = jmp_module.get_loss_scale(opt_state)
        grads, extra, _ = scaled_loss_grad(loss, scale, params, extra, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, extra

    return tx.init, step


def spike_skipping_variant(optimizer, loss, skip_spikes=None):
    """`loss_scaling_variant` with the loss passed to `update` (`value=loss`) and, with
    `skip_spikes`, spike skipping on (`jmp_policy.scaling.SkipSpikes`)."""
    tx = jmp_policy.loss_scaling(
        optimizer, jmp_policy.DynamicLossScale(INITIAL_SCALE), skip_spikes=skip_spikes
    )

    def step(params, opt_state, extra, batch):
        scale = jmp_policy.get_loss_scale(opt_state)
        grads, extra, value = scaled_loss_grad(loss, scale, params, extra, batch)
        updates, opt_state = tx.update(grads, opt_state, params, value=value)
        return optax.apply_updates(params, updates), opt_state, extra

    return tx.init, step


def variants(optimizer, loss):
    """name -> (init(params) -> state, step(params, state, extra, batch) -> (params, state, extra))."""
    grad = jax.grad(loss, has_aux=True)

    def plain():
        # A new function object per call, so the A/A copy shares no trace or compile cache.
        def plain_step(params, opt_state, extra, batch):
            grads, extra = grad(params, extra, batch)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, extra

        return plain_step

    def with_scale(init):
        return lambda params: (init(params), jmp_policy.DynamicLossScale(INITIAL_SCALE))

    scaled_grad = functools.partial(scaled_loss_grad, loss)

    guarded = optax.apply_if_finite(optimizer, max_consecutive_errors=10**6)

    def aif_step(params, state, extra, batch):
        opt_state, scale = state
        grads, extra, _ = scaled_grad(scale, params, extra, batch)
        updates, opt_state = guarded.update(scale.unscale(grads), opt_state, params)
        scale = scale.adjust(opt_state.last_finite)
        return optax.apply_updates(params, updates), (opt_state, scale), extra

    def jmp_step(params, state, extra, batch):
        opt_state, scale = state
        grads, extra, _ = scaled_grad(scale, params, extra, batch)
        grads = scale.unscale(grads)
        finite = jmp_policy.all_finite(grads)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp_policy.select_tree(
            finite, (new_params, new_opt_state), (params, opt_state)
        )
        return params, (opt_state, scale.adjust(finite)), extra

    from flax.training.dynamic_scale import DynamicScale

    def flax_init(params):
        return optimizer.init(params), DynamicScale(scale=INITIAL_SCALE)

    def flax_step(params, state, extra, batch):
        opt_state, dyn = state
        dyn, finite, (_, extra), grads = dyn.value_and_grad(loss, has_aux=True)(
            params, extra, batch
        )
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp_policy.select_tree(
            finite, (new_params, new_opt_state), (params, opt_state)
        )
        return params, (opt_state, dyn), extra

    def cond_step(params, state, extra, batch):
        # What a user writes by hand: unscale, isfinite per leaf, lax.cond
        # around the optimizer step and the parameter update.
        opt_state, scale = state
        grads, extra, _ = scaled_grad(scale, params, extra, batch)
        grads = scale.unscale(grads)
        finite = jnp.stack([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]).all()

        def apply(params, opt_state):
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        params, opt_state = jax.lax.cond(finite, apply, lambda *a: a, params, opt_state)
        return params, (opt_state, scale.adjust(finite)), extra

    def floor_step(params, state, extra, batch):
        opt_state, scale = state
        grads, extra, value = scaled_grad(scale, params, extra, batch)
        finite = jnp.isfinite(value)

        def skip(grads, opt_state):
            return jax.tree.map(lambda g: jnp.full_like(g, -0.0), grads), opt_state

        updates, opt_state = jax.lax.cond(
            finite,
            lambda g, s: optimizer.update(g, s, params),
            skip,
            scale.unscale(grads),
            opt_state,
        )
        return optax.apply_updates(params, updates), (opt_state, scale.adjust(finite)), extra

    return {
        BASELINE: (optimizer.init, plain()),
        AGAIN: (optimizer.init, plain()),
        "optax.apply_if_finite": (with_scale(guarded.init), aif_step),
        "flax DynamicScale": (flax_init, flax_step),
        "jmp recipe": (with_scale(optimizer.init), jmp_step),
        "hand-written cond": (with_scale(optimizer.init), cond_step),
        "jmp_policy.loss_scaling": loss_scaling_variant(jmp_policy, optimizer, loss),
        FLOOR: (with_scale(optimizer.init), floor_step),
    }


class Runner:
    """Compiles a donated step once, then calls it on its own, fresh buffers."""

    def __init__(self, step, params, state, extra, batch, compiler_options=None):
        self.args = [params, state, extra]
        self.batch = batch
        start = time.perf_counter()
        lowered = jax.jit(step, donate_argnums=(0, 1, 2)).lower(params, state, extra, batch)
        traced = time.perf_counter()
        self.step = lowered.compile(compiler_options)
        end = time.perf_counter()
        self.compile_s = end - start  # trace, lower and XLA's compile
        self.xla_s = end - traced  # XLA's compile alone
        self.temp_bytes = self.step.memory_analysis().temp_size_in_bytes

    def __call__(self):
        self.args = list(self.step(*self.args, self.batch))
        return self.args[0]


def _fresh(tree):
    return jax.tree.map(lambda x: x.copy(), tree)


def compile_variants(shape, make_variants=variants, compiles=3, compiler_options=None):
    """({variant: Runner}, {variant: best compile s}, {variant: best XLA compile s}) for one shape.

    Every variant is compiled `compiles` times, each time from freshly made step
    functions (`make_variants(optimizer, loss)`), so no trace or compile cache
    is reused. Noise only ever adds time, so the best is the estimate of the
    cost (of the whole compile, and of XLA's part alone: the rest is tracing and
    lowering, in Python); each round starts with a different variant, so no
    variant always pays for coming first. `compiler_options` go to XLA
    (`common.xla_options`).
    """
    optimizer = optax.adam(1e-3)
    compile_s, xla_s, runners = {}, {}, {}
    for i in range(compiles):
        made = list(make_variants(optimizer, shape.loss).items())
        first = i * len(made) // compiles
        for name, (init, step) in made[first:] + made[:first]:
            params = _fresh(shape.params)
            runner = Runner(
                step, params, init(params), _fresh(shape.extra), shape.batch, compiler_options
            )
            compile_s.setdefault(name, []).append(runner.compile_s)
            xla_s.setdefault(name, []).append(runner.xla_s)
            runners.setdefault(name, runner)
    return runners, _best(compile_s), _best(xla_s)


def _best(times):
    return {name: min(seconds) for name, seconds in times.items()}


def _quick_variants(optimizer, loss):
    kept = (BASELINE, AGAIN, "jmp_policy.loss_scaling")
    return {n: v for n, v in variants(optimizer, loss).items() if n in kept}


def measure(shape, rounds=7, repeats=5, compiles=3, make_variants=variants, compiler_options=None):
    """{variant: (compile s, XLA compile s, step s, temp bytes)} for one shape: compile
    times as in `compile_variants`, step time the median over interleaved rounds."""
    runners, compile_s, xla_s = compile_variants(shape, make_variants, compiles, compiler_options)
    times = interleaved_medians(runners, {n: () for n in runners}, rounds=rounds, repeats=repeats)
    return {n: (compile_s[n], xla_s[n], times[n], r.temp_bytes) for n, r in runners.items()}


def table(results, title="Train step on every model shape: mixed_float16, Adam, jit + donation"):
    """One markdown table: a row per shape and variant, ratios to plain optax."""
    lines = [
        title,
        "",
        "Ratios to plain optax on the same shape in the same run (lower is better). Compile: "
        "trace, lower and XLA's compile; XLA: XLA's compile alone (the rest is tracing and "
        "lowering, in Python).",
        "",
        "| shape | leaves | variant | compile s | compile | XLA s | XLA | step ms | step "
        "| temp MiB | temp |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (shape_name, leaves), rows in results.items():
        c0, x0, t0, m0 = rows[BASELINE]
        for name, (c, x, t, m) in rows.items():
            lines.append(
                f"| {shape_name} | {leaves} | {name} | {c:.2f} | {c / c0:.2f}x | {x:.2f} | "
                f"{x / x0:.2f}x | {t * 1e3:.2f} | {t / t0:.2f}x | {m / 2**20:.1f} | "
                f"{m / max(m0, 1):.2f}x |"
            )
    return "\n".join(lines)


def sweep(
    layer_counts,
    names=(BASELINE, "optax.apply_if_finite", "jmp_policy.loss_scaling"),
    compiles=3,
    compiler_options=None,
):
    """[(leaves, {variant: best compile s})] for GPT loops of the given depths
    (`compile_variants`, restricted to `names`)."""

    def some_variants(optimizer, loss):
        return {n: v for n, v in variants(optimizer, loss).items() if n in names}

    points = []
    for layers in layer_counts:
        shape = shapes.gpt(layers=layers, dim=16, length=8, batch=2)
        _, compile_s, _ = compile_variants(shape, some_variants, compiles, compiler_options)
        points.append((shape.leaves, compile_s))
        print(
            f"  {shape.leaves} leaves: " + ", ".join(f"{n} {s:.1f}s" for n, s in compile_s.items())
        )
    return points


def sweep_table(points) -> str:
    names = list(points[0][1])
    lines = [
        "Compile time against the number of leaves (GPT loop, trace + compile of the train step)",
        "",
        "| leaves | " + " | ".join(f"{n} s" for n in names) + " | "
        + " | ".join(f"{n} ratio" for n in names[1:]) + " |",
        "|---|" + "---|" * (2 * len(names) - 1),
    ]  # fmt: skip
    for leaves, compile_s in points:
        base = compile_s[names[0]]
        lines.append(
            f"| {leaves} | "
            + " | ".join(f"{compile_s[n]:.2f}" for n in names)
            + " | "
            + " | ".join(f"{compile_s[n] / base:.2f}x" for n in names[1:])
            + " |"
        )
    return "\n".join(lines)


def plot(points, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    leaves = [p[0] for p in points]
    for name in points[0][1]:
        ax.plot(leaves, [p[1][name] for p in points], marker="o", label=name)
    ax.set_xlabel("parameter leaves (GPT loop of blocks)")
    ax.set_ylabel("trace + compile of the train step (s)")
    ax.set_title("Compile time against the number of leaves")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, for a smoke test")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compiles", type=int, default=3, help="compilations, the best one counts")
    parser.add_argument("--sweep", metavar="PNG", help="also sweep compile time over leaves")
    args = parser.parse_args(argv)
    rounds, repeats, compiles = (
        (1, 1, 1) if args.quick else (args.rounds, args.repeats, args.compiles)
    )
    options = xla_options(args.quick)
    results = {}
    for i, shape in enumerate(shapes.all_shapes(quick=args.quick)):
        print(f"{shape.name} ({shape.leaves} leaves) ...", flush=True)
        # The quick mode (a smoke test of this code) runs every variant on its first shape and,
        # on the others, what the shape's own code path needs: the baseline, its A/A copy
        # and loss_scaling.
        made = variants if not args.quick or i == 0 else _quick_variants
        results[(shape.name, shape.leaves)] = measure(
            shape, rounds=rounds, repeats=repeats, compiles=compiles,
            make_variants=made, compiler_options=options,
        )  # fmt: skip
    tables = [table(results)]
    if args.sweep:
        depths = (1, 2) if args.quick else (3, 6, 12, 25, 50)
        points = sweep(depths, compiles=compiles, compiler_options=options)
        plot(points, args.sweep)
        tables.append(sweep_table(points))
    print(machine())
    print("\n\n".join(tables))
    return tables, results


if __name__ == "__main__":
    main()
