"""Block-scaled matmuls (MXFP8, NVFP4): JAX's op on Blackwell GPUs, its numerics elsewhere.

Blackwell tensor cores multiply block-scaled formats: MXFP8 (float8_e4m3fn values, one
float8_e8m0fnu power-of-two scale per 32 values along the contracting axis) and NVFP4
(float4_e2m1fn values, one float8_e4m3fn scale per 16, and a float32 global scale). JAX has
them as `jax.nn.scaled_dot_general` with `jax.nn.get_scaled_dot_general_config`, lowered for
GPUs only. `block_scaled_dot_general` calls that op where a GPU multiplies the format in
hardware (`hardware_path`: compute capability 10.0 or newer) and, everywhere else, emulates it:
each operand is quantized per block exactly as JAX's op quantizes it (the block's amax over the
format's largest value, the scale rounded up to a power of two for MXFP8 or cast to e4m3 for
NVFP4, values clipped and cast), and multiplied as a block-scaled GEMM multiplies them: each
product of two values times their blocks' scales, exact, summed in float32 (only the order of
that sum can differ from a GPU's). The dequantized values are exact in bfloat16, so this is one
bfloat16 dot with a float32 result (float32 on CPU, exact too); `precision_report` counts it as
the format.

The backward pass is JAX's op's: with MXFP8 both gradient matmuls quantize their operands too
(the cotangent with the `grads` config, blocks along the axis each gradient matmul contracts);
with NVFP4 they run in float32, and gradients of values clipped in the forward pass are zero
(a mask apart from the matmul, so that a weight shared under `vmap` is masked once its
examples' gradients are summed).
One difference: an MXFP8 gradient matmul whose contracted axes do not hold whole blocks (a
matmul under `vmap`, whose rows are one example) runs in float32, where JAX's op refuses it.
On a Blackwell GPU the backward pass is this module's too, its gradient matmuls JAX's op
(called forward only): the saved operands keep their own dtype, and `vmap` folds the op into
the matmul where JAX's own batching of it wants every operand mapped.

The policies `"mixed_mxfp8"` and `"mixed_nvfp4"` put these matmuls wherever `"mixed_float8"`
puts float8 ones (`autocast`, `linen`/`nnx`/`eqx.mixed_precision`, through `jmp_policy.fp8`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from jmp_policy.matmul import _free_axes as _free
from jmp_policy.matmul import gradient_matmul

MODES = ("mxfp8", "nvfp4")
IMPLEMENTATIONS = (None, "jax", "emulated")


def _config(mode: str) -> Any:
    if not isinstance(mode, str) or mode not in MODES:
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
    # A block of zeros has the smallest scale, 2**-127 (MXFP8), a float32 subnormal that
    # XLA:CPU reads as 0 outside a fused kernel: 0 / 0 there. Its values are zeros.
    values = jnp.where(amax == 0, 0.0, blocks / scale)
    values = jnp.clip(values, -largest, largest).astype(config.data_type)
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
"""The name scope of a block-scaled matmul (`SCOPE + mode`): reports count the emulation's
`dot_general` inside it as that format (`jmp_policy.precision_report`)."""


def _dequantized(x: jax.Array, axes: tuple[int, ...], mode: str) -> jax.Array:
    """`x` quantized in blocks along `axes`, its values times their block's scale (NVFP4's
    global scale left out), in bfloat16: exact, since a float8_e4m3fn or float4_e2m1fn value
    (4 or 2 significant bits) times a power of two (MXFP8) or a float8_e4m3fn scale (NVFP4, 4
    bits) has at most 8 significant bits, which bfloat16 holds, with float32's exponent range.
    In float32 on CPU, which XLA:CPU cannot always multiply as bfloat16 x bfloat16 -> float32
    (the same values, so the same products)."""
    values, scale, _ = _blocks(x, axes, mode)
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return _unblock((values.astype(jnp.float32) * scale).astype(dtype), x.shape, axes)


def eligible(x_shape: tuple[int, ...], axes: tuple[int, ...], mode: str) -> bool:
    """Whether `axes` of `x_shape` hold whole blocks of `mode` (32 values for MXFP8, 16 for
    NVFP4), as the formats need."""
    k = math.prod(x_shape[d] for d in axes)
    return k > 0 and k % _config(mode).block_size == 0


def check_implementation(implementation: str | None) -> None:
    """Raises a ValueError naming `implementation` unless it is one of `IMPLEMENTATIONS`."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"Expected one of {IMPLEMENTATIONS} for `implementation`, got {implementation!r}."
        )


