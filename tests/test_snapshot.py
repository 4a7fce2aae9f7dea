"""The characterisation snapshot (`snapshot.py`): the jaxpr readers and rewriters produce what
they produced when it was written. A change the redesign means to make is written again, under
the suite's settings (conftest: strict promotion, XLA flags), in the commit that makes it:

    JMP_WRITE_SNAPSHOT=1 python -m pytest tests/test_snapshot.py
"""

import json
import os

import jax
import pytest
import snapshot


def test_the_characterisation_snapshot_holds():
    if os.environ.get("JMP_WRITE_SNAPSHOT"):
        snapshot.main(["--write"])
    want = json.loads(snapshot.FILE.read_text())
    if want["jax"] != jax.__version__:
        pytest.skip(f"the snapshot was written with jax {want['jax']}, this is {jax.__version__}")
    got = json.loads(json.dumps(snapshot.main([])))  # the same rounding and key types
    for part in ("autocast", "report", "debug"):
        assert got[part].keys() == want[part].keys(), part
        for name in want[part]:
            assert got[part][name] == want[part][name], f"{part}: {name}"
