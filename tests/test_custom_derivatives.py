"""Custom derivatives keep JAX's semantics under every route (issue 71, point 3): a
`custom_vjp` is differentiated only in the inputs its caller perturbs, so Equinox's
`filter_custom_vjp` (what diffrax's adjoints are built on), which checks that its
non-differentiable inputs stay unperturbed, trains under autocast, `eqx.mixed_precision` and
`precision_report`, with the gradient its own backward rule gives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jmp

eqx = pytest.importorskip("equinox")


@eqx.filter_custom_vjp
def _gated(weight, gate, x):
    """`tanh(x @ weight) * gate`; differentiable in `weight` only (Equinox's rule: the first
    argument), `gate` and `x` held constant."""
    return jnp.tanh(x @ weight) * gate


@_gated.def_fwd
def _gated_fwd(perturbed, weight, gate, x):
    del perturbed
    out = jnp.tanh(x @ weight)
    return out * gate, out


@_gated.def_bwd
def _gated_bwd(out, g, perturbed, weight, gate, x):
    del perturbed, weight
    # The rule written in float32 terms, as a user writes one: what it gets is what it keeps.
    return x.T @ (g * gate * (1 - out * out)).astype(x.dtype)


class _Layer(eqx.Module):
    weight: jax.Array
    gate: float = eqx.field(static=True)

    def __call__(self, x):
        return _gated(self.weight, self.gate, x)


class _Model(eqx.Module):
    middle: _Layer
    second: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.middle = _Layer(jax.random.normal(k1, (8, 16)) / 4, 0.5)
        self.second = eqx.nn.Linear(16, 16, key=k2)
        self.head = eqx.nn.Linear(16, 1, key=k3)

    def __call__(self, x):
        # The data goes into the custom_vjp's non-differentiable argument: Equinox refuses a
        # perturbed one, in plain JAX too.
        h = jax.nn.relu(jax.vmap(self.second)(self.middle(x)))
        return jax.vmap(self.head)(h)[:, 0]


def _loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


@pytest.fixture(scope="module")
def data():
    x = jax.random.normal(jax.random.key(1), (32, 8))
    return x, jnp.sin(x.sum(axis=1))


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("route", ["autocast", "eqx.mixed_precision"])
def test_filter_custom_vjp_trains_with_its_own_backward_rule(data, route, policy):
    model = _Model(jax.random.key(0))
    if route == "autocast":
        loss = jax.jit(jax.value_and_grad(jmp.autocast(_loss, policy=policy)))
        grads_of = lambda m: loss(m, *data)  # noqa: E731
    else:
        wrapped = jmp.eqx.mixed_precision(model, policy)
        step = eqx.filter_jit(eqx.filter_value_and_grad(_loss))
        grads_of = lambda m: step(eqx.tree_at(lambda w: w.model, wrapped, m), *data)  # noqa: E731
    value, grads = grads_of(model)
    reference_value, reference = eqx.filter_value_and_grad(_loss)(model, *data)
    got = grads.middle.weight if route == "autocast" else grads.model.middle.weight
    tolerance = 2e-2 if policy == "mixed_bfloat16" else 2e-3
    # The gradient its backward rule gives, within the compute dtype's rounding.
    scale = float(jnp.max(jnp.abs(reference.middle.weight)))
    np.testing.assert_allclose(got, reference.middle.weight, atol=tolerance * scale)
    assert abs(float(value) - float(reference_value)) <= tolerance * float(reference_value)


def test_precision_report_reads_a_filter_custom_vjp_model(data):
    model = _Model(jax.random.key(0))
    step = jax.value_and_grad(jmp.autocast(_loss, policy="mixed_float16"))
    report = jmp.precision_report(step, model, *data)
    # Every matmul of the model in float16, the backward rule's own `x.T @ ...` too: it runs
    # by the rules, as torch.amp's `custom_bwd` runs a custom autograd function's backward.
    assert report.counts["dot_general"] == {"float16": 8}
