"""What `loss_scaling` composes around its core: a `Part` has its own state (kept in
`LossScalingState.parts`) and may veto a finite step (spike skipping) or record what a step
did (the skip records, gradient statistics). The core hands each part one `Step`."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class Step(NamedTuple):
    """One step as the parts see it.

    Attributes:
      scaled: the gradients `update` was given (of the scaled loss).
      grads: the same, unscaled (float32 or wider).
      leaf_finite: a bool per gradient leaf, in `jax.tree.leaves` order: finite after unscaling.
      loss_finite: whether the loss given as `value` was finite (True when none was given).
      finite: both: the gradients and the loss were finite (the core's own verdict).
      value: the loss given as `value`, or None.
      steps: the steps before this one, applied and skipped (int32).
      axis_name: the mapped axis name(s) the decision is agreed over, or None.
    """

    scaled: Any
    grads: Any
    leaf_finite: jax.Array
    loss_finite: jax.Array
    finite: jax.Array
    value: jax.Array | None
    steps: jax.Array
    axis_name: Hashable | None


class Part:
    """A part of `loss_scaling`: `init` its state; `veto` a finite step (True skips it, with
    `skip_cause`; only a part with a `skip_cause` is asked); `record` a step once decided
    (`applied`, and the cause of a skip)."""

    state_type: type  # what `init` returns
    skip_cause: int | None = None  # the `SkipCause` of this part's vetoes; None: it never vetoes

    def init(self, params: Any) -> Any:
        raise NotImplementedError

    def veto(self, state: Any, step: Step) -> tuple[jax.Array, Any]:
        del step
        return jnp.zeros((), jnp.bool_), state

    def record(self, state: Any, step: Step, applied: jax.Array, cause: jax.Array) -> Any:
        del step, applied, cause
        return state


def vetoes_of(parts, states, step):
    """`[(part, veto)]` of the parts that may veto a step (a `skip_cause`), and every part's
    state after it."""
    vetoes, after = [], []
    for part, state in zip(parts, states, strict=True):
        if part.skip_cause is not None:
            veto, state = part.veto(state, step)
            vetoes.append((part, veto))
        after.append(state)
    return vetoes, after
