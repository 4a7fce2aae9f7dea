"""jmp_policy: mixed precision for JAX, Flax and optax.

A drop-in for jmp (`import jmp_policy as jmp`), plus loss scaling as an optax
transform, Flax integration, autocast and diagnostics.
"""

from jmp_policy import linen, nnx
from jmp_policy.autocast import ALLOW as AUTOCAST_ALLOW
from jmp_policy.autocast import DENY as AUTOCAST_DENY
from jmp_policy.autocast import autocast, full_precision
from jmp_policy.census import Census, PrecisionReport, precision_census, precision_report
from jmp_policy.diagnostics import (
    LossScalingReport,
    NonFiniteLossError,
    check_loss_scaling,
    loss_scaling_report,
    nonfinite_paths,
)
from jmp_policy.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    leaf_finite_flags,
    leaf_finite_vector,
    select_tree,
)
from jmp_policy.policy import Policy, cast_to_full, cast_to_half, get_policy, half_dtype
from jmp_policy.transform import (
    LeafFlags,
    LossScalingState,
    find_loss_scaling_state,
    get_loss_scale,
    loss_scaling,
)

__version__ = "0.1.0"

__all__ = (
    "AUTOCAST_ALLOW",
    "AUTOCAST_DENY",
    "Census",
    "DynamicLossScale",
    "LeafFlags",
    "LossScale",
    "LossScalingReport",
    "LossScalingState",
    "NonFiniteLossError",
    "PrecisionReport",
    "NoOpLossScale",
    "Policy",
    "StaticLossScale",
    "all_finite",
    "autocast",
    "cast_to_full",
    "check_loss_scaling",
    "cast_to_half",
    "find_loss_scaling_state",
    "full_precision",
    "get_loss_scale",
    "get_policy",
    "half_dtype",
    "leaf_finite_flags",
    "leaf_finite_vector",
    "linen",
    "nnx",
    "loss_scaling",
    "loss_scaling_report",
    "nonfinite_paths",
    "precision_census",
    "precision_report",
    "select_tree",
)
