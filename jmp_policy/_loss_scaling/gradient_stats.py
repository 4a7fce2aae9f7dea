"""Per-leaf statistics of the scaled gradients inside a jitted step (a `Part` of
`loss_scaling`, on with `stats_every=N`), read by `jmp_policy._loss_scaling.diagnostics`."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from jmp_policy._loss_scaling.parts import Part, Step


class GradientStats(NamedTuple):
    """Per-leaf statistics of the scaled gradients, collected inside a jitted step.

    Made by `loss_scaling(..., stats_every=N)` every N steps (the others keep the last ones),
    without a host sync; `loss_scaling_report` reads them. One float32 vector per statistic,
    one entry per gradient leaf, in `jax.tree.leaves` order.

    Attributes:
      step: the step (applied plus skipped, counted from 0) they were collected at; -1 before.
      amax: the largest finite magnitude.
      min_nonzero: the smallest nonzero finite magnitude (inf if none).
      underflow: the fraction of nonzero values below the target dtype's smallest normal.
      overflow: the fraction of finite values above the target dtype's largest value.
      largest: the target dtype's largest value (a scalar), to read the headroom:
        `log2(largest / amax)` doublings of the loss scale are left.
    """

    step: jax.Array
    amax: jax.Array
    min_nonzero: jax.Array
    underflow: jax.Array
    overflow: jax.Array
    largest: jax.Array


def empty_gradient_stats(leaves: int, dtype: DTypeLike) -> GradientStats:
    """The `GradientStats` before any collection (step -1); every field its own buffer, so the
    state can be donated."""
    return GradientStats(
        step=jnp.full((), -1, jnp.int32),
        amax=jnp.zeros((leaves,), jnp.float32),
        min_nonzero=jnp.full((leaves,), jnp.inf, jnp.float32),
        underflow=jnp.zeros((leaves,), jnp.float32),
        overflow=jnp.zeros((leaves,), jnp.float32),
        largest=jnp.asarray(float(jnp.finfo(dtype).max), jnp.float32),
    )


def gradient_stats(grads: Any, dtype: DTypeLike, step: jax.Array) -> GradientStats:
    """`GradientStats` of the gradient pytree `grads` against `dtype` (pure; runs under `jit`)."""
    finfo = jnp.finfo(dtype)
    tiny, largest = float(finfo.smallest_normal), float(finfo.max)
    columns: list[list[jax.Array]] = [[], [], [], []]
    for leaf in jax.tree.leaves(grads):
        x = jnp.abs(jnp.asarray(leaf, jnp.float32)).ravel()
        finite = jnp.isfinite(x)
        nonzero = finite & (x > 0)
        count_nonzero = jnp.maximum(nonzero.sum(), 1).astype(jnp.float32)
        count_finite = jnp.maximum(finite.sum(), 1).astype(jnp.float32)
        columns[0].append(jnp.max(jnp.where(finite, x, 0.0), initial=0.0))
        columns[1].append(jnp.min(jnp.where(nonzero, x, jnp.inf), initial=jnp.inf))
        columns[2].append((nonzero & (x < tiny)).sum(dtype=jnp.float32) / count_nonzero)
        columns[3].append((finite & (x > largest)).sum(dtype=jnp.float32) / count_finite)
    amax, min_nonzero, underflow, overflow = (
        jnp.stack(c).astype(jnp.float32) if c else jnp.zeros((0,), jnp.float32) for c in columns
    )
    return GradientStats(
        step=jnp.asarray(step, jnp.int32),
        amax=amax,
        min_nonzero=min_nonzero,
        underflow=underflow,
        overflow=overflow,
        largest=jnp.asarray(largest, jnp.float32),
    )


@dataclasses.dataclass(frozen=True)
class Statistics(Part):
    """The statistics part of `loss_scaling`: `GradientStats` of the scaled gradients against
    `dtype`, collected every `every` steps under a `cond` (other steps do no extra work)."""

    state_type = GradientStats
    every: int
    dtype: np.dtype

    def init(self, params: Any) -> GradientStats:
        return empty_gradient_stats(len(jax.tree.leaves(params)), self.dtype)

    def record(
        self, state: GradientStats, step: Step, applied: jax.Array, cause: jax.Array
    ) -> GradientStats:
        del applied, cause
        return lax.cond(
            step.steps % self.every == 0,
            lambda: gradient_stats(step.scaled, self.dtype, step.steps),
            lambda: state,
        )
