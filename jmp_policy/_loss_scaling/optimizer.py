"""`loss_scaling`: the loss-scaled, skip-on-overflow step as one optax transform.

The order of a step is torch.amp's: the caller scales the loss by S and
differentiates; `update` unscales the gradients with that same S, checks them,
runs the inner optimizer only when they are finite (else returns zero updates
and leaves the inner state exactly as it was), and only then adjusts S.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.typing import DTypeLike

from jmp_policy._core.pytree import find_states as find_states  # exported here
from jmp_policy._core.validation import whole_number
from jmp_policy._fp8.state import split_states, without_states, written
from jmp_policy._loss_scaling.finite import agree, unscaled_leaf_finite
from jmp_policy._loss_scaling.gradient_stats import empty_gradient_stats, gradient_stats
from jmp_policy._loss_scaling.leaf_flags import LeafFlags as LeafFlags  # exported here
from jmp_policy._loss_scaling.leaf_flags import host_value as host_value
from jmp_policy._loss_scaling.loss_scale import (
    LossScale,
    NoOpLossScale,
)
from jmp_policy._loss_scaling.misuse import (
    ARRIVED,
    WITHOUT_SCALE,
    _warn_if_gradients_unscaled,
    _warn_if_half_master_weights,
    gradient_origin,
    warn_at_first_run_if_arrived_unscaled,
)
from jmp_policy._loss_scaling.misuse import (
    LossScalingWarning as LossScalingWarning,  # exported here
)
from jmp_policy._loss_scaling.spikes import SKIP_CAUSES as SKIP_CAUSES  # exported here
from jmp_policy._loss_scaling.spikes import SkipSpikes as SkipSpikes
from jmp_policy._loss_scaling.spikes import SpikeStats, _judge_spike
from jmp_policy._loss_scaling.state import _LOSS_SCALES, _check_state
from jmp_policy._loss_scaling.state import LossScalingState as LossScalingState  # exported here
from jmp_policy._loss_scaling.state import find_loss_scaling_state as find_loss_scaling_state
from jmp_policy._loss_scaling.state import get_loss_scale as get_loss_scale
from jmp_policy._loss_scaling.state import unless_skipped as unless_skipped


def _copy_leaves(tree: Any) -> Any:
    # A fresh buffer for every array leaf, so donating this state never deletes
    # arrays the caller still holds (e.g. one loss scale passed to two inits).
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def loss_scaling(
    inner: optax.GradientTransformation,
    loss_scale: LossScale,
    *,
    axis_name: Hashable | None = None,
    stats_every: int | None = None,
    stats_dtype: DTypeLike = "float16",
    skip_spikes: SkipSpikes | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Wraps `inner` so it consumes gradients of a loss scaled by `loss_scale`.

    `update(scaled_grads, state, params=None, **extra)` takes the gradients of
    the *scaled* loss (`get_loss_scale(state).scale(loss)`), divides them by
    that scale in float32, and checks them for inf/NaN:

    - finite: runs `inner.update` on the unscaled gradients and returns its
      updates;
    - not finite: returns zero updates (negative zeros, so `p + u` is `p` bit
      for bit) and leaves the inner state exactly as it was (Adam's count and
      moments, schedules), and counts the skip.

    Then the loss scale is adjusted (grown or backed off). The scale used for
    unscaling is always the one the loss was scaled with.

    Given the loss too, `update(scaled_grads, state, params, value=loss)` (the way
    optax passes it to transforms that need it; `nnx.Optimizer.update(model, grads,
    value=loss)` passes it on), a step whose loss is inf or NaN is skipped as well,
    and the scale is left as it was: no scale cures a non-finite loss (an inf in
    the batch, a NaN target, a forward overflow), and backing off would drive it
    toward its floor. The state counts skips by cause (`SKIP_CAUSES`) and
    `loss_scaling_report` says each one's fix. The loss goes on to `inner` as
    `value` (`optax.contrib.reduce_on_plateau` takes it).

    The check is exact and reads the scaled gradients once: every leaf's
    largest magnitude (one reduction per distinct leaf shape), divided by the
    scale. Dividing by S > 0 keeps the order of the values, so a leaf's
    unscaled values are finite exactly when its unscaled maximum is. The
    inner update runs under a `lax.cond`, so a skipped step does no optimizer
    work.

    Args:
      inner: the optimizer (any optax transform, including `optax.chain`,
        `optax.MultiSteps` and `optax.inject_hyperparams`).
      loss_scale: the initial `NoOpLossScale`, `StaticLossScale` or
        `DynamicLossScale`.
      axis_name: a mapped axis name (or tuple) of `pmap`/`shard_map`, so every
        device takes the same skip decision. Not needed under SPMD `jit`.
      stats_every: opt-in precision statistics: every `stats_every` steps, record
        per gradient leaf the largest and smallest magnitudes and the fractions
        that underflow or overflow `stats_dtype` (`GradientStats`, in the state;
        `loss_scaling_report` reads them). Collected inside the step, under a
        `cond`, so there is no host sync and other steps do no extra work. None
        (the default): nothing is collected and the step is unchanged.
      stats_dtype: the dtype the scaled gradients are judged against.
      skip_spikes: a `SkipSpikes`: also skip steps whose loss or global gradient norm
        jumps more than `threshold` spreads of the run's own step-to-step noise above its
        running mean (cause "spike"; any sign and scale of loss). None (the default): off, and
        the step does no extra work.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a
      `LossScalingState`.

    Raises:
      TypeError: `inner` is not an optax transform or `loss_scale` is not a
        loss scale.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import jmp_policy as jmp
      >>> tx = jmp.loss_scaling(optax.sgd(0.1), jmp.DynamicLossScale(2.0**10))
      >>> params = {"w": jnp.ones(2)}
      >>> state = tx.init(params)
      >>> scaled_grads = {"w": jnp.array([2.0**10, jnp.inf])}  # overflowed
      >>> updates, state = tx.update(scaled_grads, state, params)
      >>> optax.apply_updates(params, updates)["w"]
      Array([1., 1.], dtype=float32)
      >>> float(jmp.get_loss_scale(state).loss_scale), int(state.skipped_steps)
      (512.0, 1)
    """
    if not isinstance(inner, optax.GradientTransformation) and callable(
        getattr(inner, "gradient_transformation", None)
    ):
        inner = inner.gradient_transformation()  # optax.MultiSteps
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(
            "Expected an optax.GradientTransformation (e.g. optax.adam(1e-3)) for `inner`, "
            f"got {type(inner).__name__}."
        )
    if not isinstance(loss_scale, _LOSS_SCALES):
        raise TypeError(
            "Expected NoOpLossScale, StaticLossScale or DynamicLossScale for `loss_scale`, "
            f"got {type(loss_scale).__name__}."
        )
    if stats_every is not None:
        stats_every = whole_number(stats_every, "stats_every", low=1)
    if skip_spikes is not None and not isinstance(skip_spikes, SkipSpikes):
        raise TypeError(
            "Expected a jmp_policy.scaling.SkipSpikes (e.g. SkipSpikes(threshold=10.0)) or None "
            f"for `skip_spikes`, got {type(skip_spikes).__name__}."
        )
    try:
        judged_in = jnp.dtype(stats_dtype)
    except TypeError:
        judged_in = None
    if judged_in is None or not jnp.issubdtype(judged_in, jnp.floating):
        raise TypeError(
            f"Expected a floating dtype such as 'float16' for `stats_dtype`, got {stats_dtype!r}."
        )
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        params = without_states(params)  # float8 state is written, not optimized
        inner_state = inner.init(params)
        _warn_if_half_master_weights(params, inner_state)
        # Every leaf its own buffer: a donated state may not hold one twice.
        return LossScalingState(
            loss_scale=_copy_leaves(loss_scale),
            inner_state=inner_state,
            applied_steps=jnp.zeros((), jnp.int32),
            skipped_steps=jnp.zeros((), jnp.int32),
            nonfinite_run=jnp.zeros((), jnp.int32),
            last_step_skipped=jnp.zeros((), jnp.bool_),
            nonfinite_leaves=LeafFlags(
                jnp.zeros(len(jax.tree.leaves(params)), jnp.bool_), jax.tree.structure(params)
            ),
            skip_causes=jnp.zeros(len(SKIP_CAUSES), jnp.int32),
            last_skip_cause=jnp.zeros((), jnp.int32),
            gradient_stats=(
                None
                if stats_every is None
                else empty_gradient_stats(len(jax.tree.leaves(params)), judged_in)
            ),
            spike_stats=(None if skip_spikes is None else SpikeStats.empty()),
        )

    def update_fn(updates, state, params=None, value=None, **extra_args):
        # Float8 delayed-scaling state (`_fp8_state`): its gradient is its next value,
        # written unless the step is skipped, never given to `inner`.
        split = split_states(updates)
        if split is None:
            return _update(updates, state, params, value, **extra_args)[:2]
        new_updates, new_state, applied = _update(
            split[0], state, without_states(params), value, **extra_args
        )
        return written(new_updates, split[1:], params, applied), new_state

    def _update(updates, state, params=None, value=None, **extra_args):
        _check_state(state)
        if params is not None:  # static dtypes: said while the first step traces
            _warn_if_half_master_weights(params, state.inner_state, where="update")
        loss_scale = state.loss_scale
        origin = (
            None
            if isinstance(loss_scale, NoOpLossScale)
            else gradient_origin(updates, params, loss_scale)
        )
        if origin == WITHOUT_SCALE:
            _warn_if_gradients_unscaled(loss_scale)
        elif origin == ARRIVED:
            first = (state.applied_steps == 0) & (state.skipped_steps == 0)
            warn_at_first_run_if_arrived_unscaled(state, first)
        old_flags = state.nonfinite_leaves
        leaf_finite = unscaled_leaf_finite(updates, loss_scale, axis_name)
        # The loss, where given (`value=loss`, as optax passes it to transforms that need it):
        # a non-finite one is a skip no scale cures. Agreed across devices as the gradients are.
        loss_finite = (
            jnp.ones((), jnp.bool_)
            if value is None
            else agree(jnp.all(jnp.isfinite(jnp.asarray(value))), axis_name)
        )
        finite = leaf_finite.all() & loss_finite
        if value is not None:
            extra_args = {**extra_args, "value": value}  # for an inner transform that takes it
        # Unscaled before the cond, in place of the scaled gradients (XLA reuses
        # their buffers): measured faster to compile and run than unscaling in
        # the cond's first pass, with the same temp memory.
        grads = loss_scale.unscale(updates)
        spikes = state.spike_stats
        spike = jnp.zeros((), jnp.bool_)
        if skip_spikes is not None and spikes is not None:
            spike, spikes = _judge_spike(skip_spikes, spikes, finite, grads, value, axis_name)
        applied = finite & ~spike

        def apply(grads, inner_state):
            new_updates, new_inner = inner.update(grads, inner_state, params, **extra_args)
            return new_updates, optax.tree.cast_like(new_inner, inner_state)

        new_updates, inner_state = _run_if_finite(applied, apply, grads, state.inner_state)
        skipped = ~applied
        stats = state.gradient_stats
        if stats_every is not None and stats is not None:
            step = state.applied_steps + state.skipped_steps
            stats = lax.cond(
                step % stats_every == 0,
                lambda: gradient_stats(updates, judged_in, step),
                lambda: stats,
            )
        # 1: a non-finite loss, 2: non-finite gradients of a finite loss, 3: a spike.
        cause = jnp.where(applied, 0, jnp.where(~loss_finite, 1, jnp.where(finite, 3, 2))).astype(
            jnp.int32
        )
        counted = jnp.arange(1, len(SKIP_CAUSES) + 1) == cause
        # A non-finite loss or a spike leaves the scale as it was: backing off would not cure
        # it, and would drive the scale toward its floor, where small gradients underflow.
        adjusted = loss_scale.adjust(finite)
        moves = loss_finite & ~spike
        new_state = LossScalingState(
            loss_scale=jax.tree.map(
                lambda new, old: jnp.where(moves, new, old), adjusted, loss_scale
            ),
            inner_state=inner_state,
            applied_steps=jnp.where(
                applied, optax.safe_int32_increment(state.applied_steps), state.applied_steps
            ),
            skipped_steps=jnp.where(
                skipped, optax.safe_int32_increment(state.skipped_steps), state.skipped_steps
            ),
            nonfinite_run=jnp.where(skipped, optax.safe_int32_increment(state.nonfinite_run), 0),
            last_step_skipped=skipped,
            nonfinite_leaves=dataclasses.replace(
                old_flags, flags=jnp.where(finite, old_flags.flags, ~leaf_finite)
            ),
            skip_causes=jnp.where(
                counted, optax.safe_int32_increment(state.skip_causes), state.skip_causes
            ),
            last_skip_cause=jnp.where(applied, state.last_skip_cause, cause),
            gradient_stats=stats,
            spike_stats=spikes,
        )
        return new_updates, new_state, applied

    # LossScalingState is an optax state (a pytree); optax's aliases do not say so.
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


def _run_if_finite(finite, apply, grads, inner_state):
    """`apply(grads, inner_state)` when `finite`, else (-0.0 updates, inner_state).

    Only one of the two runs: a skipped step does no optimizer work.
    """
    traced = []

    def run(grads, inner_state):
        updates, new_inner = apply(grads, inner_state)
        traced.append(jax.tree.map(lambda u: jax.ShapeDtypeStruct(u.shape, u.dtype), updates))
        return updates, new_inner

    def skip(grads, inner_state):
        # `lax.cond` traces `run` first, which recorded the updates' types; only
        # if it did not is the inner optimizer traced a second time for them.
        types = traced[-1] if traced else jax.eval_shape(apply, grads, inner_state)[0]
        # -0.0: p + (-0.0) == p bit for bit, for every p including +0.0.
        zeros = jax.tree.map(lambda s: jnp.full(s.shape, -0.0, s.dtype), types)
        return zeros, inner_state

    return lax.cond(finite, run, skip, grads, inner_state)
