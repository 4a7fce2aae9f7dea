"""Deprecated path: `jmp_policy.loss_scale` is now the private
`jmp_policy._loss_scaling.loss_scale`: import the loss scales and select_tree from jmp_policy.
This module goes in the next release."""

import warnings

from jmp_policy._loss_scaling.loss_scale import *  # noqa: F403

warnings.warn(
    "jmp_policy.loss_scale is deprecated (now private): import the loss scales and "
    "select_tree from jmp_policy. The path goes in the next release.",
    DeprecationWarning,
    stacklevel=2,
)
