"""float8 formats and scales: the formats, TransformerEngine's scale rule, the saturating
quantizing cast, and the current (tensorwise) scale of a tensor; shared by current and
delayed scaling (`jmp_policy.fp8`)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from jmp_policy._core.validation import check_bool, whole_number
from jmp_policy.block_scaled import MODES
from jmp_policy.policy import BLOCK_FORMATS, normalise_dtype

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
FORMATS = ("hybrid", "e4m3")


def float8_format(compute_dtype: DTypeLike, fmt: str = "hybrid") -> str:
    """The `fmt` a float8 layer of this compute dtype multiplies in: the block-scaled format it
    names (`jmp_policy.policy.BLOCK_FORMATS`), else `fmt` (per-tensor float8)."""
    return BLOCK_FORMATS.get(np.dtype(compute_dtype).name, fmt)


SCALINGS = ("tensorwise", "rowwise")


def float8_dtype(dtype: Any, argument: str = "dtype") -> np.dtype:
    """`dtype` checked: a float8 dtype (e4m3fn, e5m2 or another this JAX knows), given as a
    dtype, a type or its full name."""
    found = normalise_dtype(dtype, argument)
    if not found.name.startswith("float8_"):
        raise TypeError(
            f"Expected a float8 dtype (jmp_policy.fp8.E4M3, E5M2 or a name such as "
            f"'float8_e4m3fn') for `{argument}`, got {found.name}."
        )
    return found


def max_margin(dtype: DTypeLike) -> int:
    """The largest margin that keeps an amax at or above `dtype`'s smallest normal value: past
    it every scaled value is flushed (and 2**margin leaves float32's range long before)."""
    finfo = jnp.finfo(dtype)
    return int(math.log2(float(finfo.max) / float(finfo.smallest_normal)))


def fp8_max(dtype: DTypeLike) -> float:
    """The largest finite value of a float8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return float(jnp.finfo(dtype).max)


def compute_scale(
    amax: ArrayLike,
    scale: ArrayLike,
    dtype: DTypeLike,
    *,
    margin: int = 0,
    power_of_two: bool = False,
) -> jax.Array:
    """The scale that maps `amax` onto `dtype`'s largest value: `fp8_max / amax / 2**margin`.

    Args:
      amax: the largest magnitude (any shape: one per tensor, row or step).
      scale: the previous scale, kept where `amax` is 0, not finite, or so
        small that the new scale would overflow float32.
      dtype: the float8 dtype quantized to.
      margin: leave `2**margin` of headroom below the format's largest value.
      power_of_two: round the scale down to a power of two, so that
        multiplying by it and dividing the result by it are exact.

    Returns:
      float32 scales of `amax`'s shape.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jmp_policy.fp8 import E4M3, compute_scale
      >>> compute_scale(jnp.array([2.0, 0.0, 3.0]), 1.0, E4M3, power_of_two=True)
      Array([128.,   1., 128.], dtype=float32)
    """
    dtype = float8_dtype(dtype)
    margin = whole_number(margin, "margin", low=0, high=max_margin(dtype))
    power_of_two = check_bool(power_of_two, "power_of_two")
    amax = jnp.asarray(amax, jnp.float32)
    new = (np.float32(fp8_max(dtype)) / amax) / np.float32(2.0**margin)
    if power_of_two:
        new = jnp.exp2(jnp.floor(jnp.log2(new)))
    usable = (amax > 0) & jnp.isfinite(amax) & jnp.isfinite(new)
    return jnp.where(usable, new, jnp.asarray(scale, jnp.float32))


def quantize(x: jax.Array, dtype: DTypeLike, scale: ArrayLike) -> jax.Array:
    """`x * scale` in float32, saturated at `dtype`'s largest value and cast to `dtype`.

    Finite values beyond the range become +-fp8_max; an inf or a NaN of `x` becomes NaN, so a
    matmul on it is not finite and the finite check of `loss_scaling` sees it (saturating an
    inf input batch or an overflowed gradient to fp8_max would hide it).

    Examples:
      >>> import jax.numpy as jnp
      >>> from jmp_policy.fp8 import E4M3, quantize
      >>> quantize(jnp.array([1.0, 1000.0, -jnp.inf]), E4M3, 1.0).astype(jnp.float32)
      Array([  1., 448.,  nan], dtype=float32)
    """
    dtype = float8_dtype(dtype)
    top = np.float32(fp8_max(dtype))
    wide = x.astype(jnp.float32)
    scaled = jnp.clip(wide * jnp.asarray(scale, jnp.float32), -top, top)
    return jnp.where(jnp.isfinite(wide), scaled, jnp.nan).astype(dtype)


def _amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def _current(x: jax.Array, dtype: np.dtype, power_of_two: bool) -> tuple[jax.Array, jax.Array]:
    """Tensorwise current scaling: the scale from `x`'s own amax, and `x` quantized with it."""
    scale = compute_scale(_amax(x), 1.0, dtype, power_of_two=power_of_two)
    return quantize(x, dtype, scale), scale


def _check_format(fmt: str) -> str:
    if not isinstance(fmt, str) or (fmt not in FORMATS and fmt not in MODES):
        raise ValueError(
            f"Unknown fp8 format {fmt!r} for `fmt`: expected 'hybrid' (e4m3 forward, e5m2 "
            "gradients), 'e4m3' (e4m3 everywhere), or a block-scaled 'mxfp8' or 'nvfp4'."
        )
    return fmt


def _dot_arguments(lhs, dimension_numbers, out_dtype):
    """Dimension numbers as nested tuples of ints (hashable, static), and the result dtype."""
    (lc, rc), (lb, rb) = dimension_numbers
    dimension_numbers = tuple(
        tuple(tuple(int(d) for d in ds) for ds in pair) for pair in ((lc, rc), (lb, rb))
    )
    if out_dtype is None:
        out_dtype = lhs.dtype if lhs.dtype.itemsize > 1 else np.dtype(np.float32)
    return dimension_numbers, np.dtype(out_dtype)


def _dequantized_dot(q_lhs, s_lhs, q_rhs, s_rhs, dimension_numbers, out_dtype):
    """The float8 matmul with float32 accumulation, divided by its operands' (scalar) scales."""
    out = lax.dot_general(q_lhs, q_rhs, dimension_numbers, preferred_element_type=jnp.float32)
    return (out / (s_lhs * s_rhs)).astype(out_dtype)


def _dequantized_grads(g, lhs, rhs, dimension_numbers, dtypes):
    """The two backward matmuls on float8 operands, each divided by its operands' scales.

    `g`, `lhs`, `rhs` are (float8 values, scalar scale) pairs; `dtypes` the
    gradients' dtypes.
    """
    (q_g, s_g), (q_lhs, s_lhs), (q_rhs, s_rhs) = g, lhs, rhs
    d_lhs = _transpose(q_g, q_lhs, q_rhs, dimension_numbers, "lhs") / (s_g * s_rhs)
    d_rhs = _transpose(q_g, q_lhs, q_rhs, dimension_numbers, "rhs") / (s_g * s_lhs)
    return d_lhs.astype(dtypes[0]), d_rhs.astype(dtypes[1])


def _transpose(g, lhs, rhs, dimension_numbers, which):
    """The gradient of `dot_general(lhs, rhs)` w.r.t. `which` for output gradient `g`.

    Only the shapes of the operand being differentiated matter, so it also
    gives the outer product of per-row scales in that operand's layout (with
    size-1 dimensions where a scale was reduced).
    """
    from flax.linen import fp8_ops  # the transposes of a dot_general, on any operand dtype

    transpose = (
        fp8_ops.dot_general_transpose_lhs if which == "lhs" else fp8_ops.dot_general_transpose_rhs
    )
    # HIGHEST as Flax's fp8 ops: float8 operands either way, and on CPU the
    # same accumulation order as theirs.
    return transpose(
        g, lhs, rhs, dimension_numbers=dimension_numbers, precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )  # fmt: skip


def _free_dims(ndim: int, *taken) -> tuple[int, ...]:
    used = {d for dims in taken for d in dims}
    return tuple(d for d in range(ndim) if d not in used)
