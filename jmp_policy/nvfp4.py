"""NVIDIA's NVFP4 training recipe (arXiv 2509.25149) for one linear layer: all three GEMMs in NVFP4.

`nvfp4_matmul(x, w, key)` is `x @ w` (`x`: `(..., K)`, `w`: `(K, M)`) whose three GEMMs multiply
NVFP4 operands: float4_e2m1fn values, one float8_e4m3fn scale per block of 16, and one float32
scale per tensor that maps the tensor's amax to the largest value a block can hold (6 x 448),
so the block scales use e4m3's whole range.

- Forward, `x @ w`: `x` in blocks of 16 along K, `w` in 16x16 tiles, both rounded to nearest.
- Data gradient, `g @ w.T`: the cotangent `g` in blocks along M, rounded stochastically; `w`
  the same tiles as forward (a tile is a block along either axis), so the weight the gradient
  sees is the one the forward pass multiplied.
- Weight gradient, `x.T @ g`: both along the tokens (blocks of 16 rows), after a 16x16 random
  Hadamard transform of both (its signs drawn from `key`): an orthogonal transform, so the
  exact product is unchanged, and outliers are spread over their block before quantization.
  `g` is rounded stochastically, `x` to nearest.

`Recipe` switches each part off, to measure what it does: `gradients=False` is the forward-only
NVFP4 of `"mixed_nvfp4"` today (the gradient GEMMs in float32, straight through).

Where a GPU multiplies NVFP4 in hardware (`jmp_policy.block_scaled.hardware_path`: Blackwell),
each GEMM is JAX's `jax.nn.scaled_matmul` of the quantized operands; elsewhere it is emulated:
each value times its block's scale is exact in bfloat16 (a 2-bit and a 4-bit significand), so
one dot of the dequantized operands with a float32 result, times the reciprocal of the two
tensor scales' product, computes what the hardware does up to the order of the float32 sum (none
where a GEMM contracts one block). Stochastic rounding is keyed: one key gives the same bits on
every machine (`jax.random`'s draws), and `e2m1_stochastic_round` takes the draws themselves for
a reference.

`linear_dot_general(lhs, rhs, dimension_numbers, state, recipe)` is the same for a layer's
`dot_general` (Flax's Dense and DenseGeneral, an Equinox Linear), with the layer's `State`: the
key of its draws, carried as model state like float8's delayed scaling. The state's gradient
counts the matmul's uses, and a `loss_scaling` optimizer advances the key of each state used by
a step it applies (`advanced`), none on a skipped step. `autocast(f, "mixed_nvfp4",
fp8_scaling=Recipe())` and the Linen, NNX and Equinox policies put it on every linear layer.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from jmp_policy._core.pytree import register_state
from jmp_policy.block_scaled import SCOPE, check_implementation, hardware_path
from jmp_policy.matmul import _free_axes as _free

BLOCK = 16
"""Values per block scale, and the side of a weight's tile and of the Hadamard transform."""
E2M1_MAX = 6.0
E4M3_MAX = 448.0
_E2M1, _E4M3 = jnp.float4_e2m1fn, jnp.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Which parts of the NVFP4 training recipe run (all, by default).

    Attributes:
      gradients: the data- and weight-gradient GEMMs in NVFP4; False: in float32, straight
        through the forward pass's quantization (`"mixed_nvfp4"` today).
      hadamard: the 16x16 random Hadamard transform of the weight-gradient GEMM's operands.
      stochastic_rounding: the cotangent rounded stochastically in both gradient GEMMs; False:
        to nearest.
      weight_tiles: the weight quantized in 16x16 tiles, one quantization for the forward and
        the data-gradient GEMMs; False: in blocks of 16 along the axis each GEMM contracts.
      seed: the key the layers' states start from (`init`): `jax.random.key(seed)`, one key
        folded in per layer. An integer (>= 0).
    """

    gradients: bool = True
    hadamard: bool = True
    stochastic_rounding: bool = True
    weight_tiles: bool = True
    seed: int = 0

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "seed":
                if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                    raise TypeError(f"Expected an integer >= 0 for `Recipe.seed`, got {value!r}.")
            elif not isinstance(value, bool):
                raise TypeError(f"Expected True or False for `Recipe.{field.name}`, got {value!r}.")

    def init(self, key: jax.Array | None = None) -> State:
        """A layer's state: its draws start from `key` (default `jax.random.key(seed)`)."""
        return State.of(jax.random.key(self.seed) if key is None else key)


