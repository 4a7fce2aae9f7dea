"""Deprecated path: `jmp_policy.debugger` is now the private `jmp_policy._reports.debugger`;
import `debug_precision` from `jmp_policy`, and its records from `jmp_policy.reports`. This
module goes in the next release."""

import warnings

from jmp_policy._reports.debugger import *  # noqa: F403

warnings.warn(
    "jmp_policy.debugger is deprecated (now private): import debug_precision from jmp_policy "
    "and its records (PrecisionDebugReport, LayerStats, ...) from jmp_policy.reports. The path "
    "goes in the next release.",
    DeprecationWarning,
    stacklevel=2,
)
