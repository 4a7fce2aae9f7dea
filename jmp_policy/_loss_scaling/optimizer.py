"""`loss_scaling`, the core: in torch.amp's order, unscale the gradients with the S the loss was
scaled by, check them, apply the inner optimizer or skip (zero updates, its state kept), then
adjust S. The parts composed around it (`parts`: skip records, gradient statistics, spike
skipping, float8 states, the misuse check) each live in a file of their own."""

from __future__ import annotations

import functools
import operator
from collections.abc import Hashable

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.typing import DTypeLike

from jmp_policy._loss_scaling.checks import check_arguments, check_given, check_params
from jmp_policy._loss_scaling.finite import agree, unscaled_leaf_finite
from jmp_policy._loss_scaling.fp8_states import init_without_states, update_writing_states
from jmp_policy._loss_scaling.loss_scale import LossScale
from jmp_policy._loss_scaling.misuse import _warn_if_half_master_weights, check_misuse
from jmp_policy._loss_scaling.parts import Step, vetoes_of
from jmp_policy._loss_scaling.records import skip_cause
from jmp_policy._loss_scaling.spikes import SkipSpikes
from jmp_policy._loss_scaling.state import LossScalingState


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

    `update(scaled_grads, state, params=None, value=None, **extra)` takes the gradients of the
    *scaled* loss (`get_loss_scale(state).scale(loss)`), divides them by that scale in float32
    and checks them for inf/NaN. Finite: runs `inner.update` on the unscaled gradients. Not
    finite: returns zero updates (negative zeros, so `p + u` is `p` bit for bit), leaves the
    inner state exactly as it was, and counts the skip. Then the scale is adjusted (grown or
    backed off); the scale used for unscaling is always the one the loss was scaled with.

    Given the loss (`value=loss`, as optax passes it; `nnx.Optimizer.update(model, grads,
    value=loss)` passes it on), a step whose loss is inf or NaN is skipped too, and the scale
    is left as it was: no scale cures a non-finite loss. The state counts skips by cause
    (`SKIP_CAUSES`); `loss_scaling_report` says each one's fix. The check is exact and reads
    the scaled gradients once (every leaf's largest magnitude, divided by the scale); the
    inner update runs under a `lax.cond`, so a skipped step does no optimizer work.

    Args:
      inner: the optimizer (any optax transform, `optax.chain`, `optax.MultiSteps` and
        `optax.inject_hyperparams` included).
      loss_scale: the initial `NoOpLossScale`, `StaticLossScale` or `DynamicLossScale`.
      axis_name: a mapped axis name (or tuple) of `pmap`/`shard_map`, so every device takes
        the same skip decision. Not needed under SPMD `jit`.
      stats_every: opt-in: every `stats_every` steps, record per gradient leaf the largest and
        smallest magnitudes and the fractions that underflow or overflow `stats_dtype`
        (`GradientStats`; `loss_scaling_report` reads them), under a `cond`. None: off.
      stats_dtype: the floating dtype the scaled gradients are judged against.
      skip_spikes: a `SkipSpikes`: also skip steps whose loss or gradient norm jumps
        `threshold` spreads above its running mean (cause "spike"). None (default): off.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a `LossScalingState`.

    Raises:
      TypeError, ValueError: an argument of a wrong type or out of range (at construction);
        at `init`/`update`, trees or a state that do not fit together.

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
    inner, parts = check_arguments(inner, loss_scale, stats_every, stats_dtype, skip_spikes)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        check_params(params)
        inner_state = inner.init(params)
        _warn_if_half_master_weights(params, inner_state)
        zero = lambda dtype=jnp.int32: jnp.zeros((), dtype)  # noqa: E731 (own buffers: donation)
        return LossScalingState(
            loss_scale=jax.tree.map(lambda x: jnp.array(x, copy=True), loss_scale),
            inner_state=inner_state,
            applied_steps=zero(),
            skipped_steps=zero(),
            nonfinite_run=zero(),
            last_step_skipped=zero(jnp.bool_),
            parts=tuple(part.init(params) for part in parts),
        )

    def update_fn(updates, state, params=None, value=None, **extra_args):
        value = check_given(state, parts, inner, updates, params, value)
        check_misuse(updates, params, state)
        scale = state.loss_scale
        loss_finite = jnp.ones((), jnp.bool_)
        if value is not None:  # a non-finite loss is a skip no scale cures
            loss_finite = agree(jnp.all(jnp.isfinite(value)), axis_name)
            extra_args = {**extra_args, "value": value}  # for an inner transform that takes it
        leaf_finite = unscaled_leaf_finite(updates, scale, axis_name)
        step = Step(
            scaled=updates,
            # Unscaled before the cond, in place of the scaled gradients (XLA reuses their
            # buffers): measured faster to compile and run than unscaling inside the cond.
            grads=scale.unscale(updates),
            leaf_finite=leaf_finite,
            loss_finite=loss_finite,
            finite=leaf_finite.all() & loss_finite,
            value=value,
            steps=state.applied_steps + state.skipped_steps,
            axis_name=axis_name,
        )
        vetoes, part_states = vetoes_of(parts, state.parts, step)
        vetoed = functools.reduce(operator.or_, [v for _, v in vetoes], jnp.zeros((), jnp.bool_))
        applied = step.finite & ~vetoed
        skipped = ~applied

        def apply(grads, inner_state):
            new_updates, new_inner = inner.update(grads, inner_state, params, **extra_args)
            return new_updates, optax.tree.cast_like(new_inner, inner_state)

        new_updates, inner_state = _run_if_applied(applied, apply, step.grads, state.inner_state)
        cause = skip_cause(step, applied, vetoes)
        # A non-finite loss or a veto leaves the scale as it was: backing off would not cure
        # it, and would drive the scale toward its floor, where small gradients underflow.
        moves = loss_finite & ~vetoed
        adjusted = scale.adjust(step.finite)
        count = lambda n, where: jnp.where(where, optax.safe_int32_increment(n), n)  # noqa: E731
        new_state = LossScalingState(
            loss_scale=jax.tree.map(lambda new, old: jnp.where(moves, new, old), adjusted, scale),
            inner_state=inner_state,
            applied_steps=count(state.applied_steps, applied),
            skipped_steps=count(state.skipped_steps, skipped),
            nonfinite_run=jnp.where(applied, 0, optax.safe_int32_increment(state.nonfinite_run)),
            last_step_skipped=skipped,
            parts=tuple(
                p.record(s, step, applied, cause) for p, s in zip(parts, part_states, strict=True)
            ),
        )
        return new_updates, new_state, applied

    # LossScalingState is an optax state (a pytree); optax's aliases do not say so.
    return optax.GradientTransformationExtraArgs(
        init_without_states(init_fn),  # pyright: ignore[reportArgumentType]
        update_writing_states(update_fn),  # pyright: ignore[reportArgumentType]
    )


def _run_if_applied(applied, apply, grads, inner_state):
    """`apply(grads, inner_state)` when `applied`, else (-0.0 updates, inner_state).

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

    return lax.cond(applied, run, skip, grads, inner_state)
