"""Host-side answers to "why did my loss go NaN / why does it keep skipping?".

These read a `loss_scaling` state after a step (they wait for the device, so
call them every N steps, e.g. when you log), never inside a jitted step; among
what they read, the gradients' `GradientStats` that `loss_scaling(...,
stats_every=N)` collects inside the step.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import jax
import numpy as np
from jax.core import Tracer

from jmp_policy._core.text import format_scale
from jmp_policy._core.validation import MANY_SPIKES, warn_once_per_mistake
from jmp_policy._loss_scaling.gradient_stats import (
    GradientStats as GradientStats,  # its public home
)
from jmp_policy._loss_scaling.leaf_flags import host_value
from jmp_policy._loss_scaling.loss_scale import DynamicLossScale
from jmp_policy._loss_scaling.records import SKIP_CAUSES, SkipCause
from jmp_policy._loss_scaling.state import find_loss_scaling_state
from jmp_policy._reports.census import PrecisionWarning
from jmp_policy.errors import NonFiniteLossError as NonFiniteLossError  # importable here too

UNSCALED_HINT_SCALE = 2.0**24
"""A dynamic scale past this (Apex's cap) with no overflow ever: the gradients were not scaled."""


@dataclasses.dataclass(frozen=True)
class LossScalingReport:
    """A host-side snapshot of a `loss_scaling` state.

    Attributes:
      loss_scale: the current scale S.
      applied_steps: steps applied so far.
      skipped_steps: steps skipped so far (non-finite gradients).
      nonfinite_run: the current run of consecutive skipped steps.
      last_step_skipped: whether the latest step was skipped.
      at_floor: whether S is at its floor (`min_loss_scale`); a skip there
        cannot be cured by a smaller scale.
      nonfinite_paths: the parameter paths whose gradients held inf/NaN in the
        latest skipped step. `str()` names them only while the latest step was
        a skipped one, so a log line does not repeat an old overflow.
      gradient_stats: with `loss_scaling(..., stats_every=N)`, the latest collected
        statistics of the scaled gradients, `{path: {"amax", "min_nonzero",
        "underflow", "overflow", "headroom"}}` (headroom: doublings of the loss scale
        left before that leaf overflows); None when not collected (yet).
      stats_step: the step they were collected at (None when not collected).
      skip_causes: skipped steps by cause, `{cause: count}` for each of
        `jmp_policy.scaling.SKIP_CAUSES` ("non-finite loss", "non-finite gradients", "spike");
        `str()` lists them when any cause but overflowing gradients occurred.
      last_skip_cause: the latest skipped step's cause, or None before any skip. While the
        latest step was skipped, `str()` says the cause in words with its fix.
      hint: a likely misuse read from these figures, or None. A dynamic scale past 2^24
        (Apex's cap) that has never overflowed means the gradients did not come from the
        scaled loss: `str()` then says so and points to `value_and_scaled_grad`. A scale at
        its floor with the latest steps skipped means no smaller scale can help: `str()`
        says so and names the likely causes.
    """

    loss_scale: float
    applied_steps: int
    skipped_steps: int
    nonfinite_run: int
    last_step_skipped: bool
    at_floor: bool
    nonfinite_paths: tuple[str, ...]
    gradient_stats: dict[str, dict[str, float]] | None = None
    stats_step: int | None = None
    hint: str | None = None
    skip_causes: dict[str, int] = dataclasses.field(default_factory=dict)
    last_skip_cause: str | None = None

    def __str__(self) -> str:
        text = (
            f"loss scale {format_scale(self.loss_scale)}; applied {self.applied_steps}, skipped "
            f"{self.skipped_steps} (current run {self.nonfinite_run})"
        )
        counted = {cause: n for cause, n in self.skip_causes.items() if n}
        if counted and set(counted) != {"non-finite gradients"}:
            text += " by cause: " + ", ".join(f"{cause} {n}" for cause, n in counted.items())
        if self.last_step_skipped and self.last_skip_cause in _FIXES:
            text += f"; the last step was skipped for {self.last_skip_cause}: "
            text += _FIXES[self.last_skip_cause]
        if self.last_step_skipped and self.nonfinite_paths:
            shown = ", ".join(self.nonfinite_paths[:5])
            more = len(self.nonfinite_paths) - 5
            text += f"; last non-finite gradients in {shown}" + (f" (+{more})" if more > 0 else "")
        if self.gradient_stats:
            stats = self.gradient_stats
            tight = min(stats, key=lambda p: stats[p]["headroom"])
            lost = max(stats, key=lambda p: stats[p]["underflow"])
            text += (
                f"; gradients at step {self.stats_step}: headroom "
                f"{stats[tight]['headroom']:g} doublings (least at {tight}), underflow "
                f"{100 * stats[lost]['underflow']:.1f}% (most at {lost})"
            )
        if self.hint:
            text += f". {self.hint}"
        return text


_FIXES = {
    "non-finite loss": (
        "the loss itself was inf or NaN (an inf or NaN in the batch or the targets, or a "
        "forward pass past the compute dtype's range), which no loss scale cures, so the "
        "scale was left as it was. Check the batch; for a forward overflow, "
        "jmp_policy.debug_precision(loss_fn, params, batch) names the first non-finite "
        "operation, to keep in float32 (overrides, jmp_policy.full_precision)"
    ),
    "spike": (
        "its loss or global gradient norm jumped more than SkipSpikes.threshold spreads (the "
        "run's own step-to-step noise) above its running mean (loss_scaling(..., "
        "skip_spikes=SkipSpikes(...))); the scale was left as it was, and after max_run "
        "spikes in a row the next step is taken. Many spikes: look at the data order and "
        "the learning rate, or raise SkipSpikes.threshold"
    ),
    "non-finite gradients": (
        "the scaled gradients overflowed, which backing off the scale cures (normal now "
        "and then; a loss not passed to update as value=loss counts here too)"
    ),
}


def loss_scaling_report(opt_state: Any) -> LossScalingReport | tuple[LossScalingReport, ...]:
    """Reads the counters and diagnostics of the `loss_scaling` state in `opt_state`.

    Args:
      opt_state: an optimizer state (or `TrainState`, or `nnx.Optimizer`) that
        holds a `loss_scaling` state.

    Returns:
      A `LossScalingReport`; for a batched state (`jax.vmap` of `init` over an ensemble), a
      tuple of them, one per member (in row-major order of the batch axes).

    Raises:
      TypeError: called under `jit` (or another transform): the report reads the state on the
        host. Call it outside the step, on the state the step returned.
      ValueError: `opt_state` holds no `loss_scaling` state, or several.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import jmp_policy as jmp
      >>> tx = jmp.loss_scaling(optax.sgd(0.1), jmp.DynamicLossScale(4.0))
      >>> params = {"fc": {"w": jnp.ones(2)}, "b": jnp.ones(1)}
      >>> state = tx.init(params)
      >>> grads = {"fc": {"w": jnp.array([1.0, jnp.nan])}, "b": jnp.ones(1)}
      >>> _, state = tx.update(grads, state, params)
      >>> print(jmp.loss_scaling_report(state))  # doctest: +NORMALIZE_WHITESPACE
      loss scale 2^1; applied 0, skipped 1 (current run 1); the last step was skipped for
      non-finite gradients: the scaled gradients overflowed, which backing off the scale cures
      (normal now and then; a loss not passed to update as value=loss counts here too); last
      non-finite gradients in ['fc']['w']
    """
    state = find_loss_scaling_state(opt_state)
    if any(isinstance(x, Tracer) for x in jax.tree.leaves(state)):
        raise TypeError(
            "Expected a concrete loss_scaling state for loss_scaling_report, got traced values: "
            "the report reads the state on the host, so it cannot run inside `jit` (or "
            "`vmap`, `grad`). Call it outside the step, on the state the step returned, e.g. "
            "every N steps of the training loop."
        )
    batch = np.shape(state.applied_steps)
    if batch:  # an ensemble's state: one report per member
        return tuple(_report(jax.tree.map(lambda x, i=i: x[i], state)) for i in np.ndindex(*batch))
    return _report(state)


def _report(state: Any) -> LossScalingReport:
    scale = state.loss_scale
    scale_value = float(host_value(scale.loss_scale))
    at_floor = isinstance(scale, DynamicLossScale) and scale_value <= scale.floor
    paths = state.nonfinite_leaves.paths()
    gradient_stats, stats_step = _read_stats(state)
    skipped = int(host_value(state.skipped_steps))
    hint = None
    if isinstance(scale, DynamicLossScale) and scale_value > UNSCALED_HINT_SCALE and skipped == 0:
        hint = (
            f"The loss scale grew to 2^{math.log2(scale_value):.0f} without a single non-finite "
            "step: the gradients were probably not computed from the scaled loss (e.g. plain "
            "jax.grad next to loss_scaling), so every update is that many times too small. "
            "Compute them with jmp_policy.value_and_scaled_grad(loss_fn)(opt_state, params, ...)"
        )
    counts = (int(n) for n in host_value(state.skip_causes))
    causes: dict[str, int] = dict(zip(SKIP_CAUSES, counts, strict=True))
    _warn_if_spikes_are_many(causes["spike"], int(host_value(state.applied_steps)))
    run = int(host_value(state.nonfinite_run))
    if isinstance(scale, DynamicLossScale) and at_floor and run > 0:
        hint = (
            f"The scale sits at its floor (min_loss_scale={scale.floor:g}) and the last {run} "
            "step(s) were skipped: a smaller scale cannot cure them. The overflow is in the "
            "forward pass, the loss or the parameters themselves, not in the scaled gradients: "
            "parameters stored in float16 (a policy such as 'float16' or 'f16' instead of "
            "'mixed_float16'), a non-finite batch, or activations past float16's range "
            "(jmp_policy.debug_precision(loss_fn, params, batch) names the first operation)"
        )
    return LossScalingReport(
        loss_scale=scale_value,
        applied_steps=int(host_value(state.applied_steps)),
        skipped_steps=skipped,
        nonfinite_run=run,
        last_step_skipped=bool(host_value(state.last_step_skipped)),
        at_floor=bool(at_floor),
        nonfinite_paths=paths,
        gradient_stats=gradient_stats,
        stats_step=stats_step,
        hint=hint,
        skip_causes=causes,
        last_skip_cause=(
            SkipCause(cause).label if (cause := int(host_value(state.last_skip_cause))) else None
        ),
    )


# More spikes than this share of the steps (and at least `_MANY_SPIKES`) suggests a wrong
# setting: the defaults skipped none of 14,000 healthy steps (`SkipSpikes`).
_SPIKE_SHARE, _MANY_SPIKES = 0.01, 5


def _warn_if_spikes_are_many(spikes: int, applied: int) -> None:
    """Once per process: spikes skipped at a rate no healthy run shows."""
    if spikes < _MANY_SPIKES or spikes <= _SPIKE_SHARE * (spikes + applied):
        return
    warn_once_per_mistake(
        MANY_SPIKES,
        f"loss_scaling skipped {spikes} of {spikes + applied} steps as spikes "
        f"({spikes / (spikes + applied):.1%}), more than the {_SPIKE_SHARE:.0%} that "
        "suggests a wrong setting: healthy runs skip none with the defaults. A `threshold` "
        "far below 10, a `warmup` too short for the spread to settle, or a loss passed as "
        "`value` that is not the training loss (a sum over a variable batch, a metric) "
        "would do it; if the data really is this bursty, raise SkipSpikes.threshold.",
        PrecisionWarning,
    )


def _read_stats(state: Any) -> tuple[dict[str, dict[str, float]] | None, int | None]:
    stats = state.gradient_stats
    if stats is None or int(host_value(stats.step)) < 0:
        return None, None
    treedef = state.nonfinite_leaves.treedef
    numbered = jax.tree.unflatten(treedef, range(treedef.num_leaves))
    columns = {
        name: np.asarray(host_value(getattr(stats, name)), np.float64)
        for name in ("amax", "min_nonzero", "underflow", "overflow")
    }
    largest = float(host_value(stats.largest))
    out = {}
    for path, i in jax.tree_util.tree_leaves_with_path(numbered):
        row = {name: float(column[i]) for name, column in columns.items()}
        amax = row["amax"]
        row["headroom"] = float(math.floor(math.log2(largest / amax))) if amax > 0 else math.inf
        out[jax.tree_util.keystr(path)] = row
    return out, int(host_value(stats.step))


def check_loss_scaling(
    opt_state: Any, max_nonfinite_run: int = 20
) -> LossScalingReport | tuple[LossScalingReport, ...]:
    """Raises when training has skipped too many steps in a row; else reports.

    A dynamic loss scale cures overflow by backing off, so a long run of
    skipped steps means the loss itself is inf/NaN (bad data, a bug, a
    learning rate that diverged) or the scale is stuck at its floor. Call this
    every N steps so such a run stops training loudly instead of skipping
    silently forever.

    Args:
      opt_state: the optimizer state (or `TrainState`, or `nnx.Optimizer`).
      max_nonfinite_run: how many consecutive skipped steps to tolerate (>= 1).

    Returns:
      The `LossScalingReport` (a tuple of them for a batched state, as `loss_scaling_report`
      gives), when every run is shorter than `max_nonfinite_run`. When the
      report has a `hint` (a scale past 2^24 that never overflowed: unscaled gradients), a
      `jmp_policy.errors.PrecisionWarning` says it too.

    Raises:
      NonFiniteLossError: `max_nonfinite_run` or more consecutive steps were
        skipped; the message says which parameters had non-finite gradients.
      ValueError: `max_nonfinite_run` < 1.
    """
    if isinstance(max_nonfinite_run, bool) or not isinstance(max_nonfinite_run, int):
        raise TypeError(
            f"Expected an integer >= 1 for `max_nonfinite_run`, got {max_nonfinite_run!r}."
        )
    if max_nonfinite_run < 1:
        raise ValueError(
            f"Expected an integer >= 1 for `max_nonfinite_run`, got {max_nonfinite_run}."
        )
    reports = loss_scaling_report(opt_state)
    for report in reports if isinstance(reports, tuple) else (reports,):
        if report.nonfinite_run >= max_nonfinite_run:
            cause = (
                "the loss scale is at its floor, so a smaller scale cannot cure it"
                if report.at_floor
                else "backing off the loss scale has not cured it"
            )
            raise NonFiniteLossError(
                f"{report.nonfinite_run} consecutive steps had inf/NaN gradients and were "
                f"skipped; {cause}. The loss itself is probably not finite: check the data and "
                "the loss for NaN, lower the learning rate, or keep fragile ops (softmax, log, "
                f"losses) in float32. Status: {report}."
            )
        if report.hint:
            warnings.warn(f"check_loss_scaling: {report.hint}.", PrecisionWarning, stacklevel=2)
    return reports
