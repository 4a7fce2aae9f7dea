"""loss_scaling across 8 (forced CPU) devices, in a subprocess.

The device count is fixed when JAX starts, so the checks run in a fresh
process with XLA_FLAGS=--xla_force_host_platform_device_count=8 while the rest
of the suite keeps one device.
"""

import json
import pathlib
import subprocess
import sys

import pytest
from forced_devices import env_with_devices

SCRIPT = pathlib.Path(__file__).with_name("multidevice_script.py")
# One worker runs them all (`--dist loadgroup`): the 8-device process starts once.
pytestmark = pytest.mark.xdist_group("multidevice")


@pytest.fixture(scope="module")
def results():
    out = subprocess.run(
        [sys.executable, str(SCRIPT)],
        env=env_with_devices(8), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_spmd_nan_in_one_shard_skips_everywhere(results):
    spmd = results["spmd"]
    assert spmd["devices"] == 8
    assert [i for i, s in enumerate(spmd["skipped"]) if s] == [3, 8]
    assert spmd["scales"][3] == spmd["scales"][2] / 2
    assert spmd["params_replicated"] and spmd["state_replicated"]


def test_shard_map_axis_name_agrees(results):
    # Row 37 of 64 is in device 4's shard of 8 rows.
    assert results["with_axis"]["skipped"] == [True] * 8
    assert results["without_axis"]["skipped"] == [i == 4 for i in range(8)]


def test_low_precision_optimizer_sharded_matches_one_device(results):
    for rounding, got in results["low_precision"].items():
        assert got == {"equal": True, "sharded": True, "dtype": "bfloat16"}, rounding


def test_a_spike_on_one_device_is_skipped_on_every_device(results):
    # SkipSpikes with axis_name: the statistics are averaged across devices, so the decision
    # and the running means are the same everywhere.
    spikes = results["spikes"]
    assert spikes["skipped"] == [True] * 8
    assert spikes["norms_equal"] and spikes["losses_equal"]
