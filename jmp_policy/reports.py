"""Reports on where a program does its work, beyond the top level's `precision_report` and
`debug_precision`: the records they return (`PrecisionReport`, `PrecisionDebugReport`,
`PrecisionStats`, and the debugger's per-layer records `LayerStats`, `NonFiniteOrigin`,
`OpError`) and `value_and_grad_with_stats` (the debugger's per-layer statistics
inside a jitted train step)."""

from jmp_policy._reports.census import PrecisionReport, precision_report
from jmp_policy._reports.debugger import (
    LayerStats,
    NonFiniteOrigin,
    OpError,
    PrecisionDebugReport,
    PrecisionStats,
    debug_precision,
    value_and_grad_with_stats,
)

__all__ = [
    "LayerStats",
    "NonFiniteOrigin",
    "OpError",
    "PrecisionDebugReport",
    "PrecisionReport",
    "PrecisionStats",
    "debug_precision",
    "precision_report",
    "value_and_grad_with_stats",
]
