"""The characterisation snapshot (`snapshot.py`): the jaxpr readers and rewriters produce what
they produced when it was written (floats within another CPU's rounding). A change the redesign
means to make is written again, under the suite's settings (conftest: strict promotion, XLA
flags), in the commit that makes it:

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
            _assert_matches(got[part][name], want[part][name], f"{part}: {name}")


# Statistics the debugger computes from values XLA may round differently on another CPU
# (seen: 0.01123 against 0.01122; 0.007937 against 0.0 for a fraction of a small tensor):
# floats within this tolerance. Programs, names, counts and structure compare exactly.
RTOL, ATOL = 2e-2, 1e-2


def _assert_matches(got, want, where: str) -> None:
    if isinstance(want, float) or (isinstance(got, float) and isinstance(want, int)):
        assert isinstance(got, (int, float)) and not isinstance(got, bool), where
        assert abs(got - want) <= ATOL + RTOL * abs(want), f"{where}: {got} against {want}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for key in want:
            _assert_matches(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_matches(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} against {want!r}"


def test_the_comparison_tolerates_rounding_only():
    """The tolerance takes another CPU's rounding, and nothing a change would make."""
    _assert_matches({"a": [0.01123, 3]}, {"a": [0.01122, 3]}, "x")
    _assert_matches(0.007937, 0.0, "x")
    for got, want in ((0.5, 0.25), ({"a": 1}, {"a": 2}), ("f16", "f32"), ([1.0], [1.0, 2.0])):
        with pytest.raises(AssertionError):
            _assert_matches(got, want, "x")
