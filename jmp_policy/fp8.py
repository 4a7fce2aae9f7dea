"""float8 matmuls: scaled, saturating casts and a `dot_general` on float8 operands.

A float8 format holds few values (e4m3: up to 448, 3 mantissa bits; e5m2: up
to 57344, 2 bits), so a tensor is multiplied by a scale before the cast, which
maps its largest magnitude (amax) onto the format's largest value, and the
matmul's result is divided by the product of its operands' scales.

- `compute_scale` is TransformerEngine's rule: `fp8_max / amax / 2**margin`,
  optionally rounded down to a power of two (then scaling is exact), and the
  previous scale kept where amax is 0 or not finite.
- `quantize` multiplies, saturates at the format's largest value (an inf
  becomes +-fp8_max, as TransformerEngine's casts do) and casts.
- `fp8_dot_general` is `lax.dot_general` with float8 operands and current
  tensorwise scaling (each scale from the tensor itself, so there is no
  state): e4m3 inputs and kernels in the forward pass, and gradients in e5m2
  (the HYBRID format) or e4m3 in the backward pass. Its result comes out in
  `out_dtype`, never in float8.

- `fp8_dot_general_delayed` is the same with delayed scaling (scales from
  earlier steps' amaxes, `DelayedScaling`), its state a pytree threaded like
  the loss scale (`Fp8DotState`, `next_state`).

On CPU, XLA computes a float8 `dot_general` exactly by upcasting, so the
numerics can be tested anywhere; on H100-class GPUs it becomes an fp8 GEMM.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from jmp_policy._core.validation import warn_at_user_line

# Formats and scales, and delayed scaling, live in their own files; their names are fp8's.
from jmp_policy._fp8.delayed import AMAX_FROM as AMAX_FROM
from jmp_policy._fp8.delayed import DelayedScaling as DelayedScaling
from jmp_policy._fp8.delayed import Fp8DotState as Fp8DotState
from jmp_policy._fp8.delayed import Fp8Meta as Fp8Meta
from jmp_policy._fp8.delayed import combine_microbatches as combine_microbatches
from jmp_policy._fp8.delayed import fp8_dot_general_delayed as fp8_dot_general_delayed
from jmp_policy._fp8.delayed import merge_microbatch as merge_microbatch
from jmp_policy._fp8.delayed import next_state as next_state
from jmp_policy._fp8.scaling import E4M3 as E4M3
from jmp_policy._fp8.scaling import E5M2 as E5M2
from jmp_policy._fp8.scaling import FORMATS as FORMATS
from jmp_policy._fp8.scaling import SCALINGS as SCALINGS
from jmp_policy._fp8.scaling import (
    _check_format,
    _current,
    _dequantized_dot,
    _dequantized_grads,
    _dot_arguments,
    _free_dims,
    _transpose,
)
from jmp_policy._fp8.scaling import compute_scale as compute_scale
from jmp_policy._fp8.scaling import float8_format as float8_format
from jmp_policy._fp8.scaling import fp8_max as fp8_max
from jmp_policy._fp8.scaling import quantize as quantize
from jmp_policy.block_scaled import MODES, block_scaled_dot_general, eligible
from jmp_policy.errors import PrecisionWarning

FP8_EXCLUDE = ("head", "lm_head", "logits", "[Ee]mbed.*")
"""Module names whose matmuls stay in bfloat16 under `mixed_float8` (the logits head and the
embedding, as TransformerEngine recipes leave them): regular expressions, each matched against
every component of a module path."""


def fp8_excluded_by(where: str, patterns: tuple[str, ...] = FP8_EXCLUDE) -> str | None:
    """The first pattern that matches a component of the module path `where` ("a/b/c"), or None.

    Examples:
      >>> from jmp_policy.fp8 import fp8_excluded_by
      >>> fp8_excluded_by("GPT/head"), fp8_excluded_by("GPT/Block_0/MultiHeadAttention_0/query")
      ('head', None)
    """
    components = where.split("/")
    for pattern in patterns:
        if any(re.fullmatch(pattern, c) for c in components):
            return pattern
    return None


def warn_head_in_low_precision(where: str, fmt: str, keep_out: str) -> None:
    """Warns that the matmul at module path `where`, the last one before the output (found by
    the program's structure, whatever its name: a language model's logits head), multiplies
    in `fmt` ("float8", "mxfp8", "nvfp4"); `keep_out` says how the caller's integration keeps
    it in bfloat16. Heads named like `FP8_EXCLUDE`'s patterns are never in `fmt`."""
    warn_at_user_line(
        f"jmp_policy: {where or '(top level)'} is the last matmul before the output (by the "
        f"program's structure: a language model's logits head) and it multiplies in {fmt}; "
        "only a head named like jmp_policy.fp8.FP8_EXCLUDE's patterns stays in bfloat16 by "
        f"itself. Keep it in bfloat16 with {keep_out}.",
        PrecisionWarning,
    )


