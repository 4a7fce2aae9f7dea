"""Deprecated path: `jmp_policy.finite` is now the private `jmp_policy._loss_scaling.finite`:
import all_finite from jmp_policy. This module goes in the next release."""

import warnings

from jmp_policy._loss_scaling.finite import *  # noqa: F403

warnings.warn(
    "jmp_policy.finite is deprecated (now private): import all_finite from jmp_policy. "
    "The path goes in the next release.",
    DeprecationWarning,
    stacklevel=2,
)
