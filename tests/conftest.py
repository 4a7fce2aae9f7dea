"""Shared test setup: strict dtype promotion, as a mixed-precision library needs.

An accidental float32 promotion is exactly the bug this library exists to
prevent, so every test runs with `jax_numpy_dtype_promotion="strict"`; the
global setting is restored afterwards.
"""

import jax
import pytest


@pytest.fixture(autouse=True)
def strict_dtype_promotion():
    with jax.numpy_dtype_promotion("strict"):
        yield
