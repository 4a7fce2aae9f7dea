"""Block-scaled matmuls (MXFP8, NVFP4): the emulation is JAX's op, forward and backward.

JAX's `jax.nn.scaled_dot_general` runs only on GPUs: its one GPU-only piece is the cuDNN
`scaled_matmul` of already quantized operands. The reference here is JAX's own op with that one
piece replaced by its definition (dequantize each block, multiply in float32), so JAX's own
quantization, blocking and custom backward pass run on CPU and are compared with ours.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_policy.block_scaled import block_scaled_dot_general, eligible, fake_quantize
from jmp_policy.fp8 import Fp8DotGeneral

reference = pytest.importorskip("jax._src.cudnn.scaled_matmul_stablehlo")


def _scaled_matmul_on_cpu(lhs, rhs, lhs_scales, rhs_scales, preferred_element_type=jnp.float32):
    def dequantize(x, scales):
        block = x.shape[-1] // scales.shape[-1]
        return x.astype(jnp.float32) * jnp.repeat(scales.astype(jnp.float32), block, axis=-1)

    out = jnp.einsum(
        "bmk,bnk->bmn", dequantize(lhs, lhs_scales), dequantize(rhs, rhs_scales),
        preferred_element_type=jnp.float32,
    )  # fmt: skip
    return out.astype(preferred_element_type)


@pytest.fixture
def jax_op_on_cpu(monkeypatch):
    monkeypatch.setattr(reference, "scaled_matmul_wrapper", _scaled_matmul_on_cpu)

    def op(lhs, rhs, dimension_numbers, mode):
        config = jax.nn.get_scaled_dot_general_config(mode)
        return reference.scaled_dot_general_wrapper(
            lhs, rhs, dimension_numbers, jnp.float32, configs=[config] * 3
        )

    return op


CASES = [
    ((64, 96), (96, 32), (((1,), (0,)), ((), ()))),  # x @ w
    ((2, 32, 64), (2, 64, 32), (((2,), (1,)), ((0,), (0,)))),  # batched
    ((32, 64), (32, 64), (((1,), (1,)), ((), ()))),  # x @ w.T
]


@pytest.mark.parametrize("mode", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("shapes", CASES, ids=["xw", "batched", "xwT"])
def test_forward_and_gradients_are_jax_ops(jax_op_on_cpu, mode, shapes):
    lhs_shape, rhs_shape, dn = shapes
    lhs = 3.0 * jax.random.normal(jax.random.key(0), lhs_shape)
    rhs = jax.random.normal(jax.random.key(1), rhs_shape)
    exact = jax.lax.dot_general(lhs, rhs, dn)
    cotangent = jax.random.normal(jax.random.key(2), exact.shape)

    def ours(a, b):
        return block_scaled_dot_general(a, b, dn, mode=mode)

    def theirs(a, b):
        return jax_op_on_cpu(a, b, dn, mode)

    out, pullback = jax.vjp(jax.jit(ours), lhs, rhs)
    expected, expected_pullback = jax.vjp(theirs, lhs, rhs)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-5)
    for got, want in zip(pullback(cotangent), expected_pullback(cotangent), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-4)
    error = float(jnp.linalg.norm(out - exact) / jnp.linalg.norm(exact))
    print(f"{mode}: relative error of one matmul against float32 {error:.4f}")
    assert 0 < error < (0.06 if mode == "mxfp8" else 0.2)


@pytest.mark.parametrize("mode", ["mxfp8", "nvfp4"])
def test_fake_quantize_is_jax_quantization(mode):
    config = jax.nn.get_scaled_dot_general_config(mode)
    x = 5.0 * jax.random.normal(jax.random.key(3), (1, 8, 64))
    values, scales = reference.quantize(x, config)
    block = 64 // scales.shape[-1]
    expected = values.astype(jnp.float32) * jnp.repeat(scales.astype(jnp.float32), block, axis=-1)
    if mode == "nvfp4":
        expected = expected * config.global_scale
    np.testing.assert_array_equal(fake_quantize(x, (2,), mode), expected)
    assert eligible((8, 64), (1,), mode) and not eligible((8, 40), (1,), mode)


def test_bad_arguments():
    x = jnp.ones((32, 32))
    with pytest.raises(ValueError, match="`mode`"):
        block_scaled_dot_general(x, x, (((1,), (0,)), ((), ())), mode="mxfp4")
    with pytest.raises(ValueError, match="`implementation`"):
        block_scaled_dot_general(x, x, (((1,), (0,)), ((), ())), implementation="cudnn")


# --- As policies: "mixed_mxfp8" and "mixed_nvfp4" wherever "mixed_float8" goes -----------


@pytest.mark.parametrize("mode", ["mxfp8", "nvfp4"])
def test_the_policy_names_and_their_long_form(mode):
    import jmp_policy as jmp

    policy = jmp.get_policy(f"mixed_{mode}")
    assert str(policy) == f"params=float32,compute={mode},output=float32"
    assert jmp.get_policy(str(policy)) == policy != jmp.get_policy("mixed_float8")
    with pytest.raises(ValueError, match=f"Did you mean 'mixed_{mode}'"):
        jmp.get_policy(f"{mode}_mixed_typo")


@pytest.mark.parametrize("mode", ["mxfp8", "nvfp4"])
def test_every_integration_multiplies_in_the_block_format(mode):
    import equinox as eqx
    import flax.linen as nn
    from flax import nnx

    import jmp_policy as jmp

    policy = jmp.get_policy(f"mixed_{mode}")
    x = jax.random.normal(jax.random.key(0), (32, 64))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(10, name="head")(nn.relu(nn.Dense(64)(x)))

    linen = jmp.linen.mixed_precision(Net(), policy)
    variables = linen.init(jax.random.key(1), x)
    layers = nnx.Sequential(
        nnx.Linear(64, 64, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(64, 32, rngs=nnx.Rngs(1))
    )
    model = jmp.nnx.mixed_precision(layers, policy)
    mlp = jmp.eqx.mixed_precision(eqx.nn.MLP(64, 32, 64, 1, key=jax.random.key(2)), policy)
    params = {"w": 0.1 * jax.random.normal(jax.random.key(3), (64, 32))}
    reports = {
        "linen": (jmp.precision_report(linen.apply, variables, x), {mode: 1}),
        "nnx": (jmp.precision_report(lambda m, x: m(x), model, x), {mode: 2}),
        "eqx": (jmp.precision_report(jax.vmap(mlp), x), {mode: 2}),
        "autocast": (
            jmp.precision_report(jmp.autocast(lambda p, x: x @ p["w"], policy), params, x),
            {mode: 1},
        ),
    }
    for name, (report, expected) in reports.items():
        counts = report.counts["dot_general"]
        assert {k: v for k, v in counts.items() if k == mode} == expected, name
        assert report.fp8_matmul_flop_share > 0.5, name
    # The head (N = 10, `FP8_EXCLUDE`) stays in bfloat16 under Linen.
    assert reports["linen"][0].counts["dot_general"].get("bfloat16") == 1
    # The numbers are the format's: autocast's matmul is the block-scaled one.
    out = jmp.autocast(lambda p, x: x @ p["w"], policy)(params, x)
    expected = block_scaled_dot_general(
        x, params["w"], (((1,), (0,)), ((), ())), mode=mode, preferred_element_type=jnp.bfloat16
    )  # the float32 operands quantized straight to the format
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))
    grads = eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x) ** 2))(mlp)
    assert all(
        bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(eqx.filter(grads, eqx.is_array))
    )
    # Another policy takes the block-scaled matmul away again.
    assert model.layers[0].dot_general.fmt == mode
    jmp.nnx.mixed_precision(model, jmp.get_policy("mixed_bfloat16"))
    assert not isinstance(model.layers[0].dot_general, Fp8DotGeneral)
