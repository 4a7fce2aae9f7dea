"""`loss_scaling` at another git revision against the working tree's, in one run.

"No worse than revision X" is a claim about two revisions, and figures from two
runs (or from two versions of a benchmark) cannot settle it on a noisy machine.
This script loads `jmp_policy` as it was at REV (`git archive`, imported under
another package name) next to the working tree's, and measures both
`loss_scaling` steps with `bench_train_step.measure`, plain optax as the
baseline and its A/A copy for the noise, on the same shapes in the same
process. The default shapes are the two MLPs: the suite's (mixed_float16) and
the float32 one the benchmarks used before the suite of shapes.

    python benchmarks/bench_against_revision.py REV [--shapes mlp,mlp_float32] [--quick]

Shapes: `shapes.NAMES` (mlp, mlp_float32, gpt, gpt24, gpt_scan, cnn, nnx). An old
revision may compile slowly on the GPT shapes (that is what issue 11 fixed).
"""

from __future__ import annotations

import argparse
import atexit
import io
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import types

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_train_step as bench  # noqa: E402
import shapes  # noqa: E402
from common import machine, xla_options  # noqa: E402

import jmp_policy  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_revision(rev: str) -> types.ModuleType:
    """`jmp_policy` as it was at git revision `rev`, as a package of its own name.

    Its files are extracted to a temporary folder (removed when Python exits)
    and every `jmp_policy` in them renamed, so its own imports (lazy ones too)
    stay inside it.

    Raises:
      ValueError: `rev` is not a revision of this repository that has `jmp_policy/`.
    """
    done = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "jmp_policy"], capture_output=True, check=False
    )
    if done.returncode != 0:
        raise ValueError(
            f"Expected a git revision of {ROOT} that has jmp_policy/ for `rev`, got {rev!r}: "
            + done.stderr.decode(errors="replace").strip()
        )
    sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", f"{rev}^{{commit}}"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    name = f"jmp_policy_at_{sha}"
    folder = pathlib.Path(tempfile.mkdtemp(prefix=f"{name}_"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as archive:
        archive.extractall(folder, filter="data")
    (folder / "jmp_policy").rename(folder / name)
    for path in (folder / name).rglob("*.py"):
        path.write_text(re.sub(r"\bjmp_policy\b", name, path.read_text()))
    sys.path.insert(0, str(folder))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(folder))


def revision_variants(old: types.ModuleType, label: str):
    """`make_variants` for `bench_train_step.measure`: plain optax (twice) and both loss_scalings."""

    def make(optimizer, loss):
        plain = bench.variants(optimizer, loss)
        return {
            bench.BASELINE: plain[bench.BASELINE],
            bench.AGAIN: plain[bench.AGAIN],
            f"loss_scaling at {label}": bench.loss_scaling_variant(old, optimizer, loss),
            "loss_scaling, working tree": bench.loss_scaling_variant(jmp_policy, optimizer, loss),
        }

    return make


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("rev", help="git revision to compare with, e.g. 17d6959 or HEAD~3")
    parser.add_argument("--shapes", default="mlp,mlp_float32", help=", ".join(shapes.NAMES))
    parser.add_argument("--quick", action="store_true", help="tiny shapes, for a smoke test")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--compiles", type=int, default=3)
    args = parser.parse_args(argv)
    chosen = args.shapes.split(",")
    unknown = sorted(set(chosen) - set(shapes.NAMES))
    if unknown:
        parser.error(f"unknown shapes {unknown}; choose from {', '.join(shapes.NAMES)}")
    old = load_revision(args.rev)
    label = old.__name__.removeprefix("jmp_policy_at_")
    rounds, repeats, compiles = (1, 1, 1) if args.quick else (args.rounds, 5, args.compiles)
    results = {}
    for key in chosen:
        shape = shapes.by_name(key, args.quick)
        print(f"{shape.name} ({shape.leaves} leaves) ...", flush=True)
        results[(shape.name, shape.leaves)] = bench.measure(
            shape, rounds=rounds, repeats=repeats, compiles=compiles,
            make_variants=revision_variants(old, label),
            compiler_options=xla_options(args.quick),
        )  # fmt: skip
    text = bench.table(results, f"loss_scaling at {label} (`{args.rev}`) and in the working tree")
    print(machine())
    print(text)
    return text, results


if __name__ == "__main__":
    main()
