"""Spike skipping for `loss_scaling`: why a step was skipped (`SKIP_CAUSES`), the
settings (`SkipSpikes`), the running statistics kept in the state (`SpikeStats`), and
the one decision on every device."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jmp_policy._validation import whole_number
from jmp_policy.finite import agree, global_norm

SKIP_CAUSES = ("non-finite loss", "non-finite gradients", "spike")
"""Why `loss_scaling` skipped a step (`LossScalingState.skip_causes` counts them in this order):

- "non-finite loss": the loss itself was inf or NaN (an inf in the batch, a NaN target, a
  forward pass past the compute dtype's range). No loss scale cures it, so the scale is left
  as it was. Known only when `update` is given the loss (`value=loss`).
- "non-finite gradients": the loss was finite (or not given) and its scaled gradients
  overflowed: the loss scale's doing, cured by backing it off.
- "spike": with `loss_scaling(..., skip_spikes=SkipSpikes())`, a finite loss or global
  gradient norm far above its running mean (`SkipSpikes`). The scale is left as it was.
"""


@dataclasses.dataclass(frozen=True)
class SkipSpikes:
    """Spike skipping for `loss_scaling(..., skip_spikes=SkipSpikes(...))` (off by default).

    After `warmup` applied steps, a step is skipped, by the same decision that skips a
    non-finite one (parameters, optimizer state and, through `unless_skipped`, model state
    kept), when its loss (given to `update` as `value=loss`) or the global norm of its
    unscaled gradients exceeds `factor` times its running mean. The means are exponential
    moving averages (`decay`) of applied steps only, so a spike never teaches the statistics.
    After `max_run` spike skips in a row the next step is taken and the means start again
    from it, so a real change of regime (a new data mixture, a learning-rate jump) does not
    stall training. The loss scale does
    not back off for a spike. Losses are compared as they are: use it with a positive loss
    (cross-entropy, squared error), or compare the gradient norm alone (no `value`).

    Attributes:
      factor: how many times the running mean a value must exceed to be a spike (> 1).
      warmup: applied steps before any step is judged (>= 1).
      max_run: spike skips in a row after which the next step is taken (>= 1).
      decay: the running means' decay per applied step, in (0, 1).

    Raises:
      ValueError: a value outside the ranges above; TypeError: not a number.
    """

    factor: float = 10.0
    warmup: int = 100
    max_run: int = 5
    decay: float = 0.99

    def __post_init__(self):
        for name, low, high in (("factor", 1.0, math.inf), ("decay", 0.0, 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"Expected a number for `{name}`, got {value!r}.")
            if not low < value < high:
                raise ValueError(f"Expected `{name}` in ({low:g}, {high:g}), got {value!r}.")
        whole_number(self.warmup, "warmup", low=1)
        whole_number(self.max_run, "max_run", low=1)


class SpikeStats(NamedTuple):
    """The running statistics of `SkipSpikes`, in `LossScalingState.spike_stats`.

    Attributes:
      loss_mean: running mean of the applied steps' losses (float32; 0 before the first).
      norm_mean: running mean of the applied steps' global gradient norms (float32).
      seen: applied steps the means have learnt from (int32, saturating).
      run: spike skips in a row (int32).
    """

    loss_mean: jax.Array
    norm_mean: jax.Array
    seen: jax.Array
    run: jax.Array


def _judge_spike(config, stats, finite, grads, value, axis_name):
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
    warm = stats.seen >= config.warmup
    above = norm > config.factor * stats.norm_mean
    if value is not None:
        above = above | (loss > config.factor * stats.loss_mean)
    # A spike on any device is a spike on every device.
    jump = ~agree(~(warm & above & finite), axis_name)
    spike = jump & (stats.run < config.max_run)
    applied = finite & ~spike
    # The first step, and a jump taken after `max_run` spikes in a row (a new regime: the
    # running means start again from it, or every later step would be a spike too).
    first = (stats.seen == 0) | (jump & ~spike)

    def mean(old, new):
        return jnp.where(first, new, config.decay * old + (1 - config.decay) * new)

    learnt = SpikeStats(
        loss_mean=jnp.where(applied, mean(stats.loss_mean, loss), stats.loss_mean),
        norm_mean=jnp.where(applied, mean(stats.norm_mean, norm), stats.norm_mean),
        seen=jnp.where(applied, optax.safe_int32_increment(stats.seen), stats.seen),
        run=jnp.where(spike, stats.run + 1, 0).astype(jnp.int32),
    )
    return spike, learnt
