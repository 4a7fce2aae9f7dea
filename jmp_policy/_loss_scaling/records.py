"""The skip records of `loss_scaling` (a `Part`, in every configuration): why each skip
happened (`SkipCause`, counted per cause) and which gradient leaves held an inf or NaN."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jmp_policy._loss_scaling.leaf_flags import LeafFlags
from jmp_policy._loss_scaling.parts import Part, Step

SKIP_CAUSES = ("non-finite loss", "non-finite gradients", "spike")
"""Why `loss_scaling` skipped a step (`LossScalingState.skip_causes` counts them in this order):

- "non-finite loss": the loss itself was inf or NaN (an inf in the batch, a NaN target, a
  forward pass past the compute dtype's range). No loss scale cures it, so the scale is left
  as it was. Known only when `update` is given the loss (`value=loss`).
- "non-finite gradients": the loss was finite (or not given) and its scaled gradients
  overflowed: the loss scale's doing, cured by backing it off.
- "spike": with `loss_scaling(..., skip_spikes=SkipSpikes())`, a finite loss or global
  gradient norm more than `threshold` spreads above its running mean (`SkipSpikes`). The
  scale is left as it was.
"""


class SkipCause(enum.IntEnum):
    """Why a step was skipped, as the state stores it (`last_skip_cause`; 0 for none yet).
    `SkipCause(n).label` is its entry in `SKIP_CAUSES`."""

    NON_FINITE_LOSS = 1
    NON_FINITE_GRADIENTS = 2
    SPIKE = 3

    @property
    def label(self) -> str:
        return SKIP_CAUSES[self.value - 1]


class SkipRecords(NamedTuple):
    """The state of the skip records.

    Attributes:
      nonfinite_leaves: for the most recent step with non-finite gradients, a `LeafFlags`
        with a bool per gradient leaf (True where it held an inf or NaN after unscaling).
      skip_causes: skipped steps by cause, in the order of `SKIP_CAUSES` (int32, saturating).
      last_skip_cause: the most recent skipped step's `SkipCause` (int32); 0 until a skip.
    """

    nonfinite_leaves: LeafFlags
    skip_causes: jax.Array
    last_skip_cause: jax.Array


class Records(Part):
    """Counts skips by cause and flags the leaves of the last non-finite gradients."""

    state_type = SkipRecords

    def init(self, params: Any) -> SkipRecords:
        return SkipRecords(
            nonfinite_leaves=LeafFlags(
                jnp.zeros(len(jax.tree.leaves(params)), jnp.bool_), jax.tree.structure(params)
            ),
            skip_causes=jnp.zeros(len(SKIP_CAUSES), jnp.int32),
            last_skip_cause=jnp.zeros((), jnp.int32),
        )

    def record(
        self, state: SkipRecords, step: Step, applied: jax.Array, cause: jax.Array
    ) -> SkipRecords:
        flags = state.nonfinite_leaves
        counted = jnp.arange(1, len(SKIP_CAUSES) + 1) == cause
        return SkipRecords(
            nonfinite_leaves=dataclasses.replace(
                flags, flags=jnp.where(step.finite, flags.flags, ~step.leaf_finite)
            ),
            skip_causes=jnp.where(
                counted, optax.safe_int32_increment(state.skip_causes), state.skip_causes
            ),
            last_skip_cause=jnp.where(applied, state.last_skip_cause, cause),
        )


def skip_cause(step, applied, vetoes):
    """The `SkipCause` of this step (int32; 0 when applied): a non-finite loss, else non-finite
    gradients, else the first part that vetoed it."""
    cause = jnp.zeros((), jnp.int32)
    for part, veto in reversed(list(vetoes)):
        cause = jnp.where(veto, part.skip_cause or 0, cause)
    cause = jnp.where(step.finite, cause, SkipCause.NON_FINITE_GRADIENTS)
    cause = jnp.where(step.loss_finite, cause, SkipCause.NON_FINITE_LOSS)
    return jnp.where(applied, 0, cause).astype(jnp.int32)
