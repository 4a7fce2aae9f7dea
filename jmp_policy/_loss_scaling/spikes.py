"""Spike skipping for `loss_scaling` (a `Part`, on with `skip_spikes=`): the settings
(`SkipSpikes`), the running statistics kept in the state (`SpikeStats`), and the one decision
on every device."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jmp_policy._core.validation import whole_number
from jmp_policy._loss_scaling.finite import agree, global_norm
from jmp_policy._loss_scaling.parts import Part, Step
from jmp_policy._loss_scaling.records import SkipCause

# How far above its running mean a statistic must jump, in spreads, and the windows, chosen on
# healthy noisy runs (benchmarks/bench_spikes.py --healthy; docs/loss_scaling.md has the
# figures): none of their 14,000 steps was skipped, nor of 12,000 more of classifiers driven to
# a training loss of 1e-3, and 2 of 6,000 of ones driven to 1e-4 (whose largest healthy jumps
# reach 14-15 spreads); every planted corrupted batch (hundreds of spreads) was skipped.
_THRESHOLD, _MEAN_DECAY, _SPREAD_DECAY = 10.0, 0.95, 0.999
# A spread is never taken below this fraction of its statistic's magnitude (a constant loss
# has none), nor below float32's resolution.
_RELATIVE_FLOOR, _ABSOLUTE_FLOOR = 1e-3, 1e-12


@dataclasses.dataclass(frozen=True)
class SkipSpikes:
    """Spike skipping for `loss_scaling(..., skip_spikes=SkipSpikes(...))` (off by default).

    A step is a spike when its loss (given to `update` as `value=loss`), or the logarithm of
    its unscaled gradients' global norm, lies `threshold` spreads or more above its running
    mean: a z-score, as OLMo-core's and llm.c's hand-written spike skips use, that depends on
    neither the sign nor the scale of the loss (a negative log-likelihood below zero, an RL
    objective, a loss near zero are judged alike) and adapts to how noisy the run is. The
    gradient norm is judged on a log scale, since its noise is multiplicative. Without
    `value` the gradient norm alone is judged. Only jumps up are spikes.

    The mean is an exponential moving average (`mean_decay`) of the applied steps' values; the
    spread is the root mean square of the differences between consecutive applied steps
    (`spread_decay`, bias-corrected, divided by sqrt(2)), so a loss that trends down as it
    trains does not widen it, while a run's own noise, hard batches included, does. The
    statistics learn from applied steps only, so a spike never teaches them. A spike is
    skipped by the same decision that skips a non-finite step (parameters, optimizer state
    and, through `unless_skipped`, model state kept); the loss scale does not back off. After
    `max_run` spikes in a row the next step is taken and the statistics start again from it
    (a new warm-up), so a real change of regime (a new data mixture, a learning-rate jump)
    does not stall training.

    The defaults skipped none of 14,000 healthy steps (a classifier driven to a near-zero loss
    at batch 16, a Gaussian NLL below zero, a policy-gradient objective; two seeds each) and
    every planted corrupted batch (benchmarks/bench_spikes.py). Where it can fail: a loss far
    more heavy-tailed still (a classifier at a training loss of 1e-4) skipped 2 of 3,000
    healthy steps on one of two seeds; raise `threshold` for such a run.

    Attributes:
      threshold: how many spreads above its running mean a value must lie to be a spike
        (> 0; default 10).
      warmup: applied steps before any step is judged (>= 1; default 100).
      max_run: spike skips in a row after which the next step is taken (>= 1; default 5).
      mean_decay: the running mean's decay per applied step, in (0, 1) (default 0.95).
      spread_decay: the spread's decay per applied step, in (0, 1) (default 0.999, a window
        of about 1,000 steps).

    Raises:
      ValueError: a value outside the ranges above; TypeError: not a number, or `factor` or
        `decay` (the settings of the earlier ratio test, which judged a loss against a
        multiple of its mean).
    """

    threshold: float = _THRESHOLD
    warmup: int = 100
    max_run: int = 5
    mean_decay: float = _MEAN_DECAY
    spread_decay: float = _SPREAD_DECAY
    factor: dataclasses.InitVar[None] = None
    decay: dataclasses.InitVar[None] = None

    def __post_init__(self, factor, decay):
        if factor is not None or decay is not None:
            raise TypeError(
                "SkipSpikes no longer takes `factor` or `decay`: a step is judged in spreads "
                "above its running mean, not as a multiple of the mean (wrong for a loss "
                "below zero or near it). Use `threshold` (spreads, default 10), `mean_decay` "
                "and `spread_decay`."
            )
        for name, low, high in (
            ("threshold", 0.0, math.inf),
            ("mean_decay", 0.0, 1.0),
            ("spread_decay", 0.0, 1.0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"Expected a number for `{name}`, got {value!r}.")
            if not low < value < high:
                raise ValueError(f"Expected `{name}` in ({low:g}, {high:g}), got {value!r}.")
        whole_number(self.warmup, "warmup", low=1)
        whole_number(self.max_run, "max_run", low=1)


class SpikeStats(NamedTuple):
    """The running statistics of `SkipSpikes`, in `LossScalingState.spike_stats` (float32
    unless said). `loss_*` are of the loss, `norm_*` of the log of the global gradient norm.

    Attributes:
      loss_mean, norm_mean: running means of the applied steps' values.
      loss_spread, norm_spread: running mean squares of the differences between consecutive
        applied steps' values (not yet bias-corrected: see `spread`).
      loss_last, norm_last: the last applied step's values.
      spread_weight: the spreads' total weight, 1 - spread_decay**n after n differences
        (their bias correction, as Adam's, kept up by one multiply-add a step).
      seen: applied steps learnt from since the statistics (re)started (int32, saturating).
      run: spike skips in a row (int32).
    """

    loss_mean: jax.Array
    loss_spread: jax.Array
    loss_last: jax.Array
    norm_mean: jax.Array
    norm_spread: jax.Array
    norm_last: jax.Array
    spread_weight: jax.Array
    seen: jax.Array
    run: jax.Array

    @classmethod
    def empty(cls) -> SpikeStats:
        """Zeros, each field its own buffer (a donated state may not hold one twice)."""

        def zero(dtype: Any = jnp.float32) -> jax.Array:
            return jnp.zeros((), dtype)

        return cls(
            loss_mean=zero(),
            loss_spread=zero(),
            loss_last=zero(),
            norm_mean=zero(),
            norm_spread=zero(),
            norm_last=zero(),
            spread_weight=zero(),
            seen=zero(jnp.int32),
            run=zero(jnp.int32),
        )


def spread(mean_square: jax.Array, mean: jax.Array, weight: jax.Array) -> jax.Array:
    """The spread a value is judged in: sqrt of the bias-corrected mean square of consecutive
    differences over 2 (the standard deviation of the noise, for independent noise), floored.
    `weight`: `SpikeStats.spread_weight` (0 before the first difference)."""
    corrected = mean_square / jnp.maximum(weight, _ABSOLUTE_FLOOR)
    floor = jnp.maximum(_RELATIVE_FLOOR * jnp.abs(mean), _ABSOLUTE_FLOOR)
    return jnp.maximum(jnp.sqrt(corrected / 2), floor)


def judge_spike(config, stats, finite, grads, value, axis_name):
    """Whether this step is a spike (`SkipSpikes`), and the statistics after it: learnt from
    the step only when it is applied. The same decision on every device of `axis_name`."""
    norm = global_norm(grads)
    loss = (
        jnp.zeros((), jnp.float32)
        if value is None
        else jnp.asarray(value).astype(jnp.float32).reshape(())
    )
    if axis_name is not None:  # per-device gradients: the statistics of the whole batch
        norm, loss = lax.pmean(norm, axis_name), lax.pmean(loss, axis_name)
    # log(0) is -inf: a zero gradient is never a spike, and is learnt as the smallest norm.
    log_norm = jnp.log(jnp.maximum(norm, jnp.finfo(jnp.float32).tiny))

    def z(x, mean, mean_square):
        return (x - mean) / spread(mean_square, mean, stats.spread_weight)

    warm = stats.seen >= config.warmup
    above = z(log_norm, stats.norm_mean, stats.norm_spread) >= config.threshold
    if value is not None:
        above = above | (z(loss, stats.loss_mean, stats.loss_spread) >= config.threshold)
    # A spike on any device is a spike on every device.
    jump = ~agree(~(warm & above & finite), axis_name)
    spike = jump & (stats.run < config.max_run)
    applied = finite & ~spike
    # The first step, and a jump taken after `max_run` spikes in a row (a new regime): the
    # statistics start again from it, with a new warm-up.
    first = (stats.seen == 0) | (jump & ~spike)

    def learn(x, mean, mean_square, last):
        mean = jnp.where(first, x, config.mean_decay * mean + (1 - config.mean_decay) * x)
        moved = config.spread_decay * mean_square + (1 - config.spread_decay) * (x - last) ** 2
        return mean, jnp.where(first, 0.0, moved), x

    def kept(new, old):
        return tuple(jnp.where(applied, n, o) for n, o in zip(new, old, strict=True))

    loss_stats = kept(
        learn(loss, stats.loss_mean, stats.loss_spread, stats.loss_last),
        (stats.loss_mean, stats.loss_spread, stats.loss_last),
    )
    norm_stats = kept(
        learn(log_norm, stats.norm_mean, stats.norm_spread, stats.norm_last),
        (stats.norm_mean, stats.norm_spread, stats.norm_last),
    )
    # The first step has no difference yet; each later one adds its weight (1 - decay).
    decay = config.spread_decay
    weight = jnp.where(stats.seen == 0, 0.0, decay * stats.spread_weight + (1 - decay))
    weight = jnp.where(first, 0.0, weight)
    seen = jnp.where(first, 1, optax.safe_int32_increment(stats.seen))
    learnt = SpikeStats(
        *loss_stats,
        *norm_stats,
        spread_weight=jnp.where(applied, weight, stats.spread_weight),
        seen=jnp.where(applied, seen, stats.seen).astype(jnp.int32),
        run=jnp.where(spike, stats.run + 1, 0).astype(jnp.int32),
    )
    return spike, learnt


@dataclasses.dataclass(frozen=True)
class Spikes(Part):
    """The spike-skipping part of `loss_scaling`: vetoes a finite step that is a spike."""

    state_type = SpikeStats
    config: SkipSpikes
    skip_cause = SkipCause.SPIKE

    def init(self, params: Any) -> SpikeStats:
        del params
        return SpikeStats.empty()

    def veto(self, state: SpikeStats, step: Step) -> tuple[jax.Array, SpikeStats]:
        return judge_spike(self.config, state, step.finite, step.grads, step.value, step.axis_name)
