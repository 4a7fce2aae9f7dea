"""autocast vs the same model with hand-written casts (Flax `dtype=` arguments).

A conv stem + transformer block + classifier, one jitted training step
(forward, backward, SGD). Both variants run their matmuls and convolutions in
the half dtype with float32 parameters; the hand-cast one also runs its
element-wise work in half precision where Flax's layers do (except LayerNorm
statistics). Reports the step time and the trace + compile time of autocast
as ratios to hand-cast, same run.

    python benchmarks/bench_autocast.py [--dtype bfloat16] [--dim 256] [--rounds 5]
"""

import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import optax

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from common import interleaved_medians, machine  # noqa: E402
from models import Classifier  # noqa: E402

import jmp_policy as jmp  # noqa: E402


def make_step(loss):
    @jax.jit
    def step(params, x, y):
        grads = jax.grad(loss)(params, x, y)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)

    return step


def run(dtype="bfloat16", dim=256, batch=16, length=64, rounds=5, repeats=5):
    half = jnp.dtype(dtype)
    x = jax.random.normal(jax.random.key(0), (batch, length, 32))
    y = jax.random.randint(jax.random.key(1), (batch,), 0, 16)
    plain = Classifier(dim, heads=8, classes=16, stem=True)
    hand = Classifier(dim, heads=8, classes=16, stem=True, dtype=half)
    params = plain.init(jax.random.key(2), x)["params"]

    def plain_loss(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(
            plain.apply({"params": params}, x), y
        ).mean()

    def hand_loss(params, x, y):
        logits = hand.apply({"params": params}, x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    policy = jmp.Policy(jnp.float32, half, jnp.float32)
    steps = {
        "hand-cast (Flax dtype=)": make_step(hand_loss),
        "jmp_policy.autocast": make_step(jmp.autocast(plain_loss, policy)),
    }
    compile_s = {}
    for name, step in steps.items():
        start = time.perf_counter()
        step.lower(params, x, y).compile()
        compile_s[name] = time.perf_counter() - start
    times = interleaved_medians(
        steps, {n: (params, x, y) for n in steps}, rounds=rounds, repeats=repeats
    )
    base = "hand-cast (Flax dtype=)"
    return [
        (
            name,
            times[name] * 1e3,
            times[name] / times[base],
            compile_s[name],
            compile_s[name] / compile_s[base],
        )
        for name in steps
    ]


def table(rows, dtype, dim) -> str:
    lines = [
        f"autocast vs hand-cast: conv + transformer block (dim {dim}), {dtype}, jit train step",
        "",
        "| variant | step ms | time ratio | trace+compile s | compile ratio |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {n} | {ms:.2f} | {r:.2f}x | {c:.2f} | {cr:.2f}x |" for n, ms, r, c, cr in rows]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    rows = run(args.dtype, args.dim, args.batch, rounds=args.rounds, repeats=args.repeats)
    text = table(rows, args.dtype, args.dim)
    print(machine())
    print(text)
    return text


if __name__ == "__main__":
    main()
