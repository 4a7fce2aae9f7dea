"""The state of `loss_scaling` (`LossScalingState`: what every configuration needs, and its
parts' states) and how a train step reads it from any optimizer state:
`find_loss_scaling_state`, `get_loss_scale` (the scale the loss is multiplied by) and
`unless_skipped` (a skipped step keeps the model state)."""

from __future__ import annotations

from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_policy._core.pytree import find_states
from jmp_policy._loss_scaling.gradient_stats import GradientStats
from jmp_policy._loss_scaling.leaf_flags import LeafFlags
from jmp_policy._loss_scaling.loss_scale import (
    LossScale,
)
from jmp_policy._loss_scaling.misuse import note_scale_read
from jmp_policy._loss_scaling.records import SkipRecords
from jmp_policy._loss_scaling.spikes import SpikeStats

T = TypeVar("T")


class LossScalingState(NamedTuple):
    """The state of `loss_scaling`: what every configuration needs, and its parts' states.

    Attributes:
      loss_scale: the current `LossScale` (the one the next step's loss must be
        scaled with).
      inner_state: the wrapped optimizer's state; untouched by skipped steps.
      applied_steps: steps whose update was applied (int32, saturating).
      skipped_steps: steps skipped (int32, saturating).
      nonfinite_run: the current run of consecutive skipped steps; 0 after an
        applied step (int32, saturating). A long run means the loss itself is
        not finite, or the scale is stuck at its floor.
      last_step_skipped: whether the most recent step was skipped (bool).
      parts: the states of the parts composed in, in order: the skip records
        (`SkipRecords`, always), `GradientStats` (with `stats_every=N`) and
        `SpikeStats` (with `skip_spikes=`). Read them by name:

    - `nonfinite_leaves`: for the most recent step with non-finite gradients, a `LeafFlags`
      with a bool per gradient leaf: True where that leaf held an inf or NaN (after
      unscaling). All False until then. One packed array, a by-product of the finite check
      itself (which works per leaf). Read it with `nonfinite_leaves.paths()`, `.tree()`, or
      `jmp_policy.loss_scaling_report`.
    - `skip_causes`: skipped steps by cause (int32, saturating), in the order of
      `SKIP_CAUSES`: non-finite loss, non-finite gradients, spike. A step whose `update` was
      not given the loss (`value=loss`) counts its non-finite gradients as the second.
    - `last_skip_cause`: the most recent skipped step's `SkipCause` (int32); 0 until a skip.
    - `gradient_stats`: the `GradientStats` of the scaled gradients with
      `loss_scaling(..., stats_every=N)`; None otherwise.
    - `spike_stats`: the running means and spreads spikes are judged against (`SpikeStats`)
      with `loss_scaling(..., skip_spikes=SkipSpikes())`; None otherwise.
    """

    loss_scale: LossScale
    inner_state: optax.OptState
    applied_steps: jax.Array  # shape=(), dtype=jnp.int32
    skipped_steps: jax.Array  # shape=(), dtype=jnp.int32
    nonfinite_run: jax.Array  # shape=(), dtype=jnp.int32
    last_step_skipped: jax.Array  # shape=(), dtype=jnp.bool_
    parts: tuple = ()  # SkipRecords, then GradientStats and SpikeStats where configured

    def part(self, kind: type[T]) -> T | None:
        """The state of the part of type `kind` (`SkipRecords`, `GradientStats`,
        `SpikeStats`), or None where this configuration has none."""
        return next((p for p in self.parts if isinstance(p, kind)), None)

    @property
    def nonfinite_leaves(self) -> LeafFlags:
        return self._records().nonfinite_leaves

    @property
    def skip_causes(self) -> jax.Array:
        return self._records().skip_causes

    @property
    def last_skip_cause(self) -> jax.Array:
        return self._records().last_skip_cause

    @property
    def gradient_stats(self) -> GradientStats | None:
        return self.part(GradientStats)

    @property
    def spike_stats(self) -> SpikeStats | None:
        return self.part(SpikeStats)

    def _records(self) -> SkipRecords:
        records = self.part(SkipRecords)
        if records is None:
            raise ValueError(
                "Expected the skip records in this LossScalingState's `parts`, found none: "
                "was it made by `jmp_policy.loss_scaling(...).init(params)`?"
            )
        return records


def find_loss_scaling_state(opt_state: Any) -> LossScalingState:
    """Returns the `LossScalingState` inside `opt_state`, wherever it sits.

    Looks through `optax.chain` tuples, `optax.MultiSteps`,
    `optax.inject_hyperparams` and any other pytree of states, a Flax
    `TrainState` (its `opt_state`) and an `nnx.Optimizer`.

    Raises:
      ValueError: there is no `loss_scaling` state, or more than one.
    """
    found = find_states(opt_state, LossScalingState)
    if len(found) != 1:
        what = "none" if not found else f"{len(found)}"
        raise ValueError(
            f"Expected exactly one `loss_scaling` state in `opt_state`, found {what} in a "
            f"{type(opt_state).__name__}. Build the optimizer as "
            "`jmp_policy.loss_scaling(inner, jmp_policy.DynamicLossScale(2.0**15))` (it may "
            "sit inside optax.chain, MultiSteps or inject_hyperparams)."
        )
    return found[0]


