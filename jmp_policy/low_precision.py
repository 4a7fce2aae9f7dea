"""Parameters and optimizer moments in bfloat16, without losing the small updates.

A float32 master copy plus float32 Adam moments cost 12 bytes per parameter. Storing them in
bfloat16 halves that, but plain round-to-nearest loses every update smaller than half a bfloat16
step (1.0 + 1e-4 rounds back to 1.0). `low_precision_optimizer` wraps any optax optimizer and
applies its updates to 16-bit state in one of three ways:

- "stochastic": round up with probability equal to the distance to the lower neighbour, so the
  rounding is unbiased and small updates survive on average. The PRNG key lives in the state.
- "kahan": keep what rounding dropped in a bfloat16 compensation buffer and add it back next step.
- "split": keep the 16 low bits of the float32 master next to the bfloat16 parameter, so the pair
  is the float32 master exactly: the updates are bit-identical to a float32 optimizer's.
"""

from jmp_policy._low_precision.optimizer import (
    MODES,
    LowPrecisionState,
    low_precision_optimizer,
    master_params,
)
from jmp_policy._low_precision.rounding import join_float32, split_float32, stochastic_round
from jmp_policy._low_precision.stall_check import field_decays

__all__ = [
    "MODES",
    "LowPrecisionState",
    "field_decays",
    "join_float32",
    "low_precision_optimizer",
    "master_params",
    "split_float32",
    "stochastic_round",
]