@functools.cache
def hardware_path() -> bool:
    """Whether this process's default device multiplies block-scaled formats in its tensor
    cores: a CUDA GPU of compute capability 10.0 or newer (Blackwell), where XLA lowers
    `jax.nn.scaled_dot_general` to cuDNN's block-scaled GEMM.

    On an older GPU XLA expands JAX's op into a dequantization and a float32 dot: the format's
    numbers at float32's cost, where the emulation computes the same numbers with a bfloat16
    dot. ROCm devices take the emulation too.
    """
    device = jax.devices()[0]
    capability = str(getattr(device, "compute_capability", "")).split(".")[0]
    return device.platform == "gpu" and capability.isdigit() and int(capability) >= 10


def _forward(
    lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, mode: str, use_jax: bool
) -> jax.Array:
    """One block-scaled GEMM with a float32 result: both operands quantized in blocks along
    the axes they contract, every product of two values times their blocks' scales, exact,
    summed in float32.

    `use_jax`: JAX's `jax.nn.scaled_dot_general` (called forward only: the gradients are this
    module's, so its saved operands keep their own dtype). Otherwise the emulation: the
    dequantized operands are exact in bfloat16, so one bfloat16 dot with a float32 result
    (`_dequantized`), which only the order of the sum can tell from the hardware's.
    """
    (lc, rc), _ = dimension_numbers
    with jax.named_scope(SCOPE + mode):
        if use_jax:
            return _jax_op(dimension_numbers, mode)(lhs, rhs)
        out = lax.dot_general(
            _dequantized(lhs, tuple(lc), mode),
            _dequantized(rhs, tuple(rc), mode),
            dimension_numbers,
            preferred_element_type=jnp.float32,
        )
        if mode == "nvfp4":
            global_scale = _config(mode).global_scale[0].astype(jnp.float32)
            out = out * (global_scale * global_scale)
    return out