def fp8_layer(compute_dtype: DTypeLike, where: str) -> bool:
    """Whether a layer at module path `where` multiplies in float8: its policy computes in
    float8 and `FP8_EXCLUDE` does not name it (the rule of `linen`/`nnx.mixed_precision`)."""
    return np.dtype(compute_dtype).itemsize == 1 and fp8_excluded_by(where) is None


# float8 matmuls need a contraction (K) and an output width (N) that are
# multiples of 16 (what fp8 GEMMs accept); smaller ones gain nothing and stay
# in bfloat16.
_FP8_MULTIPLE = 16


def fp8_eligible(
    lhs_shape: tuple, rhs_shape: tuple, dimension_numbers: Any, fmt: str = "hybrid"
) -> str | None:
    """None if a `dot_general` of these shapes runs in float8 under `mixed_float8` (`fmt`
    "mxfp8"/"nvfp4": in that block-scaled format), else why not.

    Examples:
      >>> from jmp_policy.fp8 import fp8_eligible
      >>> fp8_eligible((32, 64), (64, 10), (((1,), (0,)), ((), ())))
      'N (output width) = 10 is not a multiple of 16'
    """
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    if fmt in MODES:  # whole blocks along K (the gradient matmuls see to their own axes)
        if not eligible(tuple(lhs_shape), tuple(lhs_contract), fmt):
            k = int(np.prod([lhs_shape[d] for d in lhs_contract]))
            return f"K (contraction) = {k} does not hold whole {fmt} blocks"
        return None
    k = int(np.prod([rhs_shape[d] for d in rhs_contract]))
    n = int(np.prod([s for d, s in enumerate(rhs_shape) if d not in (*rhs_contract, *rhs_batch)]))
    for what, size in (("K (contraction)", k), ("N (output width)", n)):
        if size < _FP8_MULTIPLE or size % _FP8_MULTIPLE:
            return f"{what} = {size} is not a multiple of {_FP8_MULTIPLE}"
    return None


def fp8_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    *,
    fmt: str = "hybrid",
    scaling: str = "tensorwise",
    out_dtype: DTypeLike | None = None,
    power_of_two: bool = False,
) -> jax.Array:
    """`lax.dot_general(lhs, rhs, dimension_numbers)` on float8 operands, with current scaling.

    Forward: `lhs` and `rhs` are each quantized to e4m3 with a scale from
    their own amax (`compute_scale`), multiplied in float8 with float32
    accumulation, and divided by the product of the two scales. Backward: the
    output gradient is quantized the same way (to e5m2 with `fmt="hybrid"`,
    e4m3 with `fmt="e4m3"`) and multiplied by the saved float8 operands, so
    every matmul of the step has float8 operands. No state: nothing to thread
    through `jit`, `scan` or a checkpoint.

    Args:
      lhs: the left operand, as for `lax.dot_general`.
      rhs: the right operand.
      dimension_numbers: `((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))`.
      fmt: "hybrid" or "e4m3"; or a block-scaled "mxfp8" or "nvfp4"
        (`jmp_policy.block_scaled.block_scaled_dot_general`: `scaling` and
        `power_of_two` do not apply, the format has its own per-block scales).
      scaling: "tensorwise" (one scale per operand) or "rowwise" (one scale
        per row of each operand, over the contracted dimensions: an outlier
        row costs only its own precision). Rowwise re-quantizes the saved
        high-precision operands for each backward matmul, along the
        dimensions that one contracts, so it keeps them instead of their
        float8 copies.
      out_dtype: the dtype of the result (default: `lhs`'s, and float32 if
        that is float8). The gradients come back in `lhs`'s and `rhs`'s dtypes.
      power_of_two: round the scales down to powers of two (exact scaling).

    Raises:
      ValueError: an unknown `fmt` or `scaling`.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jmp_policy.fp8 import fp8_dot_general
      >>> x, w = jnp.ones((2, 3)), jnp.full((3, 4), 0.5)
      >>> fp8_dot_general(x, w, (((1,), (0,)), ((), ())))
      Array([[1.5, 1.5, 1.5, 1.5],
             [1.5, 1.5, 1.5, 1.5]], dtype=float32)
    """
    _check_format(fmt)
    _check_scaling(scaling)
    dimension_numbers, out_dtype = _dot_arguments(lhs, dimension_numbers, out_dtype)
    if fmt in MODES:  # block-scaled: the block's scale, no per-tensor scaling
        return block_scaled_dot_general(
            lhs, rhs, dimension_numbers, mode=fmt, preferred_element_type=out_dtype
        )
    static = (fmt, out_dtype, power_of_two, np.dtype(lhs.dtype), np.dtype(rhs.dtype))
    dot = _fp8_dot if scaling == "tensorwise" else _rowwise_dot
    return dot(lhs, rhs, dimension_numbers, static)


