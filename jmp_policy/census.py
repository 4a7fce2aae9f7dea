"""Deprecated path: `jmp_policy.census` is now the private `jmp_policy._reports.census`: import
precision_report from jmp_policy, PrecisionReport from jmp_policy.reports. This module goes in
the next release."""

import warnings

from jmp_policy._reports.census import *  # noqa: F403

warnings.warn(
    "jmp_policy.census is deprecated (now private): import precision_report from "
    "jmp_policy, PrecisionReport from jmp_policy.reports. The path goes in the next "
    "release.",
    DeprecationWarning,
    stacklevel=2,
)