def _jax_op(dimension_numbers: Any, mode: str) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """`jax.nn.scaled_dot_general` with a float32 result, for these dimension numbers, as a
    function that `vmap` folds into the matmul, as `lax.dot_general`'s batching does: JAX's own
    batching of its op wants every operand mapped, and a layer under `vmap` maps only its
    input."""
    (lc, rc), (lb, rb) = dimension_numbers

    @jax.custom_batching.custom_vmap
    def op(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        # JAX's op also wants a free axis on each operand (a vector has none): a unit one,
        # taken out of the result again.
        lhs_unit, rhs_unit = not _free(lhs.ndim, lc, lb), not _free(rhs.ndim, rc, rb)
        config = _config(mode)
        out = jax.nn.scaled_dot_general(
            lhs.astype(jnp.float32)[..., None] if lhs_unit else lhs.astype(jnp.float32),
            rhs.astype(jnp.float32)[..., None] if rhs_unit else rhs.astype(jnp.float32),
            dimension_numbers,
            preferred_element_type=jnp.float32,
            configs=[config, config, config],
        )
        return jnp.squeeze(out, (len(lb),) * lhs_unit + (out.ndim - 1,) * rhs_unit)

    @op.def_vmap
    def _(axis_size: int, in_batched: list[bool], lhs: jax.Array, rhs: jax.Array):
        del axis_size
        up = lambda axes: tuple(d + 1 for d in axes)  # noqa: E731
        lhs_mapped, rhs_mapped = in_batched
        if lhs_mapped and rhs_mapped:  # a batch axis of the matmul
            dims = ((up(lc), up(rc)), ((0, *up(lb)), (0, *up(rb))))
            return _jax_op(dims, mode)(lhs, rhs), True
        if not (lhs_mapped or rhs_mapped):
            return _jax_op(dimension_numbers, mode)(lhs, rhs), False
        # A free axis of the mapped operand; the result has it after the batch axes (lhs) or
        # after lhs's free axes too (rhs).
        if lhs_mapped:
            dims, at = ((up(lc), rc), (up(lb), rb)), len(lb)
        else:
            dims, at = ((lc, up(rc)), (lb, up(rb))), lhs.ndim - len(lc)
        return jnp.moveaxis(_jax_op(dims, mode)(lhs, rhs), at, 0), True

    return op


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _block_scaled(lhs, rhs, dimension_numbers, mode, out_dtype, use_jax):
    return _forward(lhs, rhs, dimension_numbers, mode, use_jax).astype(out_dtype)


def _block_scaled_fwd(lhs, rhs, dimension_numbers, mode, out_dtype, use_jax):
    out = _block_scaled(lhs, rhs, dimension_numbers, mode, out_dtype, use_jax)
    return out, (lhs, rhs)


def _block_scaled_bwd(dimension_numbers, mode, out_dtype, use_jax, residuals, g):
    lhs, rhs = residuals
    g = g.astype(jnp.float32)
    grads = []
    for side, other in enumerate((rhs, lhs)):
        dims, permutation = gradient_matmul(dimension_numbers, (lhs.ndim, rhs.ndim), side)
        # MXFP8: a block-scaled GEMM too, the cotangent and the other operand quantized along
        # the axes it contracts (the `grads` config). Where those do not hold whole blocks (a
        # matmul under `vmap`, whose batch is summed outside it) it runs in float32, where
        # JAX's op refuses the shapes. NVFP4: in float32, as JAX's op does it.
        if mode == "mxfp8" and eligible(other.shape, dims[0][1], mode):
            out = _forward(g, other, dims, mode, use_jax)
        else:
            out = lax.dot_general(
                g, other.astype(jnp.float32), dims, preferred_element_type=jnp.float32
            )
        grads.append(jnp.transpose(out, permutation))
    return tuple(d.astype(x.dtype) for x, d in zip((lhs, rhs), grads, strict=True))


_block_scaled.defvjp(_block_scaled_fwd, _block_scaled_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _unclipped_gradient(x: jax.Array, mode: str) -> jax.Array:
    """`x`, with a gradient that is zero where the format's quantization clips `x`: NVFP4's
    straight-through estimator, as JAX's op has it. Apart from the matmul, so that under `vmap`
    an unmapped weight's gradient is masked once its examples are summed, not per example
    (which would keep a weight-sized gradient per example)."""
    return x


def _unclipped_gradient_fwd(x, mode):
    return x, x


def _unclipped_gradient_bwd(mode, x, g):
    config = _config(mode)
    bound = (
        config.global_scale[0]
        * float(jnp.finfo(config.data_type).max)
        * float(jnp.finfo(config.scale_type).max)
    )
    return (jnp.where(jnp.abs(x.astype(jnp.float32)) <= bound, g, jnp.zeros_like(g)),)


_unclipped_gradient.defvjp(_unclipped_gradient_fwd, _unclipped_gradient_bwd)


def block_scaled_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    *,
    mode: str = "mxfp8",
    preferred_element_type: DTypeLike = jnp.float32,
    implementation: str | None = None,
) -> jax.Array:
    """`lax.dot_general` in a block-scaled format: `jax.nn.scaled_dot_general` on a Blackwell
    GPU, its numerics elsewhere.

    Args:
      lhs: the left operand, as for `lax.dot_general`. The contracting axes of each
        operand must hold whole blocks (32 values for MXFP8, 16 for NVFP4; `eligible`). An
        MXFP8 gradient matmul whose contracted (free) axes do not runs in float32.
      rhs: the right operand.
      dimension_numbers: `((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))`.
      mode: "mxfp8" or "nvfp4" (JAX's configs, `jax.nn.get_scaled_dot_general_config`).
      preferred_element_type: the output dtype: float32, bfloat16 or float16.
      implementation: None: JAX's op where a GPU multiplies the format in hardware
        (`hardware_path`), the emulation elsewhere; "jax": JAX's op (which only a GPU
        compiles); "emulated": the emulation.

    Returns:
      The product, in `preferred_element_type`.

    Raises:
      ValueError: an unknown `mode` or `implementation`, or contracting axes that do not
        hold whole blocks.

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
    _config(mode)
    check_implementation(implementation)
    (lc, rc), (lb, rb) = dimension_numbers
    dn = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
    for name, x, axes in (("lhs", lhs, dn[0][0]), ("rhs", rhs, dn[0][1])):
        if not eligible(x.shape, axes, mode):
            raise ValueError(
                f"`{name}`'s contracting axes {axes} of shape {x.shape} do not hold whole "
                f"blocks of {_config(mode).block_size} values, as {mode} needs."
            )
    use_jax = implementation == "jax" or (implementation is None and hardware_path())
    if mode == "nvfp4":  # straight-through: zero gradient where the forward pass clips
        lhs, rhs = _unclipped_gradient(lhs, mode), _unclipped_gradient(rhs, mode)
    return _block_scaled(lhs, rhs, dn, mode, jnp.dtype(preferred_element_type), use_jax)


__all__ = [
    "block_scaled_dot_general",
    "eligible",
    "fake_quantize",
    "hardware_path",
]