def _check_scaling(scaling: str) -> str:
    if scaling not in SCALINGS:
        raise ValueError(
            f"Unknown `scaling` {scaling!r}: expected 'tensorwise' or 'rowwise' (for delayed "
            "scaling, `fp8_dot_general_delayed`)."
        )
    return scaling


@dataclasses.dataclass(frozen=True)
class Fp8DotGeneral:
    """A `dot_general` for Flax layers: float8 where a float8 GEMM takes the shapes.

    Pass it as the `dot_general` of `flax.linen.Dense`/`DenseGeneral` or
    `flax.nnx.Linear`/`LinearGeneral`; `linen.mixed_precision` and
    `nnx.mixed_precision` put it on every such layer that falls under a
    float8 policy (`"mixed_float8"`), except the logits head and the
    embedding (`FP8_EXCLUDE`). A matmul whose K and N are multiples of 16
    (`fp8_eligible`) runs as `fp8_dot_general` with current scaling (no
    state to thread); any other runs as `lax.dot_general` in the operands'
    dtype. The result comes out in `preferred_element_type` if given, else
    in the left operand's dtype (bfloat16 under `mixed_float8`). Frozen and
    hashable, as Flax module attributes must be.

    Attributes:
      fmt: "hybrid" (e5m2 gradients) or "e4m3"; or a block-scaled "mxfp8" or
        "nvfp4" (under `"mixed_mxfp8"`/`"mixed_nvfp4"`), for shapes that hold
        whole blocks (`fp8_eligible`).
      scaling: "tensorwise" or "rowwise".
      power_of_two: round the scales down to powers of two.

    Raises:
      ValueError: an unknown `fmt` or `scaling`.
      TypeError: `power_of_two` is not a bool.

    Examples:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> from jmp_policy.fp8 import Fp8DotGeneral
      >>> layer = nn.Dense(32, dtype=jnp.bfloat16, dot_general=Fp8DotGeneral())
      >>> x = jnp.ones((2, 64), jnp.bfloat16)
      >>> variables = layer.init(jax.random.key(0), x)
      >>> layer.apply(variables, x).dtype
      dtype(bfloat16)
    """

    fmt: str = "hybrid"
    scaling: str = "tensorwise"
    power_of_two: bool = False

    def __post_init__(self):
        _check_format(self.fmt)
        _check_scaling(self.scaling)
        if not isinstance(self.power_of_two, bool):
            raise TypeError(
                f"Expected True or False for `power_of_two`, got {self.power_of_two!r}."
            )

    def __call__(
        self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs
    ):
        placed = any(v is not None for v in kwargs.values())  # e.g. nnx's out_sharding
        shapes = (lhs.shape, rhs.shape, dimension_numbers, self.fmt)
        if placed or fp8_eligible(*shapes) is not None:
            return lax.dot_general(
                lhs,
                rhs,
                dimension_numbers,
                precision=precision,
                preferred_element_type=preferred_element_type,
                **kwargs,
            )
        return fp8_dot_general(
            lhs,
            rhs,
            dimension_numbers,
            fmt=self.fmt,
            scaling=self.scaling,
            out_dtype=preferred_element_type,
            power_of_two=self.power_of_two,
        )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _fp8_dot(lhs, rhs, dimension_numbers, static):
    return _fp8_dot_fwd(lhs, rhs, dimension_numbers, static)[0]


def _fp8_dot_fwd(lhs, rhs, dimension_numbers, static):
    _, out_dtype, power_of_two, _, _ = static
    q_lhs, s_lhs = _current(lhs, E4M3, power_of_two)
    q_rhs, s_rhs = _current(rhs, E4M3, power_of_two)
    out = _dequantized_dot(q_lhs, s_lhs, q_rhs, s_rhs, dimension_numbers, out_dtype)
    return out, (q_lhs, s_lhs, q_rhs, s_rhs)