def unless_skipped(opt_state: Any, new: T, old: T) -> T:
    """`new` if the step that produced `opt_state` was applied, `old` if it was skipped.

    A skipped step leaves parameters and the inner optimizer state as they were;
    this carries the same decision to everything else a step returns: the model
    state its forward pass wrote (Linen `batch_stats`, an `eqx.nn.State`, NNX
    variables; `jmp_policy.nnx.revert_if_skipped` does it for NNX models). A
    forward pass that overflows writes NaN batch statistics, and kept, they
    poison every later step. Call it after `tx.update` (or `apply_gradients`),
    inside the jitted step: the choice is a `select` per array leaf, no host sync.

    Args:
      opt_state: the optimizer state after this step's update (an optax state
        holding a `loss_scaling` state, a Flax `TrainState` or an
        `nnx.Optimizer`).
      new: what this step made, e.g. the updated batch statistics.
      old: the same tree as it was before the step.

    Returns:
      `new` when the step was applied, else `old`, leaf by leaf. Leaves that
      are not arrays (an Equinox module's functions) are taken from `new`, and so
      is every `loss_scaling` state inside it (the skip, its cause and the scale's
      move are this step's news): `unless_skipped(new_state, new_state, state)` over
      a whole Flax `TrainState` keeps its `step`, so `step` counts applied steps.

    Raises:
      ValueError: `opt_state` holds no `loss_scaling` state, or `new` and `old`
        differ in structure.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import jmp_policy as jmp
      >>> tx = jmp.loss_scaling(optax.sgd(0.1), jmp.DynamicLossScale(2.0**10))
      >>> params = {"w": jnp.ones(2)}
      >>> stats = {"mean": jnp.zeros(2)}
      >>> _, opt_state = tx.update({"w": jnp.array([1.0, jnp.nan])}, tx.init(params), params)
      >>> jmp.unless_skipped(opt_state, {"mean": jnp.array([jnp.nan, 1.0])}, stats)
      {'mean': Array([0., 0.], dtype=float32)}
    """
    skipped = find_loss_scaling_state(opt_state).last_step_skipped

    def is_state(x: Any) -> bool:
        return isinstance(x, LossScalingState)

    new_leaves, treedef = jax.tree.flatten(new, is_leaf=is_state)
    old_leaves, old_treedef = jax.tree.flatten(old, is_leaf=is_state)
    if treedef != old_treedef:
        raise ValueError(
            "Expected `new` and `old` of the same structure (what the step made, and the same "
            f"tree before the step), got {treedef} and {old_treedef}."
        )

    def keep(n: Any, o: Any) -> Any:
        if isinstance(n, bool) or not isinstance(
            n, (jax.Array, np.ndarray, np.generic, int, float)
        ):
            return n  # a function leaf, a flag, or a loss_scaling state
        # A batched state (vmap over ensembles) has a decision per member.
        pick = jnp.reshape(skipped, jnp.shape(skipped) + (1,) * (jnp.ndim(n) - jnp.ndim(skipped)))
        return jnp.where(pick, jnp.asarray(o), jnp.asarray(n))

    kept = [keep(n, o) for n, o in zip(new_leaves, old_leaves, strict=True)]
    return jax.tree.unflatten(treedef, kept)


def get_loss_scale(opt_state: Any) -> LossScale:
    """Returns the current loss scale inside the state of `loss_scaling`.

    Works wherever the transform sits: inside `optax.chain`, `optax.MultiSteps`,
    `optax.inject_hyperparams`, a Flax `TrainState` or an `nnx.Optimizer`. Use it
    to scale the loss: `get_loss_scale(opt_state).scale(loss)`.

    Args:
      opt_state: an optimizer state, a `TrainState` or an `nnx.Optimizer`.

    Returns:
      The `LossScale` the next step's loss must be scaled with.

    Raises:
      ValueError: `opt_state` holds no `loss_scaling` state (or several).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import jmp_policy as jmp
      >>> tx = optax.MultiSteps(jmp.loss_scaling(optax.sgd(0.1), jmp.StaticLossScale(8)), 4)
      >>> jmp.get_loss_scale(tx.init({"w": jnp.ones(2)}))
      StaticLossScale(loss_scale=8.0)
    """
    state = find_loss_scaling_state(opt_state)
    note_scale_read(state)  # gradients that arrive into a step were scaled by it
    return state.loss_scale
