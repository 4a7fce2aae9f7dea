"""Where a half-precision activation meets a float32 value: the one rule every integration reads.

torch.amp runs an op with mixed operand dtypes in the widest of them ("promote"). Applied to a
program traced in float32 that rule undoes half precision: the first float32 bias added to a
half-precision matmul output makes the activation float32 again, and so is every activation,
and every value saved for the backward pass, downstream of it. torch.amp itself escapes this
only because its linear layer is one fused op (matmul and bias in half precision).

This module keeps activations in the compute dtype instead. Each floating value a program
computes has a *kind*, decided by where it came from:

- `WEIGHT`: float32 and computed from the function's inputs and constants only (parameters,
  a bias, a positional table, an input batch): never from an activation;
- `ACTIVATION`: in the compute dtype (float16/bfloat16), e.g. a matmul's output;
- `ISLAND`: float32 computed from activations by the float32 list (exp, log, pow, ...) and by
  what follows in float32 (softmax's quotient, a normalised value): a float32 island;
- `STATISTIC`: a float32-list *reduction* of activations (a sum, a mean, a variance) and what
  is computed from statistics and weights alone (`rsqrt(var + eps)`).

The rule (`meet`) for an op that is on neither list and whose floating operands differ in
dtype:

1. a statistic among them: float32 (the island goes on: `x - mean`, `y * rsqrt(var)` and
   log-softmax's `x - logsumexp` compute in float32, as normalisation layers and losses need);
2. otherwise, a half-precision activation among them: its dtype; the weights and island values
   that meet it are cast to it at that use (a bias add runs in half precision; an island's
   output is handed back where the model continues in the compute dtype);
3. otherwise the widest (everything float32: as traced).

Flax's own `dtype=` layers and MPX's `cast_to_half_precision` keep activations in half
precision the same way; the difference is that the float32 list still runs in float32 here.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

WEIGHT = "weight"
ACTIVATION = "activation"
ISLAND = "island"
STATISTIC = "statistic"

_FLOAT32 = np.dtype(np.float32)


def kind_of_dtype(dtype: Any, recorded: str | None) -> str:
    """A floating value's kind: `ACTIVATION` below 32 bits, else what was recorded (default
    `WEIGHT`: an input or constant nobody computed from an activation)."""
    if jnp.finfo(dtype).bits < 32:
        return ACTIVATION
    return recorded if recorded in (ISLAND, STATISTIC) else WEIGHT


def combined(kinds: Sequence[str], reduction: bool = False) -> str:
    """The kind of a float32 result computed from values of these kinds: from an activation or
    an island value it is an island value (a statistic when the op reduces it), from
    statistics and weights a statistic, from weights alone a weight."""
    if ACTIVATION in kinds or ISLAND in kinds:
        return STATISTIC if reduction else ISLAND
    if STATISTIC in kinds:
        return STATISTIC
    return WEIGHT


def meet(dtypes: Sequence[Any], kinds: Sequence[str]) -> tuple[np.dtype, str]:
    """The dtype an op on neither list runs in, given its strong floating operands' dtypes and
    kinds, and the kind of its result (see the module docstring for the rule)."""
    dtypes = [np.dtype(d) for d in dtypes]
    half = [d for d in dtypes if jnp.finfo(d).bits < 32]
    if half and STATISTIC not in kinds:
        return max(half, key=lambda d: jnp.finfo(d).bits), ACTIVATION
    widest = max(dtypes, key=lambda d: jnp.finfo(d).bits)
    if jnp.finfo(widest).bits < 32:
        return widest, ACTIVATION
    return widest, combined(kinds)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _saturate(x: Any, largest: float) -> Any:
    return lax.clamp(np.asarray(-largest, x.dtype), x, np.asarray(largest, x.dtype))


@_saturate.defjvp
def _saturate_jvp(largest, primals, tangents):
    # Straight through: a linear derivative keeps nothing for the backward pass.
    return _saturate(primals[0], largest), tangents[0]


def weight_at_use(weight: Any, dtype: Any, shape: tuple | None = None) -> Any:
    """A float32 weight (or constant) cast down to the dtype of the activation it meets (rule
    2 of `meet`). It saturates at the format's largest finite value: a mask filled with
    `finfo(float32).min` stays finite, so a fully masked row still has a softmax. With `shape`
    (weight gradients in float32), a weight the op broadcasts (a bias added to a batch) is
    broadcast in float32 first, so the sum over the batch that is its gradient, and the sum
    across devices after it, run in float32."""
    dtype = np.dtype(dtype)
    if weight.dtype == dtype:
        return weight
    if jnp.finfo(dtype).bits < jnp.finfo(weight.dtype).bits:
        if shape is not None and np.shape(weight) != tuple(shape):
            weight = jnp.broadcast_to(weight, shape)
        weight = _saturate(weight, float(jnp.finfo(dtype).max))
    return lax.convert_element_type(weight, dtype)


def softmax_in_float32(logits: Any, axis: int = -1, dtype: Any = None, where: Any = None) -> Any:
    """A float32 island for softmax that keeps one half-precision copy for the backward pass.

    The softmax is computed in float32 from `logits` (any floating dtype) and returned in
    `dtype` (default: the logits' dtype); the backward pass keeps only that returned value
    (the copy the next matmul keeps anyway) and computes the derivative,
    `y * (g - sum(g * y))`, in float32 from it. `jax.nn.softmax` in float32 would keep its
    float32 `exp` and quotient besides the half copy the next matmul takes.

    `where` (bool, broadcastable to the logits): entries where it is False count as
    `finfo(float32).min`, as Flax's attention masks them (a row with an entry left has
    weight 0 there; a fully masked row is uniform), and get no gradient. Masking here
    rather than with `jnp.where` before the call keeps no float32 value for the mask.
    """
    logits = jnp.asarray(logits)
    dtype = logits.dtype if dtype is None else np.dtype(dtype)
    if where is not None:
        where = jnp.asarray(where, bool)
    return _softmax(logits, where, axis, dtype, logits.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _softmax(logits, where, axis, dtype, logits_dtype):
    del logits_dtype
    logits = logits.astype(_FLOAT32)
    if where is not None:
        logits = jnp.where(where, logits, jnp.finfo(_FLOAT32).min)
    return jax.nn.softmax(logits, axis=axis).astype(dtype)


def _softmax_forward(logits, where, axis, dtype, logits_dtype):
    y = _softmax(logits, where, axis, dtype, logits_dtype)
    return y, (y, where)


def _softmax_backward(axis, dtype, logits_dtype, residuals, g):
    del dtype
    y, where = residuals
    y, g = y.astype(_FLOAT32), g.astype(_FLOAT32)
    grad = y * (g - jnp.sum(g * y, axis=axis, keepdims=True))
    if where is not None:
        grad = jnp.where(where, grad, 0.0)
    return grad.astype(logits_dtype), None


_softmax.defvjp(_softmax_forward, _softmax_backward)
