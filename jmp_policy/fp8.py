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
from jax.typing import ArrayLike, DTypeLike

from jmp_policy._pytree import register_state
from jmp_policy.block_scaled import MODES, block_scaled_dot_general, eligible
from jmp_policy.policy import BLOCK_FORMATS

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
FORMATS = ("hybrid", "e4m3")


def float8_format(compute_dtype: DTypeLike, fmt: str = "hybrid") -> str:
    """The `fmt` a float8 layer of this compute dtype multiplies in: the block-scaled format it
    names (`jmp_policy.policy.BLOCK_FORMATS`), else `fmt` (per-tensor float8)."""
    return BLOCK_FORMATS.get(np.dtype(compute_dtype).name, fmt)


SCALINGS = ("tensorwise", "rowwise")


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
    amax = jnp.asarray(amax, jnp.float32)
    new = (np.float32(fp8_max(dtype)) / amax) / np.float32(2.0**margin)
    if power_of_two:
        new = jnp.exp2(jnp.floor(jnp.log2(new)))
    usable = (amax > 0) & jnp.isfinite(amax) & jnp.isfinite(new)
    return jnp.where(usable, new, jnp.asarray(scale, jnp.float32))


def quantize(x: jax.Array, dtype: DTypeLike, scale: ArrayLike) -> jax.Array:
    """`x * scale` in float32, saturated at `dtype`'s largest value and cast to `dtype`.

    NaNs stay NaN; infs and values beyond the range become +-fp8_max.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jmp_policy.fp8 import E4M3, quantize
      >>> quantize(jnp.array([1.0, 1000.0, -jnp.inf]), E4M3, 1.0).astype(jnp.float32)
      Array([   1.,  448., -448.], dtype=float32)
    """
    top = np.float32(fp8_max(dtype))
    scaled = x.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)
    return jnp.clip(scaled, -top, top).astype(dtype)


def _amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def _current(x: jax.Array, dtype: np.dtype, power_of_two: bool) -> tuple[jax.Array, jax.Array]:
    """Tensorwise current scaling: the scale from `x`'s own amax, and `x` quantized with it."""
    scale = compute_scale(_amax(x), 1.0, dtype, power_of_two=power_of_two)
    return quantize(x, dtype, scale), scale


def _check_format(fmt: str) -> str:
    if fmt not in FORMATS and fmt not in MODES:
        raise ValueError(
            f"Unknown fp8 format {fmt!r} for `fmt`: expected 'hybrid' (e4m3 forward, e5m2 "
            "gradients), 'e4m3' (e4m3 everywhere), or a block-scaled 'mxfp8' or 'nvfp4'."
        )
    return fmt


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


def _dot_arguments(lhs, dimension_numbers, out_dtype):
    """Dimension numbers as nested tuples of ints (hashable, static), and the result dtype."""
    (lc, rc), (lb, rb) = dimension_numbers
    dimension_numbers = tuple(
        tuple(tuple(int(d) for d in ds) for ds in pair) for pair in ((lc, rc), (lb, rb))
    )
    if out_dtype is None:
        out_dtype = lhs.dtype if lhs.dtype.itemsize > 1 else np.dtype(np.float32)
    return dimension_numbers, np.dtype(out_dtype)


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


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def _free_dims(ndim: int, *taken) -> tuple[int, ...]:
    used = {d for dims in taken for d in dims}
    return tuple(d for d in range(ndim) if d not in used)


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


# Delayed scaling ----------------------------------------------------------------------------
#
# TransformerEngine's recipe: each tensor's scale comes from the amaxes of the
# previous steps (a rolling history), so the quantization needs no pass over
# the tensor before the matmul. The state is a pytree threaded like the loss
# scale. The forward operands' new metadata is returned with the result; the
# output gradient's amax exists only in the backward pass, so it leaves
# through the cotangent of one scalar slot of the state (`grad_amax`), and
# `next_state` folds it in after `jax.grad`. If a state is used twice in one
# step, those cotangents add up: the amax is overestimated, which only makes
# the scale smaller (never an overflow).

AMAX_FROM = ("max", "most_recent")


@register_state
@dataclasses.dataclass(frozen=True)
class Fp8Meta:
    """A tensor's delayed-scaling metadata.

    Attributes:
      scale: the quantization multiplier used at the latest step (float32 scalar).
      amax_history: float32 `(history_length,)`: the latest amax at index 0,
        the older ones after it (the layout of Flax's `fp8_ops`).
    """

    scale: jax.Array
    amax_history: jax.Array


