"""Deprecated path: `jmp_policy.transform` is now the private
`jmp_policy._loss_scaling.optimizer`: import loss_scaling, get_loss_scale and unless_skipped
from jmp_policy, the rest from jmp_policy.scaling. This module goes in the next release."""

import warnings

from jmp_policy._loss_scaling.optimizer import *  # noqa: F403

warnings.warn(
    "jmp_policy.transform is deprecated (now private): import loss_scaling, "
    "get_loss_scale and unless_skipped from jmp_policy, the rest from jmp_policy.scaling."
    " The path goes in the next release.",
    DeprecationWarning,
    stacklevel=2,
)
