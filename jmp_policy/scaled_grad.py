"""Deprecated path: `jmp_policy.scaled_grad` is now the private
`jmp_policy._loss_scaling.scaled_grad`: import value_and_scaled_grad from jmp_policy. This
module goes in the next release."""

import warnings

from jmp_policy._loss_scaling.scaled_grad import *  # noqa: F403

warnings.warn(
    "jmp_policy.scaled_grad is deprecated (now private): import value_and_scaled_grad "
    "from jmp_policy. The path goes in the next release.",
    DeprecationWarning,
    stacklevel=2,
)
