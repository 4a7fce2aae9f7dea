"""Deprecated path: `jmp_policy.overrides` is now the private `jmp_policy._core.overrides`: it
holds the integrations' internals (their `overrides` argument). This module goes in the next
release."""

import warnings

from jmp_policy._core.overrides import *  # noqa: F403

warnings.warn(
    "jmp_policy.overrides is deprecated (now private): it holds the integrations' "
    "internals (their `overrides` argument). The path goes in the next release.",
    DeprecationWarning,
    stacklevel=2,
)
