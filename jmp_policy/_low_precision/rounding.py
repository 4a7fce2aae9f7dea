"""Rounding float32 to bfloat16 without losing small updates: stochastically
(`stochastic_round`), or exactly as a bfloat16 and an int16 remainder (`split_float32`,
`join_float32`)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)


def stochastic_round(x: jax.Array, key: jax.Array) -> jax.Array:
    """Rounds float32 `x` to bfloat16, up with probability equal to the fraction dropped.

    Unbiased: `E[stochastic_round(x)] == x` for finite `x` inside bfloat16's range. Adds 16
    random bits to the float32 bit pattern and truncates; as the pattern orders magnitudes, this
    rounds the magnitude, and so works for either sign.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jmp_policy.low_precision import stochastic_round
      >>> x = jnp.full((10000,), 1.0 + 2.0**-10, jnp.float32)  # a quarter of a bfloat16 step
      >>> y = stochastic_round(x, jax.random.PRNGKey(0))
      >>> y.dtype, sorted(set(y.tolist())), round(float(y.astype(jnp.float32).mean()), 3)
      (dtype(bfloat16), [1.0, 1.0078125], 1.001)
    """
    return _round_up_by(x, jax.random.bits(key, x.shape, jnp.uint32))


def _round_up_by(x: jax.Array, random_bits: jax.Array) -> jax.Array:
    """Stochastic rounding of `x` to bfloat16 with the given uint32 random bits (one per value)."""
    bits = lax.bitcast_convert_type(x.astype(F32), jnp.uint32)
    noise = random_bits.reshape(x.shape) >> 16
    rounded = ((bits + noise) >> 16).astype(jnp.uint16)
    out = lax.bitcast_convert_type(rounded, jnp.bfloat16)
    return jnp.where(jnp.isfinite(x), out, x.astype(BF16))  # inf/NaN as round-to-nearest


def _random_bits_for(key: jax.Array, arrays: Sequence[jax.Array]) -> list[jax.Array]:
    """One uint32 per value of each array, from one draw: one PRNG kernel whatever the number
    of leaves (a draw per leaf made compile time grow with the leaves)."""
    sizes = [int(np.prod(a.shape)) for a in arrays]
    flat = jax.random.bits(key, (sum(sizes),), jnp.uint32)
    offsets = np.cumsum([0, *sizes])
    return [flat[offsets[i] : offsets[i + 1]] for i in range(len(arrays))]


def split_float32(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Splits float32 `x` into its bfloat16 rounding and an int16 remainder; see `join_float32`."""
    bits = lax.bitcast_convert_type(x.astype(F32), jnp.int32)
    high = (bits + 0x8000) >> 16  # round half up on the bit pattern: nearest, ties away
    low = bits - (high << 16)  # in [-32768, 32767]
    high16 = lax.bitcast_convert_type(high.astype(jnp.int16), jnp.bfloat16)
    return high16, low.astype(jnp.int16)


def join_float32(high: jax.Array, low: jax.Array) -> jax.Array:
    """The float32 that `split_float32` split into `high` (bfloat16) and `low` (int16), exactly.

    Examples:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jmp_policy.low_precision import join_float32, split_float32
      >>> x = jnp.array([1.0 + 2.0**-20, -3.14159, 1e-30, 6e4], jnp.float32)
      >>> high, low = split_float32(x)
      >>> high.dtype, low.dtype, bool(np.array_equal(join_float32(high, low), x))
      (dtype(bfloat16), dtype('int16'), True)
    """
    high_bits = lax.bitcast_convert_type(high, jnp.int16).astype(jnp.int32)
    return lax.bitcast_convert_type((high_bits << 16) + low.astype(jnp.int32), jnp.float32)
