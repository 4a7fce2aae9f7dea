"""Shared test setup: strict dtype promotion, as a mixed-precision library needs.

An accidental float32 promotion is exactly the bug this library exists to
prevent, so every test runs with `jax_numpy_dtype_promotion="strict"`; the
global setting is restored afterwards. Tests that run third-party code which
relies on standard promotion (optax's Adam bias correction and schedules mix
float and int32) are marked `standard_promotion`.
"""

import gc
import os
import pathlib
import shutil
import sys
import tempfile

# The suite checks behaviour, not generated-code speed, and its time goes to XLA
# compiles. Three code-generation settings cut them on CPU:
# - LLVM's optimisation level 0 (~30% off). It leaves XLA's HLO passes (fusion,
#   simplification, buffer assignment) as they are.
# - XLA:CPU's elemental emitter for fused loops instead of its MLIR fusion emitters:
#   each compile again about half (ResNet18's train step and init, 6.3 s -> 3.1 s; an
#   eager op, 24 ms -> 13 ms; the suite, 372 s -> 207 s). XLA fuses a few loops
#   differently with it: temp memory of the benchmark's quick train steps moved by -4% to
#   +5%. Tests compare programs compiled under the same settings. A claim that holds
#   only under XLA's default code generation (the split optimizer bit-identical to
#   float32 AdamW: two different programs) is tested with the default emitter
#   (`compile({"xla_cpu_use_fusion_emitters": True})`, test_low_precision.py).
# - The LLVM module compiled as one piece (`xla_cpu_parallel_codegen_split_count=1`), not
#   split for compiling on parallel threads: under `pytest -n 2` both cores are busy
#   anyway, and the split costs CPU time. tests/models.py's GPT (8 blocks) train step, in
#   fresh processes without the cache: 0.86-0.98 s of CPU time instead of 1.16-1.18 s (jax
#   0.8.3: 1.61 s instead of 1.96 s). It changes how the code is compiled, not the program.
# Set before JAX starts a backend; subprocesses inherit them; a setting given in XLA_FLAGS
# is kept. The benchmarks, run on their own, compile with XLA's defaults.
for _flag, _value in (
    ("xla_backend_optimization_level", "0"),
    ("xla_cpu_use_fusion_emitters", "false"),
    ("xla_cpu_parallel_codegen_split_count", "1"),
):
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{_flag}={_value}".strip()

# Tests repeat programs (the same model and step compiled by several tests, by
# the docs runner and by subprocesses): one XLA compilation cache, in a folder
# made for this run and removed after it, lets every worker and subprocess
# reuse a program another one compiled. Nothing is reused across runs. Every program is
# cached, the small ones too: the eager operations that every worker and subprocess compiles
# again add up (the suite: 415.0 s with a 0.2 s floor; 401.7 s with none and 7 more tests).
# JAX compresses what it writes with zstd where zstandard is installed (the test extra), else
# with zlib: the suite's writes took 18.2 s of CPU in all, against 22.8 s with zlib.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jmp_policy_xla_")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# CI (CI=true) runs each property test on the same examples every time (a seed derived from
# the test), so a failure there is the change's and reproduces; a developer's run draws new
# ones, which is how the cases in tests/test_bad_input.py were found.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# Shared test models (tests/models.py) are imported by name.
sys.path.insert(0, str(pathlib.Path(__file__).parent))

# Run only in its own subprocess (it needs 8 forced devices), never collected.
collect_ignore = ["multidevice_script.py"]


def pytest_unconfigure(config):
    # The process that made the cache folder (xdist's controller, or pytest without
    # xdist) removes it; xdist's workers inherited its name and leave it alone.
    if _OWN_CACHE and not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


def pytest_sessionfinish(session):
    # xdist gives a worker 5 s to finish after its last test, then interrupts it (execnet's
    # SIGINT), and the interrupt lands in a garbage-collection callback (JAX's, hypothesis's)
    # as an unraisable KeyboardInterrupt that pytest prints. What takes the time is collecting
    # the suite's objects (thousands of traced and compiled programs) on the way out: frozen,
    # they are left to the process's exit.
    if hasattr(session.config, "workerinput"):
        gc.freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    # After each test, what it left alive is collected and frozen (`gc.freeze`): Python's full
    # collections, which a trace's many short-lived cycles set off, then scan only what the
    # tests since made, not every program traced and compiled before in this worker. Measured
    # by `gc.callbacks` on test_nvfp4_policy.py and test_float8_reports.py in one process: full
    # collections took 5.6 s of 100 s; with this, those two and test_activations.py ran 6-7%
    # faster under `-n 2` (89.1 s -> 83.6 s, 83.2 s -> 76.9 s), at the same peak memory. The
    # cost: a frozen object that a cycle keeps is never freed once unreachable (what tests
    # leave alive is mostly JAX's caches, which live to the end).
    yield
    _release_lowered_programs()
    gc.collect()
    gc.freeze()


def _release_lowered_programs():
    """JAX keeps the last 2048 programs it lowered, each an MLIR module in an MLIR context of
    its own (about 1.1 MB each: 2,500 bare contexts took 3 GB), and every lowering gets
    slower as more are alive: a small function's `jit(...).lower`, 4.4-5.4 ms in a fresh
    process, 16-18 ms with 2,500 compiled functions alive. A worker keeps 2048 after about
    225 tests. Most programs the suite lowers are eager operations' (about 10,000 of 10,800
    compiles, counted earlier), and their compiled executables serve those operations from
    then on, not the lowered programs. Dropped after each test (JAX's two lowering
    caches; a later call that needs the program lowers it again), the suite under `-n 2`
    lowered 9,964 programs in 83.7 s of CPU against 9,627 in 146.4 s, traced and compiled
    as much (140.5 s / 141.9 s, 228.8 s / 223.9 s), and ran in 316.6 s against 340.6 s,
    back to back. Private names, present from jax 0.8.3 to 0.10.2: a release that renames
    them fails every test's teardown here."""
    from jax._src import pjit
    from jax._src.interpreters import pxla

    pjit._pjit_lower.cache_clear()
    pxla._cached_lowering_to_hlo.cache_clear()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "standard_promotion: run under JAX's default (standard) dtype promotion"
    )


@pytest.fixture(autouse=True)
def mistakes_said_afresh():
    """A mistake is said once per process (`_validation.warn_once_per_mistake`): each test
    starts as a fresh process would."""
    from jmp_policy._core import validation as _validation

    _validation._SAID.clear()
    yield


@pytest.fixture(autouse=True)
def strict_dtype_promotion(request):
    mode = "standard" if request.node.get_closest_marker("standard_promotion") else "strict"
    with jax.numpy_dtype_promotion(mode):
        yield


# The slowest tests (a minute or more on 2 cores) run first, so under
# `pytest -n 2` no worker is left running one of them alone at the end.
_SLOW_FIRST = ("test_run_all_benchmarks_quick", "test_demo_fast")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.name not in _SLOW_FIRST)  # stable: the rest keep their order
