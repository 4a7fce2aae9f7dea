"""Compile cost of the train step counted in instructions executed, not in seconds.

On a shared machine the seconds a compile takes move by 10-40% from run to run
(the A/A row of `bench_train_step.py`), more than the differences between
designs. The number of instructions the tracer and XLA execute to build a step
moves by about 1%: that is what this counts, with valgrind's callgrind.

Every variant of `bench_train_step.py` is traced and compiled once, in one
process run under callgrind, with counting on only around each compile
(`bench_train_step.Runner`: `jit` with donation, `lower`, `compile`). A warm-up
compile of plain optax comes first and is not reported (the first compile in a
process pays one-time costs). Every figure is a ratio to plain optax in the
same process; the A/A row, plain optax compiled again, shows the residual
noise.

Needs valgrind (`apt-get install valgrind`); a compile runs 50-100x slower
under it, so a shape with eight variants takes 15-70 minutes.

    python benchmarks/bench_compile_instructions.py [--shapes cnn,gpt_scan] [--quick]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import jax
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_train_step as bench  # noqa: E402
import shapes  # noqa: E402

_CHILD = "--child"
_COUNTING = "JMP_POLICY_UNDER_CALLGRIND"


def _callgrind(*command: str) -> None:
    # Sends a command (e.g. "--zero": zero the counters) to this process's callgrind;
    # a no-op when not run under callgrind by `measure`.
    if os.environ.get(_COUNTING):
        subprocess.run(
            ["callgrind_control", *command, str(os.getpid())],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )


def child(shape_name: str, quick: bool, only: list[str]) -> None:
    """Compiles every variant (or those in `only`) once for `shape_name`, a counter dump
    around each."""
    jax.config.update("jax_enable_compilation_cache", False)  # count compiles, not cache reads
    shape = shapes.by_name(shape_name, quick=quick)
    names = [n for n in bench.variants(optax.adam(1e-3), shape.loss) if not only or n in only]
    _callgrind("--instr=on")
    for k, name in enumerate([bench.BASELINE, *names]):  # the first is the warm-up
        # Built again for every compile: a new `step` function each time, so JAX's
        # tracing caches cannot hand the baseline the warm-up's trace.
        init, step = bench.variants(optax.adam(1e-3), shape.loss)[name]
        params = bench._fresh(shape.params)
        args = (params, init(params), bench._fresh(shape.extra), shape.batch)
        jax.block_until_ready(args)
        _callgrind("--zero")
        bench.Runner(step, *args)  # trace, compile (jit + donation) and memory_analysis
        _callgrind(f"--dump=compile{k}")
        print(f"{k} {name}", flush=True)


def read_dumps(out_file: str) -> dict[int, int]:
    """{k: instructions} from the callgrind dumps `out_file.N` that `child` triggered."""
    counts = {}
    for path in pathlib.Path(out_file).parent.glob(pathlib.Path(out_file).name + ".*"):
        text = path.read_text(errors="replace")
        label = re.search(r"^desc: Trigger: dump compile(\d+)$", text, re.M)
        total = re.search(r"^summary: (\d+)$", text, re.M)
        if label and total:
            counts[int(label.group(1))] = int(total.group(1))
    return counts


def measure(shape_name: str, quick: bool, only: list[str]) -> dict[str, int]:
    """{variant: instructions to trace and compile its step} for one shape (every variant,
    or plain optax and those in `only`)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        run = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--instr-atstart=no",
                f"--callgrind-out-file={out}",
                sys.executable,
                __file__,
                _CHILD,
                shape_name,
                "--quick" if quick else "--full",
                ";".join(only),
            ],
            cwd=tmp,
            env={**os.environ, _COUNTING: "1"},
            capture_output=True,
            text=True,
            check=False,
        )
        names = dict(line.split(" ", 1) for line in run.stdout.splitlines() if line[:1].isdigit())
        counts = read_dumps(out)
    if run.returncode != 0 or len(counts) != len(names):
        raise RuntimeError(f"callgrind run for {shape_name} failed:\n{run.stderr[-3000:]}")
    return {names[str(k)]: counts[k] for k in sorted(counts) if k > 0}


def table(results: dict[str, dict[str, int]]) -> str:
    lines = [
        "Compile cost of the train step in instructions executed (callgrind; trace + XLA compile)",
        "",
        "Ratios to plain optax on the same shape in the same process (lower is better), and to",
        "the floor (a bare skip with no gradient check): the target is `loss_scaling` within 1.1x",
        "of the floor at every shape.",
        "",
        "| shape | variant | instructions (G) | ratio | vs floor |",
        "|---|---|---|---|---|",
    ]
    for shape_name, counts in results.items():
        base = counts[bench.BASELINE]
        floor = counts.get(bench.FLOOR)
        for name, count in counts.items():
            vs_floor = f"{count / floor:.3f}x" if floor else ""
            lines.append(
                f"| {shape_name} | {name} | {count / 1e9:.2f} | {count / base:.3f}x | {vs_floor} |"
            )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="mlp,gpt,gpt24,gpt_scan,cnn,nnx")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, for a smoke test")
    parser.add_argument(
        "--variants", default="", help="';'-separated names (default: all); plain optax is kept"
    )
    args = parser.parse_args(argv)
    wanted = args.shapes.split(",")
    if not set(wanted) <= set(shapes.NAMES):
        raise ValueError(f"Unknown --shapes {args.shapes!r}; expected names among {shapes.NAMES}.")
    only = [n for n in args.variants.split(";") if n]
    known = list(bench.variants(optax.adam(1e-3), lambda *a: None))
    if set(only) - set(known):
        raise ValueError(f"Unknown --variants {args.variants!r}; expected names among {known}.")
    if only:
        only.append(bench.BASELINE)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind is not installed (e.g. `apt-get install valgrind`).")
    results = {}
    for shape_name in wanted:
        print(f"{shape_name} ...", flush=True)
        results[shape_name] = measure(shape_name, args.quick, only)
    text = table(results)
    print(text)
    return text, results


if __name__ == "__main__":
    if sys.argv[1:2] == [_CHILD]:
        child(sys.argv[2], sys.argv[3] == "--quick", [n for n in sys.argv[4].split(";") if n])
    else:
        main()
