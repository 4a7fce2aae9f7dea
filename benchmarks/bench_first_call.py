"""The first call of a Flax model under a policy: how often the model runs, and its trace time.

The first call with each input signature checks the mixed program for float32 matmuls; it
should cost one run of the model's Python (`linen.mixed_precision` after `init`, the usual
TrainState way; `nnx.mixed_precision`), not one run for the check and another for the call.
Printed per model: the runs counted in the model's own `__call__`, and the first call's trace
time (`jax.make_jaxpr` of a fresh wrapper's first call, best of `--repeats`) as a ratio
against Flax's own `dtype=` model's trace, measured in the same run. CPU-only and Python-bound:
the ratio is the figure, not the seconds.

    python benchmarks/bench_first_call.py [--blocks 4 16] [--repeats 3]

With `--step`: the first trace of the train step's gradient (`jax.value_and_grad`) of deep
transformers (`--linen-blocks 12 24`, `--nnx-blocks 8 16`: half depth and full, to read how
it grows), under the Linen/NNX policy and under autocast, as ratios against the model's own
`dtype=bfloat16` recipe traced in the same run.

    python benchmarks/bench_first_call.py --step [--repeats 2]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import jmp_policy as jmp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from models import GPT, NNXGPT, Block  # noqa: E402

RUNS: list[str] = []


class CountedGPT(GPT):
    """`GPT`, counting the runs of its `__call__` (each is a trace)."""

    @nn.compact
    def __call__(self, tokens):
        RUNS.append("linen")
        return super().__call__(tokens)


class Stack(nn.Module):
    """`GPT` without a parameter of its own (its position embedding): every matmul is a
    Flax layer's, so the call runs without `cast_at_use`."""

    layers: int = 4
    dtype: Any = None

    @nn.compact
    def __call__(self, tokens):
        RUNS.append("linen")
        x = nn.Embed(64, 64, dtype=self.dtype)(tokens)
        for _ in range(self.layers):
            x = Block(dtype=self.dtype)(x)
        return nn.Dense(64, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))


class CountedNNXGPT(NNXGPT):
    def __call__(self, tokens):
        RUNS.append("nnx")
        return super().__call__(tokens)


def _runs(count: int) -> str:
    return f"{count} run" + ("s" if count != 1 else "")