def _fp8_dot_bwd(dimension_numbers, static, residuals, g):
    fmt, _, power_of_two, lhs_dtype, rhs_dtype = static
    q_lhs, s_lhs, q_rhs, s_rhs = residuals
    q_g, s_g = _current(g, E5M2 if fmt == "hybrid" else E4M3, power_of_two)
    return _dequantized_grads(
        (q_g, s_g), (q_lhs, s_lhs), (q_rhs, s_rhs), dimension_numbers, (lhs_dtype, rhs_dtype)
    )


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def _rowwise(x: jax.Array, dtype: np.dtype, reduce: tuple, power_of_two: bool):
    """Current scaling with one scale per slice: amax over the `reduce` dimensions (kept as 1)."""
    if reduce:
        amax = jnp.max(jnp.abs(x), axis=reduce, keepdims=True).astype(jnp.float32)
    else:
        amax = jnp.abs(x).astype(jnp.float32)
    scale = compute_scale(amax, 1.0, dtype, power_of_two=power_of_two)
    return quantize(x, dtype, scale), scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rowwise_dot(lhs, rhs, dimension_numbers, static):
    return _rowwise_dot_fwd(lhs, rhs, dimension_numbers, static)[0]


def _rowwise_dot_fwd(lhs, rhs, dimension_numbers, static):
    _, out_dtype, power_of_two, _, _ = static
    (lhs_contract, rhs_contract), _ = dimension_numbers
    # One scale per row of each operand: its amax over the contracted dimensions.
    q_lhs, s_lhs = _rowwise(lhs, E4M3, tuple(lhs_contract), power_of_two)
    q_rhs, s_rhs = _rowwise(rhs, E4M3, tuple(rhs_contract), power_of_two)
    out = lax.dot_general(q_lhs, q_rhs, dimension_numbers, preferred_element_type=jnp.float32)
    # The scales' outer product in the output's layout: the same dot_general,
    # contracting dimensions of size 1.
    scales = lax.dot_general(s_lhs, s_rhs, dimension_numbers, precision=lax.Precision.HIGHEST)
    return (out / scales).astype(out_dtype), (lhs, rhs)


def _rowwise_dot_bwd(dimension_numbers, static, residuals, g):
    fmt, _, power_of_two, lhs_dtype, rhs_dtype = static
    lhs, rhs = residuals
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    lhs_free = _free_dims(lhs.ndim, lhs_contract, lhs_batch)
    rhs_free = _free_dims(rhs.ndim, rhs_contract, rhs_batch)
    n_batch = len(lhs_batch)
    out_lhs_free = tuple(range(n_batch, n_batch + len(lhs_free)))
    out_rhs_free = tuple(range(n_batch + len(lhs_free), g.ndim))
    g_dtype = E5M2 if fmt == "hybrid" else E4M3
    # Each backward matmul contracts other dimensions than the forward one, so
    # its operands are quantized again, per row of that contraction.
    q_g, s_g = _rowwise(g, g_dtype, out_rhs_free, power_of_two)
    q_r, s_r = _rowwise(rhs, E4M3, rhs_free, power_of_two)
    d_lhs = _transpose(q_g, lhs, q_r, dimension_numbers, "lhs")
    d_lhs = d_lhs / _transpose(s_g, lhs, s_r, dimension_numbers, "lhs")
    q_g, s_g = _rowwise(g, g_dtype, out_lhs_free, power_of_two)
    q_l, s_l = _rowwise(lhs, E4M3, lhs_free, power_of_two)
    d_rhs = _transpose(q_g, q_l, rhs, dimension_numbers, "rhs")
    d_rhs = d_rhs / _transpose(s_g, s_l, rhs, dimension_numbers, "rhs")
    return d_lhs.astype(lhs_dtype), d_rhs.astype(rhs_dtype)


_rowwise_dot.defvjp(_rowwise_dot_fwd, _rowwise_dot_bwd)

__all__ = [
    "DelayedScaling",
    "E4M3",
    "E5M2",
    "FP8_EXCLUDE",
    "Fp8DotGeneral",
    "Fp8DotState",
    "Fp8Meta",
    "combine_microbatches",
    "compute_scale",
    "fp8_dot_general",
    "fp8_dot_general_delayed",
    "fp8_eligible",
    "merge_microbatch",
    "next_state",
    "quantize",
    "warn_head_in_low_precision",
]
