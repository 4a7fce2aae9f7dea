"""jmp 0.0.4's own unit tests, run against jmp_policy.

The test files ship inside jmp's wheel (`jmp/_src/*_test.py`). Each is loaded
with its `from jmp._src import X as jmp` line pointed at `jmp_policy`, and its
test classes are collected here. The few tests that pin a jmp quirk or bug are
listed in `DIFFERENCES` with the reason (README: "Differences from jmp"); a
separate test checks that each of them really does fail against us, so the
list cannot go stale.
"""

import importlib.util
import pathlib
import re
import types
import unittest

import jax
import pytest

pytest.importorskip("absl.testing.parameterized")
_spec = importlib.util.find_spec("jmp")
if _spec is None:
    pytest.skip("jmp (a test extra) is not installed", allow_module_level=True)
_SRC = pathlib.Path(_spec.origin).parent / "_src"

DIFFERENCES = {
    # policy_test.py
    "test_str": "reads jmp's private `dtype_to_names` table; our str() is "
    "'params=float32,compute=float16,output=float32' and round-trips through get_policy",
    # loss_scale_test.py
    "test_static_empty_trees_StaticLossScale": "StaticLossScale(0): a zero scale is a "
    "ValueError here (it would turn every gradient into inf/NaN)",
    "test_dynamic_loss_scale_raises_type_error_on_int_loss_scale": "an int32 loss_scale "
    "array is a TypeError here, not a warning",
    "test_dynamic_loss_scale_raises_type_error_on_int_min_loss_scale": "an int32 "
    "min_loss_scale array is a TypeError here, not a warning",
    "test_select_tree_rejects_non_scalar": "a non-scalar predicate is a TypeError here, "
    "not an AssertionError",
}


@pytest.fixture(autouse=True)
def strict_dtype_promotion():
    # Overrides the suite-wide strict promotion: jmp's tests compare float16 with
    # float32 arrays with `assertEqual`, which only standard promotion allows.
    with jax.numpy_dtype_promotion("standard"):
        yield


def _difference(attr: str) -> str | None:
    """The listed difference for a test method, parameterized variants included."""
    for name, reason in DIFFERENCES.items():
        if attr == name or re.fullmatch(rf"{name}\d+", attr):
            return reason
    return None


def _load(name: str) -> types.ModuleType:
    source = (_SRC / f"{name}_test.py").read_text()
    original = f"from jmp._src import {name} as jmp"
    assert original in source, f"unexpected layout of jmp's {name}_test.py"
    source = source.replace(original, "import jmp_policy as jmp")
    module = types.ModuleType(f"jmp_{name}_test_against_jmp_policy")
    exec(compile(source, str(_SRC / f"{name}_test.py"), "exec"), module.__dict__)
    return module


def _jmp_cases():
    for module in (_load("policy"), _load("loss_scale")):
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, unittest.TestCase):
                yield value


def _split(case: type) -> tuple[type, dict]:
    """Returns `case` with the DIFFERENCES skipped, and those tests' functions."""
    skipped = {}
    attrs = {}
    for attr in dir(case):
        reason = _difference(attr)
        if reason is not None:
            skipped[attr] = getattr(case, attr)
            attrs[attr] = unittest.skip(f"differs from jmp: {reason}")(skipped[attr])
    return type(case.__name__, (case,), attrs), skipped


_CASES = [_split(case) for case in _jmp_cases()]
for _case, _ in _CASES:
    globals()[f"Jmp{_case.__name__}"] = _case
del _case


def test_every_listed_difference_exists_and_fails():
    found = {name: (case, fn) for case, skipped in _CASES for name, fn in skipped.items()}
    assert {next(k for k in DIFFERENCES if n.startswith(k)) for n in found} == set(DIFFERENCES)
    for name, (case, _) in found.items():
        result = unittest.TestResult()
        # Run the original (unskipped) method of jmp's class.
        unittest.TestSuite([case.__mro__[1](name)]).run(result)
        assert result.failures or result.errors, f"{name} passes: drop it from DIFFERENCES"


def test_jmp_tests_were_collected():
    names = [n for case, _ in _CASES for n in unittest.TestLoader().getTestCaseNames(case)]
    # jmp 0.0.4 (pinned) ships 97 test methods (counting its parameterized
    # cases); every one of them runs here, against jmp_policy.
    assert len(names) == 97, len(names)
    differing = [n for n in names if _difference(n)]
    assert len(differing) == 9, differing  # README's "Differences from jmp": 9 of them
