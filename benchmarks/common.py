"""Timing helpers shared by the benchmarks: medians of repeated jitted calls."""

import platform
import time

import jax
import numpy as np


def xla_options(quick: bool) -> dict | None:
    """XLA options for a benchmark's ahead-of-time compiles.

    Quick (smoke-test) runs compile with XLA's backend (LLVM) optimisation off:
    about half the compile time of the tiny shapes, the same HLO and the same
    buffers (memory figures unchanged). Quick figures show that a benchmark
    runs; they measure nothing. Full runs use XLA's defaults (None).
    """
    if quick:
        return {"xla_backend_optimization_level": 0}
    # A full run times compiles: none may come from a persistent compilation cache
    # (JAX_COMPILATION_CACHE_DIR; the test suite sets one for its quick runs).
    jax.config.update("jax_enable_compilation_cache", False)
    return None


def median_seconds(fn, *args, repeats=30, warmup=3):
    """Median wall time of `fn(*args)` (already jitted), blocking on the result."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def interleaved_medians(fns: dict, args: dict, rounds=5, repeats=10):
    """Medians over interleaved rounds, so machine noise hits every candidate alike."""
    samples = {name: [] for name in fns}
    for name, fn in fns.items():  # first calls may retrace (weak types settling)
        for _ in range(3):
            jax.block_until_ready(fn(*args[name]))
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(median_seconds(fn, *args[name], repeats=repeats, warmup=1))
    return {name: float(np.median(s)) for name, s in samples.items()}


def machine() -> str:
    import flax
    import optax

    return (
        f"{platform.processor() or platform.machine()}, {jax.device_count()} x "
        f"{jax.devices()[0].device_kind}, python {platform.python_version()}, "
        f"jax {jax.__version__}, flax {flax.__version__}, optax {optax.__version__}"
    )
