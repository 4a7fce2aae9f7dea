"""The warnings and errors jmp_policy raises, in one place.

- `PrecisionWarning`: mixed precision is not doing what the policy says (a matmul or conv
  still in float32 outside overrides and float32 islands; an operation autocast has no rule
  for).
- `LossScalingWarning`: a `loss_scaling` optimizer used in a way that trains badly without
  failing (gradients of the unscaled loss, half-precision master weights, ...).
- `NonFiniteLossError`: `jmp_policy.scaling.check_loss_scaling` finds training skipping step
  after step: the loss or the data is not finite.
"""

from __future__ import annotations


class PrecisionWarning(UserWarning):
    """Mixed precision is not doing what the policy says (e.g. float32 matmuls slipped through)."""


class LossScalingWarning(UserWarning):
    """A `loss_scaling` optimizer used in a way that trains badly without failing."""


class NonFiniteLossError(FloatingPointError):
    """Training keeps skipping steps: the loss or the data is not finite."""


__all__ = ["LossScalingWarning", "NonFiniteLossError", "PrecisionWarning"]