@register_state
@dataclasses.dataclass(frozen=True)
class State:
    """One NVFP4 layer's state: the key of its next step's draws (the Hadamard signs and the
    stochastic rounding), as floats, so that `jax.grad` takes the model state as it is.

    Attributes:
      key: float32, the key's uint32 words as 16-bit halves (integers below 2**16, exact in
        float32, and in `optax.apply_updates`' `key + (next - key)`).
      uses: a float32 scalar slot whose cotangent counts this step's uses of the layer; its
        value stays 0.
    """

    key: jax.Array
    uses: jax.Array

    @classmethod
    def of(cls, key: jax.Array) -> State:
        """The state whose draws come from the `jax.random` key `key`."""
        words = jax.random.key_data(key).astype(jnp.uint32)
        halves = jnp.stack([words >> 16, words & 0xFFFF], axis=-1).reshape(*words.shape[:-1], -1)
        return cls(halves.astype(jnp.float32), jnp.zeros(words.shape[:-1], jnp.float32))

    def random_key(self) -> jax.Array:
        """The `jax.random` key `of` made this state from."""
        halves = self.key.astype(jnp.uint32).reshape(*self.key.shape[:-1], -1, 2)
        return jax.random.wrap_key_data((halves[..., 0] << 16) | halves[..., 1])


def advanced(state: State) -> State:
    """The state of the next step: a key split from this one's (distinct from its draws).
    Stacked states (a scan's layers: leading axes) advance each on its own."""
    return State.of(_keys(state.random_key())[3])


FORWARD_ONLY = Recipe(gradients=False)
"""NVFP4 forward GEMMs only: what `"mixed_nvfp4"` does today (the ablation baseline)."""


def hadamard_matrix(signs: jax.Array) -> jax.Array:
    """The 16x16 random Hadamard transform `diag(signs) @ H / 4` (`H` Sylvester's, entries +-1):
    orthogonal, so a product `a.T @ b` is unchanged when both are transformed along the axis
    it contracts. `signs`: 16 values of +-1."""
    h = np.array([[1.0]])
    while h.shape[0] < BLOCK:
        h = np.block([[h, h], [h, -h]])
    return signs.astype(jnp.float32)[:, None] * jnp.asarray(h / np.sqrt(BLOCK), jnp.float32)


def random_signs(key: jax.Array) -> jax.Array:
    """The transform's 16 signs, drawn from `key`."""
    return jnp.where(jax.random.bernoulli(key, 0.5, (BLOCK,)), 1.0, -1.0).astype(jnp.float32)


