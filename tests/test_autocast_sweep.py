"""autocast runs whatever a real loss contains: every jnp.linalg, jax.scipy.linalg
and jnp.fft function, applied to a half-precision matmul output."""

import inspect

import jax
import jax.extend
import jax.numpy as jnp
import jax.scipy.linalg
import numpy as np
import pytest

import jmp_policy as jmp
from jmp_policy._core.compat import jaxprs_in_params

N = 4
MODULES = {"jnp.linalg": jnp.linalg, "jax.scipy.linalg": jax.scipy.linalg, "jnp.fft": jnp.fft}


def _functions():
    for prefix, module in MODULES.items():
        for name in sorted(dir(module)):
            fn = getattr(module, name)
            if not name.startswith("_") and inspect.isfunction(fn):
                yield f"{prefix}.{name}", fn


def _operands():
    # Well conditioned (near 2 * identity, distinct eigenvalues), so float16
    # rounding of the matmul is not amplified by inverses or decompositions.
    w = 0.3 * jax.random.normal(jax.random.key(0), (N, N))
    x = 2 * jnp.eye(N) + 0.3 * jax.random.normal(jax.random.key(1), (N, N))
    return w, x


def _matrix(w, x):
    a = x @ w + x  # the matmuls autocast runs in float16: a stays float16
    return a @ a.T  # symmetric positive definite (a has full rank)


# Argument lists to try, in order; a function takes the first its float32 call accepts.
def _calls(a):
    b = a[:, :1] + 1
    return [(a,), (a, b), (a, a), (a[0],), (a, 2), (a[0], a[0])]


def _first_working_call(fn):
    w, x = _operands()
    reference_matrix = _matrix(w, x)
    for i, args in enumerate(_calls(reference_matrix)):
        try:
            jax.eval_shape(fn, *args)
        except Exception:  # noqa: BLE001 - a signature that does not fit
            continue
        return i
    return None


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from _all_eqns(sub)


CASES = [(name, fn) for name, fn in _functions()]


@pytest.mark.standard_promotion  # scipy.linalg helpers mix weak and strong types
@pytest.mark.parametrize("name, fn", CASES, ids=[c[0] for c in CASES])
def test_linalg_and_fft_on_a_half_precision_matmul(name, fn):
    which = _first_working_call(fn)
    if which is None:
        pytest.skip(f"{name}: no float32 call of the simple forms fits its signature")

    def loss(w, x):
        return fn(*_calls(_matrix(w, x))[which])

    w, x = _operands()
    traced = jmp.autocast(loss, "mixed_float16")
    jaxpr = jax.make_jaxpr(traced)(w, x)
    dots = [e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    assert dots and all(e.outvars[0].aval.dtype == jnp.float16 for e in dots[:2]), name
    out = jax.jit(traced)(w, x)
    # Reference: the same function in float32 on the float16-rounded matmul output.
    x16 = x.astype(jnp.float16)
    a16 = x16 @ w.astype(jnp.float16) + x16
    expected = fn(*_calls((a16 @ a16.T).astype(jnp.float32))[which])
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(expected), strict=True):
        got, want = np.asarray(got), np.asarray(want)
        assert got.shape == want.shape
        if np.issubdtype(want.dtype, np.inexact):
            np.testing.assert_allclose(got.astype(want.dtype), want, rtol=2e-2, atol=2e-2)
