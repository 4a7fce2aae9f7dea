"""`loss_scaling` used in a way that trains badly without failing: what it warns about, at
the user's line (`LossScalingWarning`), and the reading of the traced step it needs."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from jmp_policy._core.compat import StagedTrace, staged_trace
from jmp_policy._core.validation import (
    HALF_MASTER_WEIGHTS,
    UNSCALED_ARRIVED,
    said,
    user_frame,
    warn_at_user_line,
    warn_once_per_mistake,
)
from jmp_policy._loss_scaling.loss_scale import LossScale, NoOpLossScale
from jmp_policy.errors import LossScalingWarning as LossScalingWarning  # importable here too

WITHOUT_SCALE = "computed without the scale"
ARRIVED = "arrived from outside the step"


def gradient_origin(grads: Any, params: Any, scale: Any) -> str | None:
    """Where the gradients given to `update` come from, in the traced step that calls it:
    `WITHOUT_SCALE` where `computed_without` says so; `ARRIVED` where every gradient is an
    input of that step (computed in another jitted function: Flax's examples compute them in
    `apply_model` and apply them in `update_model`), `params` and `scale` being values of the
    same trace; None otherwise (computed with the scale, or nothing to see)."""
    staged = staged_trace(grads, params, scale)
    if staged is None:
        return None
    if computed_without(staged):
        return WITHOUT_SCALE
    grad_vars = staged.vars[0]
    if staged.untraced[0] == 0 and all(v in staged.inputs for v in grad_vars):
        return ARRIVED
    return None


# The loss scaling states whose scale was read (`get_loss_scale`, `value_and_scaled_grad`)
# in this process, by structure and leaf types: gradients that arrive into a step were
# scaled by one of them, or by no one.
_SCALES_READ: set = set()


def _state_key(state: Any) -> tuple:
    leaves, tree = jax.tree.flatten(state)
    return tree, tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves)


def note_scale_read(state: Any) -> None:
    """Records that the loss scale of a loss scaling state like `state` was read."""
    _SCALES_READ.add(_state_key(state))


def scale_read_for(state: Any) -> bool:
    return _state_key(state) in _SCALES_READ


def warn_at_first_run_if_arrived_unscaled(state: Any, first: Any) -> None:
    """For gradients that arrive into the step (`ARRIVED`) while no loss scale of a state
    like `state` was read anywhere in this process (no `value_and_scaled_grad`, no
    `get_loss_scale`): a warning the step says when it first runs (`first`), at the user's
    line where `update` is called. Said when run, not when traced: `jax.jit(tx.update)`
    lowered, `eval_shape` or `make_jaxpr` say nothing, and a correct layout has no callback."""
    if scale_read_for(state):
        return
    where = user_frame()
    loss_scale = type(state.loss_scale).__name__

    def say() -> None:
        warn_once_per_mistake(
            UNSCALED_ARRIVED,
            "loss_scaling: the gradients given to `update` were computed in another "
            f"function, and no loss scale of this optimizer state (its {loss_scale}) was read "
            "anywhere: they are most likely gradients of the plain loss "
            "(jax.value_and_grad in one jitted function, `apply_gradients` in another, as "
            "Flax's examples are laid out), and every update is S times too small (S the loss "
            "scale), with no error. Compute them with "
            "`loss, grads = jmp_policy.value_and_scaled_grad(loss_fn)(state, params, ...)` in "
            "that function (it reads the scale from the state you pass it).",
            LossScalingWarning,
            where,
        )

    jax.lax.cond(first, lambda: jax.debug.callback(say), lambda: None)


def computed_without(staged: StagedTrace) -> bool:
    """Whether the gradients (the first tree of `staged`) were surely computed from the
    parameters (the second) without the scale (the third: the loss scale of the state given
    to `update`) in the traced step that calls `update`: computed in it from the parameters'
    inputs, and none of the inputs the scale comes from among the inputs they come from.
    What it cannot see is no warning: eager values, values of different traces (an
    accumulator inside `optax.MultiSteps`), no `params` (`staged_trace` gives None), and
    gradients passed into the trace (`gradient_origin`'s `ARRIVED`)."""
    eqns, inputs = staged.eqns, staged.inputs

    def progenitors(variables: list) -> set:
        # JAX's own `find_progenitors`, for many values at once: one backward walk.
        active = set(variables) - {None}
        for eqn in reversed(eqns):
            if active.intersection(eqn.outvars):
                active.difference_update(eqn.outvars)
                active.update(v for v in eqn.invars if not isinstance(v, jcore.Literal))
        return {inputs[v] for v in active if v in inputs}

    from_grads = progenitors(staged.vars[0])
    from_scale = progenitors(staged.vars[2])
    return bool(from_grads & progenitors(staged.vars[1])) and not from_grads & from_scale


def _warn_if_gradients_unscaled(loss_scale: LossScale) -> None:
    warn_at_user_line(
        "loss_scaling: the gradients given to `update` were computed, in this traced step, "
        f"without its {type(loss_scale).__name__} (the loss scale in the optimizer state). "
        "Its `update` takes the gradients of the *scaled* loss and divides them "
        "by the scale: gradients of the plain loss (jax.grad / jax.value_and_grad / "
        "nnx.grad / eqx.filter_grad next to loss_scaling) make every update S times too small "
        "(S the loss scale, 2^15 for DynamicLossScale(2.0**15)), with no error. Compute them with "
        "`loss, grads = jmp_policy.value_and_scaled_grad(loss_fn)(opt_state, params, ...)` "
        "(Equinox: `jmp_policy.eqx.filter_value_and_scaled_grad`; NNX: "
        "`grad_fn=nnx.value_and_grad`), or scale the loss yourself with "
        "`jmp_policy.get_loss_scale(opt_state).scale(loss)` inside the differentiated "
        "function (that marks it too).",
        LossScalingWarning,
    )


def _half_leaves(tree: Any) -> list[str]:
    found = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and dtype in (jnp.float16, jnp.bfloat16):
            found.append(f"{jax.tree_util.keystr(path)} ({jnp.dtype(dtype).name})")
    return found


def _warn_if_half_master_weights(params: Any, inner_state: Any, where: str = "init") -> None:
    """Says (once per process) that the parameters, or at `init` the inner optimizer state,
    are float16/bfloat16 master weights: at `init`, or at the first `update` (traced once per
    signature), where parameters cast after `init` (the whole tree cast to the compute dtype,
    or a `TrainState` built from cast parameters) first show."""
    # A state that declares it (low_precision_optimizer's) keeps 16-bit parameters and moments
    # on purpose, their small updates kept. Read from the class, so that this module does not
    # import the low-precision layer below it.
    if said(HALF_MASTER_WEIGHTS):  # said once: no walk of the trees at every later trace
        return
    on_purpose = lambda x: getattr(type(x), "keeps_16_bit_updates", False) is True  # noqa: E731
    if any(on_purpose(x) for x in jax.tree.leaves(inner_state, is_leaf=on_purpose)):
        return
    # The optimizer state follows the parameters (Adam's moments take their dtype): it is named
    # only when the parameters are not the cause. One mistake, one message.
    trees = (("parameters", params), ("inner optimizer state", inner_state))
    for what, tree in trees if where == "init" else trees[:1]:
        half = _half_leaves(tree)
        if half:
            shown = ", ".join(half[:3]) + (f" and {len(half) - 3} more" if len(half) > 3 else "")
            warn_once_per_mistake(
                HALF_MASTER_WEIGHTS,
                f"Expected float32 {what} (master weights) for loss_scaling's `{where}`, got "
                f"half precision: {shown}. Weight updates must not run in float16/bfloat16: "
                "small updates round away and Adam's eps underflows to 0 in float16. Keep "
                "float32 master weights and cast a copy for the forward pass, e.g. "
                "`policy = jmp_policy.get_policy('mixed_float16')`, "
                "`params = policy.cast_to_param(params)` before `init`, and "
                "`policy.cast_to_compute(params)` inside the loss. Or keep them in bfloat16 "
                "without losing the small updates: wrap the optimizer in "
                "`jmp_policy.low_precision_optimizer` (stochastic rounding, Kahan or split).",
                UserWarning,
            )
            return


def check_misuse(grads: Any, params: Any, state: Any) -> None:
    """The misuse part of `loss_scaling`'s `update`, said while the step traces: half-precision
    master weights, and gradients of the plain loss (computed without the scale in this step,
    or arrived from another function while no scale was read)."""
    if params is not None:
        _warn_if_half_master_weights(params, state.inner_state, where="update")
    if isinstance(state.loss_scale, NoOpLossScale):  # nothing to scale with
        return
    origin = gradient_origin(grads, params, state.loss_scale)
    if origin == WITHOUT_SCALE:
        _warn_if_gradients_unscaled(state.loss_scale)
    elif origin == ARRIVED:
        warn_at_first_run_if_arrived_unscaled(
            state, (state.applied_steps == 0) & (state.skipped_steps == 0)
        )
