"""NVFP4's training recipe on the demo's character LM: each part's effect on validation loss.

Trains `examples/demo.py`'s model (2 blocks, d=128, 300 steps of 32x64 tokens) with its own
`train`, under `mixed_bfloat16` (the baseline) and under `mixed_nvfp4` with
`jmp_policy.nvfp4.Recipe` (all three GEMMs of each linear layer in NVFP4; attention's products,
the embedding and the head in bfloat16), with each part switched off in turn, for each seed,
and prints the validation loss of each against bfloat16's of the same seed. Off a Blackwell
GPU the NVFP4 GEMMs are emulated (`jmp_policy.nvfp4`): the format's numbers, not its speed.

    python benchmarks/bench_nvfp4_recipe.py [--seeds 0,1] [--steps 300] [--only full,...]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numpy as np

import jmp_policy as jmp
from jmp_policy import nvfp4

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import demo  # noqa: E402

LAST_BLOCK = "Block_1"  # the demo's last of 2 blocks: 6 of its 12 linear layers
EXCLUDE = jmp.fp8.FP8_EXCLUDE  # the head and the embedding

VARIANTS = {
    # name: (what, policy, fp8_scaling, fp8_exclude)
    "full": ("the whole recipe, last block in bfloat16", "mixed_nvfp4", nvfp4.Recipe(),
             (*EXCLUDE, LAST_BLOCK)),
    "no_hadamard": ("without the Hadamard transform", "mixed_nvfp4",
                    nvfp4.Recipe(hadamard=False), (*EXCLUDE, LAST_BLOCK)),
    "no_sr": ("without stochastic rounding (gradients to nearest)", "mixed_nvfp4",
              nvfp4.Recipe(stochastic_rounding=False), (*EXCLUDE, LAST_BLOCK)),
    "no_2d": ("without 2D weight tiles (1x16 blocks)", "mixed_nvfp4",
              nvfp4.Recipe(weight_tiles=False), (*EXCLUDE, LAST_BLOCK)),
    "no_bf16_last": ("without the last block in bfloat16", "mixed_nvfp4", nvfp4.Recipe(),
                     EXCLUDE),
    "forward_only": ("forward GEMMs only (gradients in float32, straight through)",
                     "mixed_nvfp4", nvfp4.FORWARD_ONLY, (*EXCLUDE, LAST_BLOCK)),
    "first_block": ("the whole recipe, the first block in bfloat16 instead of the last",
                    "mixed_nvfp4", nvfp4.Recipe(), (*EXCLUDE, "Block_0")),
    "mlps_only": ("the whole recipe on the MLPs only (attention's projections in bfloat16)",
                  "mixed_nvfp4", nvfp4.Recipe(), (*EXCLUDE, "MultiHeadDotProductAttention_0")),
    "policy": ("'mixed_nvfp4' without the recipe (forward only, attention in NVFP4 too)",
               "mixed_nvfp4", "tensorwise", EXCLUDE),
}  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--only", default=",".join(VARIANTS))
    args = parser.parse_args(argv)
    train_ids, val_ids, vocab = demo.load_text()
    seeds = [int(s) for s in args.seeds.split(",")]
    names = args.only.split(",")
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; expected some of {sorted(VARIANTS)}")
    base = dict(steps=args.steps, batch=32, length=64, period=50, val_batches=20, quiet=True)
    losses: dict[str, list[float]] = {}
    for seed in seeds:
        run_args = argparse.Namespace(**base, seed=seed)
        start = time.perf_counter()
        losses.setdefault("bfloat16", []).append(
            demo.train("mixed_bfloat16", train_ids, val_ids, vocab, run_args).val_loss
        )
        print(f"seed {seed} bfloat16: {losses['bfloat16'][-1]:.4f} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
        for name in names:
            _, policy, scaling, exclude = VARIANTS[name]
            if isinstance(scaling, nvfp4.Recipe):
                scaling = nvfp4.Recipe(**{**scaling.__dict__, "seed": seed})
            variant = argparse.Namespace(**base, seed=seed, fp8_scaling=scaling,
                                         fp8_exclude=exclude)  # fmt: skip
            start = time.perf_counter()
            run = demo.train(policy, train_ids, val_ids, vocab, variant)
            losses.setdefault(name, []).append(run.val_loss)
            print(f"seed {seed} {name}: {run.val_loss:.4f} "
                  f"({100 * (run.val_loss / losses['bfloat16'][-1] - 1):+.2f}%, "
                  f"NVFP4 share of matmul FLOPs {run.fp8_share:.0%}, "
                  f"{time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
    print(f"\n| variant | {' | '.join(f'seed {s}' for s in seeds)} | NVFP4 vs bfloat16 (mean) |")
    print(f"|---|{'---|' * len(seeds)}---|")
    bf16 = np.asarray(losses["bfloat16"])
    print(f"| mixed_bfloat16 | {' | '.join(f'{v:.4f}' for v in bf16)} | |")
    for name in names:
        values = np.asarray(losses[name])
        gaps = 100 * (values / bf16 - 1)
        cells = " | ".join(f"{v:.4f} ({g:+.2f}%)" for v, g in zip(values, gaps, strict=True))
        print(f"| {VARIANTS[name][0]} | {cells} | {gaps.mean():+.2f}% |")


if __name__ == "__main__":
    main()