def _best(fun, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fun()
        times.append(time.perf_counter() - start)
    return min(times)


def linen_row(blocks: int, repeats: int, stack: bool = False) -> str:
    tokens = jnp.zeros((2, 32), jnp.int32)
    if stack:
        model, own = Stack(blocks), Stack(blocks, jnp.bfloat16)
    else:
        model = CountedGPT(vocab=64, dim=64, length=32, layers=blocks)
        own = GPT(vocab=64, dim=64, length=32, layers=blocks, dtype=jnp.bfloat16)
    variables = model.init(jax.random.key(0), tokens)
    base = _best(lambda: jax.make_jaxpr(lambda v, t: own.apply(v, t))(variables, tokens), repeats)
    ratios, runs = {}, {}
    for case in ("after init", "without init"):
        times = []
        for _ in range(repeats):
            mixed = jmp.linen.mixed_precision(model, "mixed_bfloat16")
            if case == "after init":
                mixed.init(jax.random.key(0), tokens)
            RUNS.clear()
            start = time.perf_counter()
            jax.make_jaxpr(lambda v, t, m=mixed: m.apply(v, t))(variables, tokens)
            times.append(time.perf_counter() - start)
            runs[case] = len(RUNS)
        ratios[case] = min(times) / base
    name = "Linen blocks, no parameter of its own" if stack else "Linen GPT"
    return (
        f"| {name}, {blocks} blocks | {base * 1e3:.0f} ms | "
        f"{_runs(runs['after init'])}, {ratios['after init']:.2f}x | "
        f"{_runs(runs['without init'])}, {ratios['without init']:.2f}x |"
    )


def _nnx_own_recipe(blocks: int) -> tuple:
    """`nnx.split` of the NNX GPT with Flax's own `dtype=bfloat16` on every layer."""
    own = NNXGPT(64, 64, blocks, rngs=nnx.Rngs(0))
    for _, module in nnx.iter_graph(own):
        if isinstance(module, nnx.Module) and hasattr(module, "dtype"):
            module.dtype = jnp.bfloat16
    return nnx.split(own)


def nnx_row(blocks: int, repeats: int) -> str:
    tokens = jnp.zeros((2, 32), jnp.int32)
    graph, state = _nnx_own_recipe(blocks)
    base = _best(
        lambda: jax.make_jaxpr(lambda s, t: nnx.merge(graph, s)(t))(state, tokens), repeats
    )
    times = []
    for _ in range(repeats):
        model = jmp.nnx.mixed_precision(
            CountedNNXGPT(64, 64, blocks, rngs=nnx.Rngs(0)), "mixed_bfloat16"
        )
        graph2, state2 = nnx.split(model)
        RUNS.clear()
        start = time.perf_counter()
        jax.make_jaxpr(lambda s, t, g=graph2: nnx.merge(g, s)(t))(state2, tokens)
        times.append(time.perf_counter() - start)
    return (
        f"| NNX GPT, {blocks} blocks | {base * 1e3:.0f} ms | "
        f"{_runs(len(RUNS))}, {min(times) / base:.2f}x | |"
    )


def _loss_of(apply):
    return jax.value_and_grad(lambda v, t: jnp.mean(apply(v, t).astype(jnp.float32)))


def _first_trace(make_step, args, repeats: int) -> float:
    """The best of `repeats` first traces (`jax.make_jaxpr`) of a fresh `make_step()` (made
    before the clock starts)."""
    times = []
    for _ in range(repeats):
        step = make_step()
        start = time.perf_counter()
        jax.make_jaxpr(step)(*args)
        times.append(time.perf_counter() - start)
    return min(times)


def _linen_policy_step(model, tokens):
    """The Linen policy's gradient, its wrapper's `init` run first (the usual way: it learns
    the module paths there)."""
    mixed = jmp.linen.mixed_precision(model, "mixed_bfloat16")
    mixed.init(jax.random.key(0), tokens)
    return _loss_of(mixed.apply)


def _linen_step_row(blocks: int, repeats: int) -> str:
    tokens = jnp.zeros((2, 32), jnp.int32)
    model = GPT(vocab=64, dim=64, length=32, layers=blocks)
    own = GPT(vocab=64, dim=64, length=32, layers=blocks, dtype=jnp.bfloat16)
    args = (model.init(jax.random.key(0), tokens), tokens)
    base = _first_trace(lambda: _loss_of(own.apply), args, repeats)
    policy = _first_trace(lambda: _linen_policy_step(model, tokens), args, repeats)
    auto = _first_trace(
        lambda: _loss_of(jmp.autocast(model.apply, "mixed_bfloat16")), args, repeats
    )
    return (
        f"| Linen GPT, {blocks} blocks | {base * 1e3:.0f} ms | {policy / base:.2f}x | "
        f"{auto / base:.2f}x |"
    )


def _nnx_step_row(blocks: int, repeats: int) -> str:
    tokens = jnp.zeros((2, 32), jnp.int32)
    own_graph, own_state = _nnx_own_recipe(blocks)
    base = _first_trace(
        lambda: _loss_of(lambda s, t: nnx.merge(own_graph, s)(t)), (own_state, tokens), repeats
    )

    def nnx_policy_step():  # a fresh wrapped model each time (its programs are its own)
        mixed = jmp.nnx.mixed_precision(NNXGPT(64, 64, blocks, rngs=nnx.Rngs(0)), "mixed_bfloat16")
        graph = nnx.graphdef(mixed)
        return _loss_of(lambda s, t: nnx.merge(graph, s)(t))

    state = nnx.state(
        jmp.nnx.mixed_precision(NNXGPT(64, 64, blocks, rngs=nnx.Rngs(0)), "mixed_bfloat16")
    )
    policy = _first_trace(nnx_policy_step, (state, tokens), repeats)
    plain_graph, plain_state = nnx.split(NNXGPT(64, 64, blocks, rngs=nnx.Rngs(0)))
    auto = _first_trace(
        lambda: _loss_of(jmp.autocast(lambda s, t: nnx.merge(plain_graph, s)(t), "mixed_bfloat16")),
        (plain_state, tokens),
        repeats,
    )
    return (
        f"| NNX GPT, {blocks} blocks | {base * 1e3:.0f} ms | {policy / base:.2f}x | "
        f"{auto / base:.2f}x |"
    )


def step_rows(linen_blocks: list[int], nnx_blocks: list[int], repeats: int) -> list[str]:
    """The first trace of the train step's gradient (`jax.value_and_grad` of a mean of the
    logits), under the Linen/NNX policy and under autocast, against the model's own `dtype=`
    recipe (bfloat16 throughout, Flax's way), traced in the same run."""
    return [_linen_step_row(b, repeats) for b in linen_blocks] + [
        _nnx_step_row(b, repeats) for b in nnx_blocks
    ]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--step", action="store_true", help="the train step's gradient, deep models (below)"
    )
    parser.add_argument("--linen-blocks", type=int, nargs="+", default=[12, 24])
    parser.add_argument("--nnx-blocks", type=int, nargs="+", default=[8, 16])
    args = parser.parse_args(argv)
    if args.step:
        lines = [
            "| train step's gradient (2 x 32 tokens, d 64) | own dtype= trace | "
            "Linen/NNX policy | autocast |",
            "|---|---|---|---|",
            *step_rows(args.linen_blocks, args.nnx_blocks, args.repeats),
        ]
        text = "\n".join(lines)
        print(text)
        return text
    lines = [
        "| model (2 x 32 tokens, d 64) | Flax's own dtype= trace | first call (after init) | "
        "first call without an earlier run |",
        "|---|---|---|---|",
    ]
    for blocks in args.blocks:
        lines.append(linen_row(blocks, args.repeats))
        lines.append(linen_row(blocks, args.repeats, stack=True))
        lines.append(nnx_row(blocks, args.repeats))
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
