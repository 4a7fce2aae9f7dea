"""Multi-process training on loopback: 2 processes x 2 CPU devices, gloo collectives.

Marked `multiprocess` (deselect with `-m "not multiprocess"`); `.ci/run` runs it.
Every launch is bounded by a timeout and kills its workers on failure.
"""

import importlib.util
import pathlib
import sys
import time

import numpy as np
import pytest

# One worker runs them all (`--dist loadgroup`): the three launches happen once.
pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("multihost")]
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _example():
    spec = importlib.util.spec_from_file_location(
        "_example_multihost", ROOT / "examples" / "multihost.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run(*flags):
    return _example().main(
        ["--processes", "2", "--devices", "2", "--steps", "30", "--timeout", "100", *flags]
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    start = time.monotonic()
    checkpoints = tmp_path_factory.mktemp("ckpt")
    results = {
        "spmd": run("--checkpoint-dir", str(checkpoints), "--checkpoint-step", "15"),
        "resumed": run("--checkpoint-dir", str(checkpoints), "--resume"),
        "shard_map": run("--mode", "shard_map"),
    }
    results["seconds"] = time.monotonic() - start
    print(f"\nthree 2-process launches took {results['seconds']:.1f} s")
    return results


def test_every_process_takes_the_same_decisions(runs):
    reports = runs["spmd"]
    assert [r["process"] for r in reports] == [0, 1] and {r["devices"] for r in reports} == {4}
    for r in reports:
        assert r["skipped"] == [10, 20]  # NaN in process 1's data; an overflow for everyone
        assert r["scales"] == reports[0]["scales"]
        assert r["checksum"] == reports[0]["checksum"]  # bit-identical parameters
    scales = reports[0]["scales"]
    assert scales[10] == scales[9] / 2 and scales[20] == scales[19] / 2
    assert runs["seconds"] < 120


def test_shard_map_with_axis_name_matches_spmd(runs):
    spmd, mapped = runs["spmd"][0], runs["shard_map"]
    for r in mapped:
        assert r["skipped"] == spmd["skipped"] and r["scales"] == spmd["scales"]
        assert r["checksum"] == mapped[0]["checksum"]
    # The same math, summed in another order (SPMD sums each weight gradient at its
    # backward matmul, here pmean sums the finished gradients; both in float32), so 30
    # float16 Adam steps agree to rounding; a step applied differently would move them
    # by O(0.1).
    np.testing.assert_allclose(mapped[0]["params"], spmd["params"], rtol=1e-2, atol=1e-2)


def test_resume_from_orbax_checkpoint_is_bit_identical(runs):
    uninterrupted, resumed = runs["spmd"], runs["resumed"]
    for before, after in zip(uninterrupted, resumed, strict=True):
        assert after["first_step"] == 15
        assert after["skipped"] == [20]
        assert after["scales"] == before["scales"][15:]
        assert after["checksum"] == before["checksum"]
