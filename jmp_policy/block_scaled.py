"""Block-scaled matmuls (MXFP8, NVFP4) on every backend: JAX's op on GPU, its numerics elsewhere.

Blackwell tensor cores multiply block-scaled formats: MXFP8 (float8_e4m3fn values, one
float8_e8m0fnu power-of-two scale per 32 values along the contracting axis) and NVFP4
(float4_e2m1fn values, one float8_e4m3fn scale per 16, and a float32 global scale). JAX has
them as `jax.nn.scaled_dot_general` with `jax.nn.get_scaled_dot_general_config`, lowered for
GPUs only. `block_scaled_dot_general` calls that op on GPU and, everywhere else, emulates it:
each operand is quantized per block exactly as JAX's op quantizes it (the block's amax over the
format's largest value, the scale rounded up to a power of two for MXFP8 or cast to e4m3 for
NVFP4, values clipped and cast), and multiplied as a block-scaled GEMM multiplies them: each
product of two values times their blocks' scales, exact, summed in float32 (only the order of
that sum can differ from a GPU's). The dequantized values are exact in bfloat16, so this is one
bfloat16 dot with a float32 result; `precision_report` counts it as the format.

The backward pass is JAX's op's: with MXFP8 both gradient matmuls quantize their operands too
(the cotangent with the `grads` config, blocks along the axis each gradient matmul contracts);
with NVFP4 they run in float32, and gradients of values clipped in the forward pass are zero.
One difference: an MXFP8 gradient matmul whose contracted axes do not hold whole blocks (a
matmul under `vmap`, whose rows are one example) runs in float32, where JAX's op refuses it.

The policies `"mixed_mxfp8"` and `"mixed_nvfp4"` put these matmuls wherever `"mixed_float8"`
puts float8 ones (`autocast`, `linen`/`nnx`/`eqx.mixed_precision`, through `jmp_policy.fp8`).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

MODES = ("mxfp8", "nvfp4")


def _config(mode: str) -> Any:
    if mode not in MODES:
        raise ValueError(f"Expected one of {MODES} for `mode`, got {mode!r}.")
    return jax.nn.get_scaled_dot_general_config(mode)  # pyright: ignore[reportArgumentType]


def _round_up_to_power_of_two(scale: jax.Array) -> jax.Array:
    """float8_e8m0fnu's rounding of a positive float32 scale: up to the next power of two
    (zero and denormals to the smallest), as JAX's MXFP8 quantization does."""
    bits = lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.uint32)
    exponent, mantissa = bits >> 23, bits & 0x7FFFFF
    up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    exponent = jnp.where(up, exponent + 1, exponent)
    value = lax.bitcast_convert_type(exponent << 23, jnp.float32)
    return jnp.where(value == 0, jnp.float32(2.0**-127), value)