def hadamard_rows(a: jax.Array, signs: jax.Array) -> jax.Array:
    """`a` (2-D, rows a multiple of 16) with every block of 16 rows transformed:
    `T.T @ block` for `T = hadamard_matrix(signs)`, in float32.

    `T.T = H diag(signs) / 4`: the signs, then `H` as the fast Walsh-Hadamard transform's four
    butterfly stages (additions, no matmul: a report counts no float32 GEMM for it, and it
    costs 4 additions per value where a 16x16 matmul costs 16 multiply-adds), then a quarter
    (exact)."""
    rows, cols = a.shape
    x = a.astype(jnp.float32).reshape(rows // BLOCK, BLOCK, cols) * signs[:, None]
    half = 1
    while half < BLOCK:  # Sylvester's order: [[H, H], [H, -H]] at each doubling
        pairs = x.reshape(rows // BLOCK, BLOCK // (2 * half), 2, half, cols)
        low, high = pairs[:, :, 0], pairs[:, :, 1]
        x = jnp.stack([low + high, low - high], axis=2).reshape(rows // BLOCK, BLOCK, cols)
        half *= 2
    return (x * 0.25).reshape(rows, cols)


def _e2m1(v: jax.Array, uniform: jax.Array | None) -> jax.Array:
    """`v` (float32) on the float4_e2m1fn grid, rounded by arithmetic that is exact in float32:
    to nearest (ties to even) without `uniform`, else stochastically. Not XLA's conversion:
    XLA:CPU's elemental emitter converts float32 to e2m1 through a wider float and rounds
    twice (1.7497543 -> 1.75 -> 2.0, not 1.5: 912 of 3 million values differ from ml_dtypes'
    with `--xla_backend_optimization_level=0`, none with XLA's defaults)."""
    a = jnp.minimum(jnp.abs(v), E2M1_MAX)
    gap = jnp.where(a < 2, 0.5, jnp.where(a < 4, 1.0, 2.0)).astype(jnp.float32)
    steps = jnp.floor(a / gap)  # the lower neighbour is `steps * gap`; an odd `steps` is odd
    fraction = a / gap - steps
    if uniform is None:
        up = (fraction > 0.5) | ((fraction == 0.5) & (jnp.mod(steps, 2) == 1))
    else:
        up = uniform < fraction
    return (jnp.sign(v) * (steps + up.astype(jnp.float32)) * gap).astype(_E2M1)


def _e4m3(s: jax.Array) -> jax.Array:
    """`s` (float32, in [0, 448]) rounded to the nearest float8_e4m3fn value (ties to even),
    in float32, by arithmetic that is exact: XLA:CPU's conversion (jaxlib 0.8.3 with the
    suite's elemental emitter) rounds some float32 values to e4m3 twice, as it does e2m1."""
    bits = lax.bitcast_convert_type(s, jnp.uint32)
    # Normal e4m3 (from 2**-6): keep 3 of float32's 23 mantissa bits, rounding the other 20
    # to nearest, ties to even.
    kept = (bits + 0x7FFFF + ((bits >> 20) & 1)) & jnp.uint32(0xFFF00000)
    normal = lax.bitcast_convert_type(kept, jnp.float32)
    # Subnormal e4m3: multiples of 2**-9 (a power-of-two scaling: exact).
    subnormal = jnp.round(s * 2.0**9) * 2.0**-9
    return jnp.where(s < 2.0**-6, subnormal, normal)


def e2m1_stochastic_round(v: jax.Array, uniform: jax.Array) -> jax.Array:
    """`v` (float32, within +-6) rounded to a neighbouring float4_e2m1fn value (0, 0.5, 1, 1.5,
    2, 3, 4, 6 and their negatives), up in magnitude where `uniform` (draws in [0, 1), one per
    value) is below the distance to the lower neighbour over the gap: unbiased, `E[q] = v`."""
    return _e2m1(v, uniform)


def quantize(
    a: jax.Array, *, tiles: bool = False, uniform: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`a` (2-D) in NVFP4 along its last axis: `(values, block scales, tensor scale)`.

    The tensor scale (float32) maps `a`'s amax to 6 x 448; each block of 16 values along the
    last axis (a 16x16 tile with `tiles`) gets the scale that maps its amax to 6, times the
    tensor scale, rounded to float8_e4m3fn; values are `a * tensor scale / block scale`,
    rounded to nearest float4_e2m1fn (stochastically with `uniform`, draws in [0, 1) shaped
    like `a`). `a` is `values * block scales / tensor scale`, the block scales repeated over
    their 16 values: scales shaped `(rows, cols // 16)`, a tile's repeated over its rows."""
    rows, cols = a.shape
    x = a.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x))
    encode = jnp.where(amax > 0, (E2M1_MAX * E4M3_MAX) / amax, 1.0).astype(jnp.float32)
    if tiles:
        tiled = jnp.abs(x).reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
        block_amax = jnp.repeat(jnp.max(tiled, axis=(1, 3)), BLOCK, axis=0)
    else:
        block_amax = jnp.max(jnp.abs(x).reshape(rows, cols // BLOCK, BLOCK), axis=-1)
    decode = _e4m3(jnp.minimum(block_amax / E2M1_MAX * encode, E4M3_MAX))
    scale = decode.astype(_E4M3)  # exact: `decode` is an e4m3 value
    per_value = jnp.repeat(decode, BLOCK, axis=-1)
    scaled = jnp.where(per_value == 0, 0.0, x * encode / per_value)
    scaled = jnp.clip(scaled, -E2M1_MAX, E2M1_MAX)
    values = _e2m1(scaled, uniform)
    return values, scale, encode


def _times_scales(values: jax.Array, scale: jax.Array) -> jax.Array:
    """`quantize`'s values times their block scales, in float32 (exact)."""
    return values.astype(jnp.float32) * jnp.repeat(scale.astype(jnp.float32), BLOCK, axis=-1)


def dequantize(values: jax.Array, scale: jax.Array, encode: jax.Array) -> jax.Array:
    """`quantize`'s values times their block scales over the tensor scale, in float32."""
    return _times_scales(values, scale) / encode


def _gemm(lhs: tuple, rhs: tuple, use_jax: bool) -> jax.Array:
    """`lhs @ rhs.T` of two `quantize`d operands `(values, scales, tensor scale)`, both
    quantized along the axis it contracts (their last), in float32."""
    (lv, ls, le), (rv, rs, re) = lhs, rhs
    # Reports count the emulation's dot in this scope as an NVFP4 GEMM (`precision_report`).
    with jax.named_scope(SCOPE + "nvfp4"):
        if use_jax:
            out = _scaled_matmul(lv, ls, rv, rs)
        else:
            # Each value times its block's scale: exact in bfloat16 (float32 on CPU, which
            # XLA:CPU does not always multiply as bfloat16 x bfloat16 -> float32; the same).
            dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
            out = lax.dot_general(
                _times_scales(lv, ls).astype(dtype),
                _times_scales(rv, rs).astype(dtype),
                (((1,), (1,)), ((), ())),
                preferred_element_type=jnp.float32,
            )
    # The two tensor scales undone by one multiplication (XLA turns a division by a scalar into
    # one anyway; written so, every backend computes the same float32).
    return out * (1.0 / (le * re))


@jax.custom_batching.custom_vmap
def _scaled_matmul(lv: jax.Array, ls: jax.Array, rv: jax.Array, rs: jax.Array) -> jax.Array:
    """`jax.nn.scaled_matmul` of two 2-D quantized operands (`lhs @ rhs.T`, float32), as a
    function `vmap` folds into the GEMM, as `lax.dot_general`'s batching does: JAX's own
    batching of its op wants all four arguments mapped, and an Equinox layer under `vmap` maps
    its input only (the tokens of each example, the weight shared)."""
    return jax.nn.scaled_matmul(lv[None], rv[None], ls[None], rs[None], jnp.float32)[0]


@_scaled_matmul.def_vmap
def _(axis_size: int, in_batched: list[bool], lv, ls, rv, rs):
    def mapped(x: jax.Array, batched: bool) -> jax.Array:
        return x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))

    lhs_mapped, rhs_mapped = in_batched[0] or in_batched[1], in_batched[2] or in_batched[3]
    if lhs_mapped and rhs_mapped:  # a batch axis of the GEMM: JAX's op takes it as it is
        lv, ls, rv, rs = (mapped(x, b) for x, b in zip((lv, ls, rv, rs), in_batched, strict=True))
        return jax.nn.scaled_matmul(lv, rv, ls, rs, jnp.float32), True
    if not (lhs_mapped or rhs_mapped):
        return _scaled_matmul(lv, ls, rv, rs), False
    if lhs_mapped:  # more rows of the left operand
        lv, ls = mapped(lv, in_batched[0]), mapped(ls, in_batched[1])
        rows = lv.shape[1]
        out = _scaled_matmul(lv.reshape(-1, lv.shape[2]), ls.reshape(-1, ls.shape[2]), rv, rs)
        return out.reshape(axis_size, rows, -1), True
    rv, rs = mapped(rv, in_batched[2]), mapped(rs, in_batched[3])  # more rows of the right one
    cols = rv.shape[1]
    out = _scaled_matmul(lv, ls, rv.reshape(-1, rv.shape[2]), rs.reshape(-1, rs.shape[2]))
    return jnp.moveaxis(out.reshape(out.shape[0], axis_size, cols), 1, 0), True


def _uniform(key: jax.Array, shape: tuple[int, ...], on: bool) -> jax.Array | None:
    return jax.random.uniform(key, shape, jnp.float32) if on else None


def _keys(key: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The draws of one step from `key`: the Hadamard signs, the two gradients' rounding, and
    the next step's key (`advanced`). Keys stacked over leading axes split each on its own."""
    split = jnp.vectorize(lambda k: jax.random.split(k, 4), signature="()->(n)")
    signs, data, weight, following = (split(key)[..., i] for i in range(4))
    return signs, data, weight, following


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _matmul(x2, w, key, recipe, use_jax):
    del key  # the forward pass rounds to nearest
    return _gemm(quantize(x2), quantize(w.T, tiles=recipe.weight_tiles), use_jax)


def _matmul_fwd(x2, w, key, recipe, use_jax):
    return _matmul(x2, w, key, recipe, use_jax), (x2, w, key)


def _matmul_bwd(recipe, use_jax, residuals, g):
    x2, w, key = residuals
    g = g.astype(jnp.float32)
    if not recipe.gradients:  # straight through, in float32
        dx = g @ w.astype(jnp.float32).T
        dw = x2.astype(jnp.float32).T @ g
        return dx.astype(x2.dtype), dw.astype(w.dtype), None
    sign_key, data_key, weight_key, _ = _keys(key)
    sr = recipe.stochastic_rounding
    # Data gradient, contracting M: g along M; w's tiles are its forward quantization.
    weight = quantize(w, tiles=recipe.weight_tiles)
    dx = _gemm(quantize(g, uniform=_uniform(data_key, g.shape, sr)), weight, use_jax)
    # Weight gradient, contracting the tokens: both along them, transformed first.
    xt, gt = x2.astype(jnp.float32).T, g.T
    if recipe.hadamard:
        signs = random_signs(sign_key)
        xt, gt = hadamard_rows(xt.T, signs).T, hadamard_rows(gt.T, signs).T
    dw = _gemm(quantize(xt), quantize(gt, uniform=_uniform(weight_key, gt.shape, sr)), use_jax)
    return dx.astype(x2.dtype), dw.astype(w.dtype), None


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _state_matmul(x2, w, state, recipe, use_jax):
    return _matmul(x2, w, state.random_key(), recipe, use_jax)


def _state_matmul_fwd(x2, w, state, recipe, use_jax):
    return _matmul_fwd(x2, w, state.random_key(), recipe, use_jax)


def _state_matmul_bwd(recipe, use_jax, residuals, g):
    dx, dw, _ = _matmul_bwd(recipe, use_jax, residuals, g)
    # The state's cotangent counts this use (a `loss_scaling` optimizer advances a used key).
    shaped = State.of(residuals[2])
    return dx, dw, State(jnp.zeros_like(shaped.key), jnp.ones_like(shaped.uses))


_state_matmul.defvjp(_state_matmul_fwd, _state_matmul_bwd)


def nvfp4_matmul(
    x: jax.Array,
    w: jax.Array,
    key: jax.Array,
    *,
    recipe: Recipe = Recipe(),
    preferred_element_type: DTypeLike = jnp.float32,
    implementation: str | None = None,
) -> jax.Array:
    """`x @ w` with its forward, data-gradient and weight-gradient GEMMs in NVFP4 (`Recipe`).

    Args:
      x: the activations, `(..., K)`; the tokens (all leading axes) a multiple of 16 where the
        weight gradient is quantized (they are what it contracts).
      w: the weight, `(K, M)`, K and M multiples of 16.
      key: a `jax.random` key: the Hadamard signs and the stochastic rounding of this call
        (split per step, e.g. `jax.random.fold_in(key, step)`; carry it as state).
      recipe: which parts run (`Recipe`; `FORWARD_ONLY` for the forward GEMM alone).
      preferred_element_type: the output dtype.
      implementation: None: JAX's `scaled_matmul` where a GPU multiplies NVFP4 in hardware,
        the emulation elsewhere; "jax" or "emulated" to choose.

    Returns:
      `(..., M)` in `preferred_element_type`; gradients in `x`'s and `w`'s dtypes, none for
      `key`.

    Raises:
      TypeError: `recipe` is not a `Recipe`.
      ValueError: a shape the blocks do not divide, or an unknown `implementation`.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jmp_policy.nvfp4 import nvfp4_matmul
      >>> x = jax.random.normal(jax.random.key(0), (32, 64))
      >>> w = jax.random.normal(jax.random.key(1), (64, 16))
      >>> out = nvfp4_matmul(x, w, jax.random.key(2))
      >>> error = jnp.linalg.norm(out - x @ w) / jnp.linalg.norm(x @ w)
      >>> 0 < float(error) < 0.2
      True
    """
    if not isinstance(recipe, Recipe):
        raise TypeError(
            f"Expected a jmp_policy.nvfp4.Recipe for `recipe`, got {type(recipe).__name__}."
        )
    check_implementation(implementation)
    if np.ndim(w) != 2 or np.ndim(x) < 1 or np.shape(x)[-1] != np.shape(w)[0]:
        raise ValueError(
            f"Expected `x` of shape (..., K) and `w` of shape (K, M), got {np.shape(x)} and "
            f"{np.shape(w)}."
        )
    tokens = int(np.prod(np.shape(x)[:-1]))
    sizes = {"K (`w.shape[0]`)": w.shape[0], "M (`w.shape[1]`)": w.shape[1]}
    if recipe.gradients:
        sizes["the tokens of `x` (its leading axes)"] = tokens
    for name, size in sizes.items():
        if size == 0 or size % BLOCK:
            raise ValueError(f"NVFP4 needs {name} to be a multiple of {BLOCK}, got {size}.")
    use_jax = implementation == "jax" or (implementation is None and hardware_path())
    out: jax.Array = _matmul(x.reshape(tokens, x.shape[-1]), w, key, recipe, use_jax)
    return out.reshape(*x.shape[:-1], w.shape[1]).astype(preferred_element_type)


WEIGHT_SIDES = ("rhs", "lhs")


def _sides(dimension_numbers, weight: str) -> tuple[tuple, tuple]:
    """`((activation's contracted axes), (weight's))`, paired in order."""
    (lc, rc), _ = dimension_numbers
    return (tuple(lc), tuple(rc)) if weight == "rhs" else (tuple(rc), tuple(lc))


def linear_ineligible(
    lhs_shape: tuple, rhs_shape: tuple, dimension_numbers, recipe: Recipe, weight: str = "rhs"
):
    """None if `lax.dot_general(lhs, rhs, dimension_numbers)` of these shapes is a linear
    layer's matmul that `linear_dot_general` takes, its weight the `weight` operand: no batch
    axes, something contracted, and K (the contraction), M (the weight's other axes) and, with
    gradients, the tokens (the activation's other axes) multiples of 16; else why not."""
    if weight not in WEIGHT_SIDES:
        raise ValueError(f"Expected one of {WEIGHT_SIDES} for `weight`, got {weight!r}.")
    (lc, _), (lb, rb) = dimension_numbers
    if lb or rb or not lc:
        return "not a linear layer's matmul (batch axes, or nothing contracted)"
    act_shape, w_shape = (lhs_shape, rhs_shape) if weight == "rhs" else (rhs_shape, lhs_shape)
    act_c, w_c = _sides(dimension_numbers, weight)
    sizes = {
        "K (contraction)": math.prod(w_shape[d] for d in w_c),
        "M (the weight's output width)": math.prod(w_shape[d] for d in _free(len(w_shape), w_c)),
    }
    if recipe.gradients:
        sizes["the tokens"] = math.prod(act_shape[d] for d in _free(len(act_shape), act_c))
    for name, size in sizes.items():
        if size == 0 or size % BLOCK:
            return f"{name} = {size} is not a multiple of {BLOCK}"
    return None


def _rows(a: jax.Array, contracted: tuple) -> jax.Array:
    """`a` as a matrix: its free axes (rows) by its `contracted` ones (in that order)."""
    free = _free(a.ndim, contracted)
    rows = math.prod(a.shape[d] for d in free)
    return jnp.transpose(a, free + contracted).reshape(rows, -1)


def linear_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    state: State,
    recipe: Recipe,
    *,
    weight: str = "rhs",
    out_dtype: DTypeLike | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """`lax.dot_general(lhs, rhs, dimension_numbers)` of a linear layer as `nvfp4_matmul`, its
    weight the `weight` operand ("rhs": Flax's `x @ kernel`; "lhs": Equinox's `weight @ x`),
    the other the activations (`linear_ineligible` says which shapes it takes), its draws from
    the layer's `state`, whose gradient counts this use (`State`). The result in `out_dtype`
    (default `lhs`'s); gradients in `lhs`'s and `rhs`'s dtypes."""
    check_implementation(implementation)
    reason = linear_ineligible(np.shape(lhs), np.shape(rhs), dimension_numbers, recipe, weight)
    if reason is not None:
        raise ValueError(f"linear_dot_general takes a linear layer's matmul: {reason}.")
    act, w = (lhs, rhs) if weight == "rhs" else (rhs, lhs)
    act_c, w_c = _sides(dimension_numbers, weight)
    act_free = [act.shape[d] for d in _free(act.ndim, act_c)]
    w_free = [w.shape[d] for d in _free(w.ndim, w_c)]
    use_jax = implementation == "jax" or (implementation is None and hardware_path())
    out: jax.Array = _state_matmul(_rows(act, act_c), _rows(w, w_c).T, state, recipe, use_jax)
    if weight == "rhs":
        out = out.reshape(*act_free, *w_free)
    else:  # dot_general's layout: the left operand's (the weight's) free axes first
        out = out.T.reshape(*w_free, *act_free)
    return out.astype(lhs.dtype if out_dtype is None else out_dtype)


__all__ = [
    "BLOCK",
    "FORWARD_ONLY",
    "Recipe",
    "State",
    "WEIGHT_SIDES",
    "advanced",
    "linear_dot_general",
    "linear_ineligible",
    "dequantize",
    "e2m1_stochastic_round",
    "hadamard_matrix",
    "hadamard_rows",
    "nvfp4_matmul",
    "quantize",
    "random_signs",
]
