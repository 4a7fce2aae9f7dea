"""Loss scaling beyond the top level: the state `loss_scaling` keeps and the records it
reports, spike skipping, and the checks of a training run.

The top level holds what a train step calls (`jmp_policy.loss_scaling`,
`value_and_scaled_grad`, `get_loss_scale`, `unless_skipped`, `loss_scaling_report` and the
loss scales); here is what a user reads or configures beside it:

- `LossScalingState` (the optimizer state), `find_loss_scaling_state` (it, wherever it sits),
  `LeafFlags` (which gradients held inf/NaN), `SKIP_CAUSES` and `SkipCause` (why a step was
  skipped), `SkipRecords` (the records' part of the state);
- `SkipSpikes`, `SpikeStats`: skipping steps whose loss or gradient norm spikes;
- `LossScalingReport` (what `loss_scaling_report` returns; its `GradientStats` with
  `loss_scaling(..., stats_every=N)`), `check_loss_scaling` (raises
  `jmp_policy.errors.NonFiniteLossError` when training keeps skipping).
"""

from jmp_policy._loss_scaling.diagnostics import LossScalingReport, check_loss_scaling
from jmp_policy._loss_scaling.gradient_stats import GradientStats
from jmp_policy._loss_scaling.leaf_flags import LeafFlags
from jmp_policy._loss_scaling.records import SKIP_CAUSES, SkipCause, SkipRecords
from jmp_policy._loss_scaling.spikes import SkipSpikes, SpikeStats
from jmp_policy._loss_scaling.state import LossScalingState, find_loss_scaling_state

__all__ = [
    "SKIP_CAUSES",
    "GradientStats",
    "LeafFlags",
    "LossScalingReport",
    "LossScalingState",
    "SkipCause",
    "SkipRecords",
    "SkipSpikes",
    "SpikeStats",
    "check_loss_scaling",
    "find_loss_scaling_state",
]
