"""all_finite over a 1,000-leaf pytree vs one isfinite().all() over one array.

Both hold 10M float32 values; the target is <= 1.5x. jmp's `all_finite`
(one reduction per leaf, then a stack) is measured beside ours when jmp is
installed.

    python benchmarks/bench_all_finite.py [--size 10000000] [--leaves 1000]
"""

import argparse
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import interleaved_medians, machine  # noqa: E402

import jmp_policy  # noqa: E402


def run(size=10_000_000, leaves=1000, rounds=5):
    single = jnp.ones((size,), jnp.float32)
    tree = [jnp.ones((size // leaves,), jnp.float32) for _ in range(leaves)]
    fns = {
        "baseline: isfinite(x).all(), one array": jax.jit(lambda x: jnp.isfinite(x).all()),
        "jmp_policy.all_finite, pytree": jax.jit(jmp_policy.all_finite),
    }
    args = {name: (single,) for name in fns}
    args["jmp_policy.all_finite, pytree"] = (tree,)
    try:
        import jmp

        fns["jmp.all_finite, pytree"] = jax.jit(jmp.all_finite)
        args["jmp.all_finite, pytree"] = (tree,)
    except ImportError:
        pass
    times = interleaved_medians(fns, args, rounds=rounds)
    base = times["baseline: isfinite(x).all(), one array"]
    rows = [(name, t * 1e3, t / base) for name, t in times.items()]
    return rows


def table(rows, size, leaves) -> str:
    lines = [
        f"all_finite: {leaves} leaves, {size:,} float32 values in total (jit, median)",
        "",
        "| what | ms | ratio to baseline |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {ms:.2f} | {ratio:.2f}x |" for name, ms, ratio in rows]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", type=int, default=10_000_000)
    parser.add_argument("--leaves", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    rows = run(args.size, args.leaves, args.rounds)
    text = table(rows, args.size, args.leaves)
    print(machine())
    print(text)
    return text


if __name__ == "__main__":
    main()
