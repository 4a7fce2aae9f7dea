"""Overhead of a loss-scaled, skip-on-overflow Adam step, as ratios to plain optax.

An MLP 512-1024-1024-1024-10, batch 256, Adam, `jit` with the parameters and
optimizer state donated. Every variant computes the same loss and gradients;
they differ in how the step is scaled, checked and skipped:

- plain optax: no scaling, no check (the baseline);
- jmp's recipe: scale, unscale, all_finite, select_tree over params and state;
- optax.apply_if_finite: a dynamic scale outside, apply_if_finite inside;
- Flax DynamicScale: its value_and_grad, then a select over params and state;
- jmp_policy.loss_scaling: one optax transform.

Reports the median step time and XLA's temp bytes
(`.lower(...).compile().memory_analysis()`), each as a ratio to plain optax
measured in the same run.

    python benchmarks/bench_train_step.py [--batch 256] [--width 1024] [--rounds 5]
"""

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import interleaved_medians, machine  # noqa: E402

import jmp_policy  # noqa: E402


def init_mlp(key, sizes):
    params = []
    keys = jax.random.split(key, len(sizes) - 1)
    for k, (n_in, n_out) in zip(keys, zip(sizes[:-1], sizes[1:], strict=True), strict=True):
        params.append({"w": jax.random.normal(k, (n_in, n_out)) / n_in**0.5, "b": jnp.zeros(n_out)})
    return params


def loss_fn(params, x, y):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    logits = x @ params[-1]["w"] + params[-1]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def variants(optimizer):
    """(name, init(params) -> state, step(params, state, x, y) -> (params, state))."""

    def plain_init(params):
        return optimizer.init(params)

    def plain_step(params, opt_state, x, y):
        grads = jax.grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def jmp_init(params):
        return optimizer.init(params), jmp_policy.DynamicLossScale(2.0**15)

    def jmp_step(params, state, x, y):
        opt_state, scale = state
        grads = jax.grad(lambda p: scale.scale(loss_fn(p, x, y)))(params)
        grads = scale.unscale(grads)
        finite = jmp_policy.all_finite(grads)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp_policy.select_tree(
            finite, (new_params, new_opt_state), (params, opt_state)
        )
        return params, (opt_state, scale.adjust(finite))

    guarded = optax.apply_if_finite(optimizer, max_consecutive_errors=10**6)

    def aif_init(params):
        return guarded.init(params), jmp_policy.DynamicLossScale(2.0**15)

    def aif_step(params, state, x, y):
        opt_state, scale = state
        grads = scale.unscale(jax.grad(lambda p: scale.scale(loss_fn(p, x, y)))(params))
        updates, opt_state = guarded.update(grads, opt_state, params)
        scale = scale.adjust(opt_state.last_finite)
        return optax.apply_updates(params, updates), (opt_state, scale)

    from flax.training.dynamic_scale import DynamicScale

    def flax_init(params):
        return optimizer.init(params), DynamicScale()

    def flax_step(params, state, x, y):
        opt_state, dyn = state
        dyn, finite, _, grads = dyn.value_and_grad(loss_fn)(params, x, y)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp_policy.select_tree(
            finite, (new_params, new_opt_state), (params, opt_state)
        )
        return params, (opt_state, dyn)

    scaled = jmp_policy.loss_scaling(optimizer, jmp_policy.DynamicLossScale(2.0**15))

    def ours_step(params, opt_state, x, y):
        scale = jmp_policy.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: scale.scale(loss_fn(p, x, y)))(params)
        updates, opt_state = scaled.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return {
        "plain optax": (plain_init, plain_step),
        "jmp recipe": (jmp_init, jmp_step),
        "optax.apply_if_finite": (aif_init, aif_step),
        "flax DynamicScale": (flax_init, flax_step),
        "jmp_policy.loss_scaling": (scaled.init, ours_step),
    }


class _Runner:
    """Calls a donated step repeatedly on its own, fresh buffers."""

    def __init__(self, step, params, state, x, y):
        self.step = jax.jit(step, donate_argnums=(0, 1))
        self.params, self.state, self.x, self.y = params, state, x, y
        start = time.perf_counter()
        compiled = self.step.lower(params, state, x, y).compile()
        self.compile_s = time.perf_counter() - start
        self.temp_bytes = compiled.memory_analysis().temp_size_in_bytes

    def __call__(self):
        self.params, self.state = self.step(self.params, self.state, self.x, self.y)
        return self.params


def run(batch=256, width=1024, rounds=5, repeats=10):
    sizes = [512, width, width, width, 10]
    key_params, key_x, key_y = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(key_x, (batch, sizes[0]))
    y = jax.random.randint(key_y, (batch,), 0, sizes[-1])
    runners = {}
    for name, (init, step) in variants(optax.adam(1e-3)).items():
        params = init_mlp(key_params, sizes)
        runners[name] = _Runner(step, params, init(params), x, y)
    times = interleaved_medians(
        runners, {name: () for name in runners}, rounds=rounds, repeats=repeats
    )
    base = runners["plain optax"]
    return [
        (
            name,
            times[name] * 1e3,
            times[name] / times["plain optax"],
            runners[name].temp_bytes / 2**20,
            runners[name].temp_bytes / base.temp_bytes,
            runners[name].compile_s / base.compile_s,
        )
        for name in runners
    ]


def table(rows, batch, width) -> str:
    lines = [
        f"Train step: MLP 512-{width}-{width}-{width}-10, batch {batch}, Adam, jit + donation",
        "",
        "| variant | step ms | time ratio | temp MiB | temp ratio | trace+compile ratio |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {name} | {ms:.2f} | {tr:.2f}x | {mib:.1f} | {mr:.2f}x | {cr:.2f}x |"
        for name, ms, tr, mib, mr, cr in rows
    ]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    rows = run(args.batch, args.width, args.rounds, args.repeats)
    text = table(rows, args.batch, args.width)
    print(machine())
    print(text)
    return text


if __name__ == "__main__":
    main()
