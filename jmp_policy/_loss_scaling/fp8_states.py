"""The float8 part of `loss_scaling`: delayed-scaling states (`Fp8DotState`) ride in the
parameters and their gradients, and are written, not optimized. Around the core's `init` and
`update`: the states are taken out before the core sees the trees, and a state's gradient (its
next value) is written back as the update unless the step was skipped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jmp_policy._fp8.state import split_states, without_states, written


def init_without_states(init: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`init` of the parameters without their float8 states."""

    def init_fn(params):
        return init(without_states(params))

    return init_fn


def update_writing_states(update: Callable[..., tuple]) -> Callable[..., tuple]:
    """`update` (which returns `(updates, state, applied)`) on the gradients without float8
    states, and `(updates, state)` with each state's next value written where `applied`."""

    def update_fn(updates, state, params=None, **extra_args):
        split = split_states(updates)
        if split is None:
            return update(updates, state, params, **extra_args)[:2]
        new_updates, new_state, applied = update(
            split[0], state, without_states(params), **extra_args
        )
        return written(new_updates, split[1:], params, applied), new_state

    return update_fn
