"""Deprecated path: `jmp_policy.diagnostics` is now the private
`jmp_policy._loss_scaling.diagnostics`: import loss_scaling_report from jmp_policy, the rest
from jmp_policy.scaling. This module goes in the next release."""

import warnings

from jmp_policy._loss_scaling.diagnostics import *  # noqa: F403

warnings.warn(
    "jmp_policy.diagnostics is deprecated (now private): import loss_scaling_report from "
    "jmp_policy, the rest from jmp_policy.scaling. The path goes in the next release.",
    DeprecationWarning,
    stacklevel=2,
)
