"""Haiku's `hk.mixed_precision.set_policy` with a jmp_policy policy (duck-typed)."""

import jax
import jax.numpy as jnp
import pytest

import jmp_policy as jmp

hk = pytest.importorskip("haiku")


def test_set_policy_with_jmp_policy_policy():
    policy = jmp.get_policy("params=float32,compute=float16,output=float32")
    seen = {}

    class Probe(hk.Module):
        def __call__(self, x):
            w = hk.get_parameter("w", [x.shape[-1], 3], init=jnp.ones)
            seen["x"], seen["w"] = x.dtype, w.dtype
            return x @ w

    def forward(x):
        return Probe()(x)

    hk.mixed_precision.set_policy(Probe, policy)
    try:
        model = hk.transform(forward)
        x = jnp.ones((2, 4))
        params = model.init(jax.random.key(0), x)
        out = jax.jit(model.apply)(params, None, x)
    finally:
        hk.mixed_precision.clear_policy(Probe)
    assert jax.tree.leaves(params)[0].dtype == jnp.float32  # master weights
    assert seen == {"x": jnp.float16, "w": jnp.float16}  # computation in half
    assert out.dtype == jnp.float32  # output policy
    assert hk.mixed_precision.get_policy(Probe) is None