@register_state
@dataclasses.dataclass(frozen=True)
class Fp8DotState:
    """Delayed-scaling state of one matmul: its two operands and its output gradient.

    Attributes:
      lhs: the left operand's `Fp8Meta` (e4m3).
      rhs: the right operand's `Fp8Meta` (e4m3).
      grad: the output gradient's `Fp8Meta` (e5m2 in the hybrid format).
      grad_amax: a float32 scalar slot whose cotangent is the output
        gradient's amax (`next_state` reads it); its value is never used.
    """

    lhs: Fp8Meta
    rhs: Fp8Meta
    grad: Fp8Meta
    grad_amax: jax.Array


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """The delayed-scaling recipe (TransformerEngine's `DelayedScaling`), validated when built.

    Attributes:
      history_length: how many steps of amax each tensor remembers (>= 1).
      margin: scales leave `2**margin` of headroom (>= 0).
      amax_from: "max" (the largest amax in the history) or "most_recent".
      fmt: "hybrid" (e5m2 gradients) or "e4m3".
      power_of_two: round scales down to powers of two.

    Examples:
      >>> from jmp_policy.fp8 import DelayedScaling
      >>> recipe = DelayedScaling(history_length=16)
      >>> state = recipe.init()
      >>> state.lhs.amax_history.shape, float(state.lhs.scale)
      ((16,), 1.0)
    """

    history_length: int = 1024
    margin: int = 0
    amax_from: str = "max"
    fmt: str = "hybrid"
    power_of_two: bool = False

    def __post_init__(self):
        for name, low in (("history_length", 1), ("margin", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"Expected an integer >= {low} for `{name}`, got {value!r}.")
        if self.amax_from not in AMAX_FROM:
            raise ValueError(
                f"Unknown `amax_from` {self.amax_from!r}: expected 'max' or 'most_recent'."
            )
        _check_format(self.fmt)

    @property
    def grad_dtype(self) -> np.dtype:
        return E5M2 if self.fmt == "hybrid" else E4M3

    def init(self) -> Fp8DotState:
        """A fresh state for one matmul: scales 1, empty histories."""

        def meta():
            return Fp8Meta(jnp.ones((), jnp.float32), jnp.zeros(self.history_length, jnp.float32))

        return Fp8DotState(meta(), meta(), meta(), jnp.zeros((), jnp.float32))

    def advance(self, meta: Fp8Meta, amax: jax.Array, dtype: DTypeLike) -> Fp8Meta:
        """One step of `meta`: the scale from the history so far, then `amax` recorded.

        Flax's `update_fp8_meta` and TransformerEngine's rule: the new scale
        is `compute_scale` of the history's max (or its latest entry), the
        previous scale kept for an amax of 0 or non-finite; the history is
        rolled by one and `amax` written at index 0.
        """
        history = meta.amax_history
        seen = history.max(axis=-1) if self.amax_from == "max" else history[..., 0]
        scale = compute_scale(
            seen, meta.scale, dtype, margin=self.margin, power_of_two=self.power_of_two
        )
        rolled = jnp.roll(history, -1, axis=-1).at[..., 0].set(amax.astype(jnp.float32))
        return Fp8Meta(scale, rolled)


def fp8_dot_general_delayed(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    state: Fp8DotState,
    recipe: DelayedScaling = DelayedScaling(),
    *,
    out_dtype: DTypeLike | None = None,
) -> tuple[jax.Array, Fp8DotState]:
    """`fp8_dot_general` with delayed scaling: returns the result and the advanced state.

    The operands are quantized with scales from their amax histories
    (`DelayedScaling.advance`), so a scale lags the tensor by one step; a
    value beyond the range saturates. The returned state holds the operands'
    new metadata; the output gradient's is folded in by `next_state` after
    differentiating with respect to the state:

        (loss, state), (grads, state_grads) = jax.value_and_grad(
            loss_fn, argnums=(0, 1), has_aux=True)(params, state, batch)
        state = next_state(state, state_grads, recipe)

    Args:
      lhs: the left operand, as for `lax.dot_general`.
      rhs: the right operand.
      dimension_numbers: `((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))`.
      state: this matmul's `Fp8DotState` (`recipe.init()`; stacked for a scanned stack).
      recipe: the `DelayedScaling` recipe.
      out_dtype: the result's dtype (default: `lhs`'s, float32 if that is float8).

    Returns:
      `(result, state)`.
    """
    if not isinstance(recipe, DelayedScaling):
        raise TypeError(
            f"Expected a jmp_policy.fp8.DelayedScaling for `recipe`, got {type(recipe).__name__}."
        )
    dimension_numbers, out_dtype = _dot_arguments(lhs, dimension_numbers, out_dtype)
    lhs_meta = recipe.advance(state.lhs, _amax(lhs), E4M3)
    rhs_meta = recipe.advance(state.rhs, _amax(rhs), E4M3)
    static = (recipe, out_dtype, np.dtype(lhs.dtype), np.dtype(rhs.dtype))
    out: jax.Array = _delayed_dot(  # pyright: ignore[reportAssignmentType]
        lhs, rhs, lhs_meta.scale, rhs_meta.scale, state.grad, state.grad_amax,
        dimension_numbers, static,
    )  # fmt: skip
    return out, dataclasses.replace(state, lhs=lhs_meta, rhs=rhs_meta)


def next_state(state: Fp8DotState, state_grads: Fp8DotState, recipe: DelayedScaling) -> Any:
    """Folds the output gradients' amaxes (from `jax.grad` w.r.t. the state) into `state`.

    Works on one `Fp8DotState`, stacked ones (a scanned layer stack), or any
    pytree of them with `state_grads` of the same structure.
    """
    is_state = lambda x: isinstance(x, Fp8DotState)  # noqa: E731

    def fold(s, g):
        grad_meta = recipe.advance(s.grad, g.grad_amax, recipe.grad_dtype)
        return dataclasses.replace(s, grad=grad_meta, grad_amax=jnp.zeros_like(s.grad_amax))

    return jax.tree.map(fold, state, state_grads, is_leaf=is_state)


def combine_microbatches(*states: Any) -> Any:
    """One step's state from its microbatches': every amax the largest any microbatch saw.

    Under gradient accumulation each microbatch's `fp8_dot_general_delayed` returns a
    state advanced from the same one (the same scales and history, its own amax at
    index 0), and `jax.grad` returns its own output-gradient amax (`grad_amax`). Summing
    those, or averaging them as `optax.MultiSteps` averages gradients, would record a
    wrong amax (an average underestimates it, and the next scale overflows: marin#7659).
    Combine the states, and separately the state gradients, with this (an elementwise
    max; pairwise, so it also serves as a `lax.scan` carry), then call `next_state` once:

        state = next_state(combine_microbatches(*states), combine_microbatches(*grads), recipe)

    Works on `Fp8DotState`s, stacked ones, or any pytree of them of one structure.
    """
    if not states:
        raise ValueError("Expected one or more states for `states`, got none.")
    return functools.reduce(lambda a, b: jax.tree.map(jnp.maximum, a, b), states)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _delayed_dot(lhs, rhs, lhs_scale, rhs_scale, grad_meta, grad_amax, dimension_numbers, static):
    return _delayed_dot_fwd(
        lhs, rhs, lhs_scale, rhs_scale, grad_meta, grad_amax, dimension_numbers, static
    )[0]


def _delayed_dot_fwd(
    lhs, rhs, lhs_scale, rhs_scale, grad_meta, grad_amax, dimension_numbers, static
):
    _, out_dtype, _, _ = static
    q_lhs, q_rhs = quantize(lhs, E4M3, lhs_scale), quantize(rhs, E4M3, rhs_scale)
    out = _dequantized_dot(q_lhs, lhs_scale, q_rhs, rhs_scale, dimension_numbers, out_dtype)
    return out, (q_lhs, lhs_scale, q_rhs, rhs_scale, grad_meta, grad_amax)


def _delayed_dot_bwd(dimension_numbers, static, residuals, g):
    recipe, _, lhs_dtype, rhs_dtype = static
    q_lhs, s_lhs, q_rhs, s_rhs, grad_meta, grad_amax = residuals
    amax = _amax(g)
    s_g = recipe.advance(grad_meta, amax, recipe.grad_dtype).scale
    q_g = quantize(g, recipe.grad_dtype, s_g)
    d_lhs, d_rhs = _dequantized_grads(
        (q_g, s_g), (q_lhs, s_lhs), (q_rhs, s_rhs), dimension_numbers, (lhs_dtype, rhs_dtype)
    )
    zeros = jax.tree.map(jnp.zeros_like, (s_lhs, s_rhs, grad_meta))
    return d_lhs, d_rhs, *zeros, amax.astype(grad_amax.dtype)


_delayed_dot.defvjp(_delayed_dot_fwd, _delayed_dot_bwd)
