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
