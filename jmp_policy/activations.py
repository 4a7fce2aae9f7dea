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

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

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
