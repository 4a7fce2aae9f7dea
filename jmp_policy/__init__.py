"""jmp_policy: mixed precision for JAX, Flax and optax.

A drop-in for jmp (`import jmp_policy as jmp`), plus loss scaling as an optax
transform, Flax integration, autocast and diagnostics.
"""

from jmp_policy.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    select_tree,
)
from jmp_policy.policy import Policy, cast_to_full, cast_to_half, get_policy, half_dtype

__version__ = "0.1.0"

__all__ = (
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "Policy",
    "StaticLossScale",
    "all_finite",
    "cast_to_full",
    "cast_to_half",
    "get_policy",
    "half_dtype",
    "select_tree",
)
