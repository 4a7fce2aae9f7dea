"""Runs every CPU benchmark and writes BENCHMARKS.md (never edit that file by hand).

Each figure is a ratio to a baseline measured in the same run, with the
machine and library versions recorded. The GPU benchmark runs too when a GPU
is present; otherwise BENCHMARKS.md says its figures are still to be measured.

    python benchmarks/run_all.py [--quick] [--out BENCHMARKS.md]
"""

import argparse
import contextlib
import datetime
import importlib.util
import io
import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def load(name):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def quietly(fn, *args):
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args)


def _markdown(section: str) -> str:
    lines = section.splitlines()
    return f"## {lines[0]}\n\n" + "\n".join(lines[1:]).strip()


def _replace_section(path: pathlib.Path, section: str) -> str:
    """`path` with the section of the same title replaced by `section` (inserted before the
    GPU section if absent), and a header line saying when it was measured alone."""
    title = section.splitlines()[0].split(":")[0]
    parts = path.read_text().rstrip("\n").split("\n\n## ")
    header, sections = parts[0], ["## " + p for p in parts[1:]]
    kept = [s for s in sections if not s.startswith(title)]
    at = next((i for i, s in enumerate(kept) if s.startswith("## GPU")), len(kept))
    kept.insert(at, section)
    when = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    note = f"The collectives section was re-run alone (`--only collectives`) on {when}."
    lines = [line for line in header.splitlines() if not line.startswith("The collectives section")]
    text = "\n".join([*lines, note]) + "\n\n" + "\n\n".join(kept) + "\n"
    path.write_text(text)
    print(f"wrote {path}")
    return text


def collectives(quick: bool) -> str:
    """`bench_collectives.py` on 4 forced CPU devices, in its own process (the device count is
    fixed when JAX starts). Quick: FSDP under Linen only, untimed."""
    flags = ["--layouts", "fsdp", "--integrations", "linen", "--reduce-dtypes", "float32"]
    xla = os.environ.get("XLA_FLAGS", "")  # kept (the suite's LLVM level, a user's own)
    env = {**os.environ, "XLA_FLAGS": f"{xla} --xla_force_host_platform_device_count=4".strip()}
    out = subprocess.run(
        [sys.executable, str(HERE / "bench_collectives.py"), *(flags if quick else ["--time"])],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    return out.stdout.strip()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument("--out", default=str(HERE.parent / "BENCHMARKS.md"))
    parser.add_argument(
        "--only",
        choices=["collectives"],
        help="run this section alone and replace it in --out (the others stay as measured)",
    )
    args = parser.parse_args(argv)
    quick = args.quick
    if args.only:
        return _replace_section(pathlib.Path(args.out), _markdown(collectives(quick)))

    import jax

    common = load("common")
    sections = []
    print("all_finite ...", flush=True)
    sections.append(
        quietly(
            load("bench_all_finite").main,
            ["--size", "100000", "--leaves", "100", "--rounds", "1"] if quick else [],
        )
    )
    print("train step on every model shape, and compile time against leaves ...", flush=True)
    png = pathlib.Path(args.out).with_name("compile_vs_leaves.png")
    (shapes_table, sweep_table), _ = quietly(
        load("bench_train_step").main, ["--sweep", str(png)] + (["--quick"] if quick else [])
    )
    sections.append(shapes_table)
    sections.append(sweep_table + f"\n\n![compile time against leaves]({png.name})")
    # Quick: one dtype (the benchmark's code is the same for both).
    for dtype in ("bfloat16",) if quick else ("bfloat16", "float16"):
        print(f"autocast {dtype} ...", flush=True)
        small = ["--dim", "16", "--batch", "2", "--rounds", "1", "--repeats", "1"] if quick else []
        sections.append(quietly(load("bench_autocast").main, ["--dtype", dtype, *small]))
    print("low-precision parameters and optimizer state ...", flush=True)
    lp_png = pathlib.Path(args.out).with_name("low_precision.png")
    long_png = pathlib.Path(args.out).with_name("low_precision_long.png")
    lp_args = ["--plot", str(lp_png), "--long-plot", str(long_png)] + (["--quick"] if quick else [])
    lp_text, _ = quietly(load("bench_low_precision").main, lp_args)
    sections.append(lp_text)
    print("collectives (4 forced CPU devices) ...", flush=True)
    sections.append(collectives(quick))
    if jax.default_backend() == "gpu" and not quick:
        print("GPU transformer ...", flush=True)
        sections.append(load("gpu_transformer").main([]))
    else:
        sections.append(
            "GPU: GPT-style transformer train step\n"
            "`benchmarks/gpu_transformer.py` (12 layers, d=768, seq 1024; float32 vs mixed_bfloat16 vs "
            "mixed_float16 + loss scaling vs mixed_float8; tokens/s, peak memory, speedup, and the "
            "fp8 GEMMs in the compiled step): **still to be measured** — "
            f"this run had no GPU (JAX backend: {jax.default_backend()})."
        )

    header = [
        "# Benchmarks",
        "",
        f"Generated by `python benchmarks/run_all.py{' --quick' if quick else ''}` on "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC. Do not edit by hand.",
        "",
        f"Machine: {common.machine()}; {os.cpu_count()} CPU cores.",
        "Times are medians over interleaved rounds (compile times: the best of interleaved "
        "compilations), each figure beside its ratio to a baseline measured in the same run.",
    ]
    if quick:
        header.append(
            "Quick mode: tiny shapes, one round, one compilation, the train steps compiled with "
            "XLA's backend optimisation off. These figures show that the suite runs; they "
            "measure nothing."
        )
    text = "\n".join(header) + "\n\n" + "\n\n".join(map(_markdown, sections)) + "\n"
    pathlib.Path(args.out).write_text(text)
    print(f"wrote {args.out}")
    return text


if __name__ == "__main__":
    main()