def _blocks(x: jax.Array, axes: tuple[int, ...], mode: str) -> tuple[jax.Array, jax.Array, Any]:
    """`x` quantized in blocks along `axes`: `(values, scales, global_scale)`.

    `values` in the format's dtype, shaped `(other axes..., blocks, block size)` with `axes`
    moved last and flattened in order; `scales` as float32 of shape `(other axes..., blocks,
    1)`; `global_scale` a float32 scalar for NVFP4, None for MXFP8. What JAX's
    `scaled_dot_general` quantization makes of `x` when `axes` are the ones it contracts.
    """
    config = _config(mode)
    others = _free(x.ndim, axes)
    moved = jnp.transpose(x.astype(jnp.float32), others + tuple(axes))
    k = math.prod(moved.shape[len(others) :])
    blocks = moved.reshape(*moved.shape[: len(others)], k // config.block_size, config.block_size)
    largest = float(jnp.finfo(config.data_type).max)
    if mode == "mxfp8":
        amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
        scale = _round_up_to_power_of_two(amax / largest)
        global_scale = None
    else:
        global_scale = config.global_scale[0].astype(jnp.float32)
        blocks = blocks / global_scale
        amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
        scale_max = float(jnp.finfo(config.scale_type).max)
        # The scale itself is stored in e4m3; the barrier keeps XLA from folding the cast away.
        scale = jnp.clip(amax / largest, 0, scale_max).astype(config.scale_type)
        scale = lax.optimization_barrier(scale).astype(jnp.float32)
    values = jnp.clip(blocks / scale, -largest, largest).astype(config.data_type)
    return values, scale, global_scale


def fake_quantize(x: jax.Array, axes: tuple[int, ...], mode: str) -> jax.Array:
    """`x` quantized to `mode` in blocks along `axes` (flattened, in order), and back in float32.

    The values a block-scaled GEMM multiplies: what JAX's `scaled_dot_general` quantization
    makes of `x` when `axes` are the ones its matmul contracts.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jmp_policy.block_scaled import fake_quantize
      >>> x = jnp.linspace(-1.0, 1.0, 32).reshape(1, 32)
      >>> q = fake_quantize(x, (1,), "mxfp8")
      >>> float(jnp.abs(q - x).max()) < 2 ** -4  # e4m3: 3 mantissa bits
      True
    """
    values, scale, global_scale = _blocks(x, axes, mode)
    dequantized = values.astype(jnp.float32) * scale
    if global_scale is not None:
        dequantized = dequantized * global_scale
    return _unblock(dequantized, x.shape, axes)


def _unblock(blocks: jax.Array, shape: tuple[int, ...], axes: tuple[int, ...]) -> jax.Array:
    """`_blocks`' layout undone: back to `shape`, `axes` where they were."""
    others = _free(len(shape), axes)
    moved_shape = tuple(shape[d] for d in others + tuple(axes))
    back = np.argsort(others + tuple(axes))
    return jnp.transpose(blocks.reshape(moved_shape), tuple(back))


SCOPE = "block_scaled_"
"""The name scope of a block-scaled matmul's emulation (`SCOPE + mode`): reports count the
matmul inside it as that format (`jmp_policy.precision_report`)."""


def _dequantized_bfloat16(x: jax.Array, axes: tuple[int, ...], mode: str) -> jax.Array:
    """`x` quantized in blocks along `axes`, its values times their block's scale, in bfloat16
    (NVFP4's global scale left out). Exact: a float8_e4m3fn or float4_e2m1fn value (4 or 2
    significant bits) times a power of two (MXFP8) or a float8_e4m3fn scale (NVFP4, 4 bits) has
    at most 8 significant bits, which bfloat16 holds, with float32's exponent range."""
    values, scale, _ = _blocks(x, axes, mode)
    return _unblock((values.astype(jnp.float32) * scale).astype(jnp.bfloat16), x.shape, axes)


def _block_dot(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, mode: str) -> jax.Array:
    """The forward block-scaled GEMM: every product of two blocks' values times their scales,
    exact, summed in float32, as the hardware does (only the order of the sum can differ).
    One bfloat16 dot of the exactly dequantized operands: no per-block intermediate."""
    (lc, rc), _ = dimension_numbers
    with jax.named_scope(SCOPE + mode):
        out = lax.dot_general(
            _dequantized_bfloat16(lhs, tuple(lc), mode),
            _dequantized_bfloat16(rhs, tuple(rc), mode),
            dimension_numbers,
            preferred_element_type=jnp.float32,
        )
        if mode == "nvfp4":
            global_scale = _config(mode).global_scale[0].astype(jnp.float32)
            out = out * (global_scale * global_scale)
    return out


def eligible(x_shape: tuple[int, ...], axes: tuple[int, ...], mode: str) -> bool:
    """Whether `axes` of `x_shape` hold whole blocks of `mode` (32 values for MXFP8, 16 for
    NVFP4), as the formats need."""
    k = math.prod(x_shape[d] for d in axes)
    return k > 0 and k % _config(mode).block_size == 0


def _free(ndim: int, *taken: tuple[int, ...]) -> tuple[int, ...]:
    used = {d for t in taken for d in t}
    return tuple(d for d in range(ndim) if d not in used)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _emulated(lhs, rhs, dimension_numbers, mode, out_dtype):
    return _block_dot(lhs, rhs, dimension_numbers, mode).astype(out_dtype)


def _emulated_fwd(lhs, rhs, dimension_numbers, mode, out_dtype):
    return _emulated(lhs, rhs, dimension_numbers, mode, out_dtype), (lhs, rhs)


def _emulated_bwd(dimension_numbers, mode, out_dtype, residuals, g):
    lhs, rhs = residuals
    (lc, rc), (lb, rb) = dimension_numbers
    lhs_free, rhs_free = _free(lhs.ndim, lc, lb), _free(rhs.ndim, rc, rb)
    nb = len(lb)
    # The output's axes: batch, then lhs's free axes, then rhs's.
    g_lhs_free = tuple(range(nb, nb + len(lhs_free)))
    g_rhs_free = tuple(range(nb + len(lhs_free), g.ndim))
    g = g.astype(jnp.float32)
    g_for_lhs = g_for_rhs = g
    lhs_q, rhs_q = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
    # MXFP8: each gradient matmul quantizes its operands along the axes it contracts (N for
    # the lhs gradient, M for the rhs's). Where those do not hold whole blocks (M = 1 for a
    # matmul under `vmap`, whose batch is summed outside it) that matmul runs in float32,
    # where JAX's op refuses the shapes. NVFP4: gradients in float32, as JAX's op makes them.
    if mode == "mxfp8" and eligible(rhs.shape, rhs_free, mode):
        g_for_lhs, rhs_q = fake_quantize(g, g_rhs_free, mode), fake_quantize(rhs, rhs_free, mode)
    if mode == "mxfp8" and eligible(lhs.shape, lhs_free, mode):
        g_for_rhs, lhs_q = fake_quantize(g, g_lhs_free, mode), fake_quantize(lhs, lhs_free, mode)

    def dot(a, b):
        return lax.dot_general(a, b, dimension_numbers, preferred_element_type=jnp.float32)

    (grad_lhs,) = jax.linear_transpose(lambda a: dot(a, rhs_q), lhs.astype(jnp.float32))(g_for_lhs)
    (grad_rhs,) = jax.linear_transpose(lambda b: dot(lhs_q, b), rhs.astype(jnp.float32))(g_for_rhs)
    if mode == "nvfp4":  # straight-through, zero where the forward pass clipped
        config = _config(mode)
        bound = (
            config.global_scale[0]
            * float(jnp.finfo(config.data_type).max)
            * float(jnp.finfo(config.scale_type).max)
        )
        grad_lhs = jnp.where(jnp.abs(lhs) <= bound, grad_lhs, 0.0)
        grad_rhs = jnp.where(jnp.abs(rhs) <= bound, grad_rhs, 0.0)
    return grad_lhs.astype(lhs.dtype), grad_rhs.astype(rhs.dtype)


_emulated.defvjp(_emulated_fwd, _emulated_bwd)


def block_scaled_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    *,
    mode: str = "mxfp8",
    preferred_element_type: DTypeLike = jnp.float32,
    implementation: str | None = None,
) -> jax.Array:
    """`lax.dot_general` in a block-scaled format: `jax.nn.scaled_dot_general` on GPU, its
    numerics elsewhere.

    Args:
      lhs: the left operand, as for `lax.dot_general`. The contracting axes of each
        operand must hold whole blocks (32 values for MXFP8, 16 for NVFP4; `eligible`). An
        MXFP8 gradient matmul whose contracted (free) axes do not runs in float32.
      rhs: the right operand.
      dimension_numbers: `((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))`.
      mode: "mxfp8" or "nvfp4" (JAX's configs, `jax.nn.get_scaled_dot_general_config`).
      preferred_element_type: the output dtype: float32, bfloat16 or float16.
      implementation: None (JAX's op on GPU, the emulation elsewhere) or "emulated".

    Returns:
      The product, in `preferred_element_type`.

    Raises:
      ValueError: an unknown `mode` or `implementation`.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jmp_policy.block_scaled import block_scaled_dot_general
      >>> x = jax.random.normal(jax.random.key(0), (4, 64))
      >>> w = jax.random.normal(jax.random.key(1), (64, 32))
      >>> out = block_scaled_dot_general(x, w, (((1,), (0,)), ((), ())), mode="mxfp8")
      >>> error = jnp.linalg.norm(out - x @ w) / jnp.linalg.norm(x @ w)
      >>> 0 < float(error) < 0.05
      True
    """
    config = _config(mode)
    if implementation not in (None, "emulated"):
        raise ValueError(
            f"Expected None or 'emulated' for `implementation`, got {implementation!r}."
        )
    out_dtype = jnp.dtype(preferred_element_type)
    if implementation is None and jax.default_backend() == "gpu":
        return jax.nn.scaled_dot_general(
            lhs,
            rhs,
            dimension_numbers,
            preferred_element_type=out_dtype,
            configs=[config, config, config],
        )
    (lc, rc), (lb, rb) = dimension_numbers
    dn = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
    return _emulated(lhs, rhs, dn, mode, out_dtype)
