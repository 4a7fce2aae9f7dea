"""float8 matmuls with delayed scaling (`jmp_policy.fp8.fp8_dot_general_delayed`): scales
from earlier steps' amaxes (`DelayedScaling`), the state a pytree threaded like the loss
scale (`Fp8DotState`, `next_state`, `combine_microbatches`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jmp_policy._core.pytree import register_state
from jmp_policy._core.validation import check_bool, whole_number
from jmp_policy._fp8.scaling import (
    E4M3,
    E5M2,
    _amax,
    _check_format,
    _dequantized_dot,
    _dequantized_grads,
    _dot_arguments,
    compute_scale,
    max_margin,
    quantize,
)

# Delayed scaling ----------------------------------------------------------------------------
#
# TransformerEngine's recipe: each tensor's scale comes from the amaxes of the
# previous steps (a rolling history), so the quantization needs no pass over
# the tensor before the matmul. The state is a pytree threaded like the loss
# scale. The forward operands' new metadata is returned with the result; the
# output gradient's amax exists only in the backward pass, so it leaves
# through the cotangent of one scalar slot of the state (`grad_amax`), and
# `next_state` folds it in after `jax.grad`. If a state is used twice in one
# step, those cotangents add up: the amax is overestimated, which only makes
# the scale smaller (never an overflow).

AMAX_FROM = ("max", "most_recent")


@register_state
@dataclasses.dataclass(frozen=True)
class Fp8Meta:
    """A tensor's delayed-scaling metadata.

    Attributes:
      scale: the quantization multiplier used at the latest step (float32 scalar).
      amax_history: float32 `(history_length,)`: the latest amax at index 0,
        the older ones after it (the layout of Flax's `fp8_ops`).
    """

    scale: jax.Array
    amax_history: jax.Array


@register_state
@dataclasses.dataclass(frozen=True)
class Fp8DotState:
    """Delayed-scaling state of one matmul: its two operands and its output gradient.

    Attributes:
      lhs: the left operand's `Fp8Meta` (e4m3).
      rhs: the right operand's `Fp8Meta` (e4m3).
      grad: the output gradient's `Fp8Meta` (e5m2 in the hybrid format).
      grad_amax: a float32 scalar slot whose cotangent is the output
        gradient's amax (`next_state` reads it); its value is never used.
    """

    lhs: Fp8Meta
    rhs: Fp8Meta
    grad: Fp8Meta
    grad_amax: jax.Array


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """The delayed-scaling recipe (TransformerEngine's `DelayedScaling`), validated when built.

    Attributes:
      history_length: how many steps of amax each tensor remembers (>= 1).
      margin: scales leave `2**margin` of headroom (>= 0).
      amax_from: "max" (the largest amax in the history) or "most_recent".
      fmt: "hybrid" (e5m2 gradients) or "e4m3".
      power_of_two: round scales down to powers of two.
      grad_margin: the output gradients' margin (None: `margin + 2`). The gradients are
        those of the loss times the loss scale, which a `DynamicLossScale` doubles after
        a run of finite steps: on that step each gradient amax is twice the history's.
        One bit of headroom takes the doubling, a second the step-to-step drift of the
        amax (up to 0.8% beyond a doubling in tests/test_fp8.py), so such a step clips no
        value (0: TransformerEngine's and Flax's rule, where it clips at twice the range).
        e5m2 spans 2^32 of magnitudes, so two bits cost little at its small end.

    Examples:
      >>> from jmp_policy.fp8 import DelayedScaling
      >>> recipe = DelayedScaling(history_length=16)
      >>> state = recipe.init()
      >>> state.lhs.amax_history.shape, float(state.lhs.scale)
      ((16,), 1.0)
    """

    history_length: int = 1024
    margin: int = 0
    amax_from: str = "max"
    fmt: str = "hybrid"
    power_of_two: bool = False
    grad_margin: int | None = None

    def __post_init__(self):
        _check_format(self.fmt)
        whole_number(self.history_length, "history_length", low=1)
        # A margin past the format's normal range puts every value at or below its smallest
        # normal (2**100 is inf in float32: every scale 0 and every loss NaN).
        whole_number(self.margin, "margin", low=0, high=max_margin(E4M3))
        # The gradients' margin (`margin + 2` unless given) within their own format's.
        if self.grad_margin is None:
            whole_number(self.margin, "margin", low=0, high=max_margin(self.grad_dtype) - 2)
        else:
            whole_number(self.grad_margin, "grad_margin", low=0, high=max_margin(self.grad_dtype))
        check_bool(self.power_of_two, "power_of_two")
        if not isinstance(self.amax_from, str) or self.amax_from not in AMAX_FROM:
            raise ValueError(
                f"Unknown `amax_from` {self.amax_from!r}: expected 'max' or 'most_recent'."
            )

    @property
    def grad_dtype(self) -> np.dtype:
        return E5M2 if self.fmt == "hybrid" else E4M3

    def init(self) -> Fp8DotState:
        """A fresh state for one matmul: scales 1, empty histories."""

        def meta():
            return Fp8Meta(jnp.ones((), jnp.float32), jnp.zeros(self.history_length, jnp.float32))

        return Fp8DotState(meta(), meta(), meta(), jnp.zeros((), jnp.float32))

    def advance_grad(self, meta: Fp8Meta, amax: jax.Array) -> Fp8Meta:
        """`advance` of an output gradient's metadata, with `grad_margin`."""
        margin = self.margin + 2 if self.grad_margin is None else self.grad_margin
        return self.advance(meta, amax, self.grad_dtype, margin=margin)

    def advance(
        self, meta: Fp8Meta, amax: jax.Array, dtype: DTypeLike, margin: int | None = None
    ) -> Fp8Meta:
        """One step of `meta`: the scale from the history so far, then `amax` recorded.

        Flax's `update_fp8_meta` and TransformerEngine's rule: the new scale
        is `compute_scale` of the history's max (or its latest entry), the
        previous scale kept for an amax of 0 or non-finite; the history is
        rolled by one and `amax` written at index 0. A non-finite `amax` (an inf
        or NaN batch, an overflowed gradient: a step `loss_scaling` skips) is not
        recorded: the history stays as it was (as AQT keeps the previous amax), so
        one bad batch cannot freeze the scale for `history_length` steps.
        """
        history = meta.amax_history
        seen = history.max(axis=-1) if self.amax_from == "max" else history[..., 0]
        margin = self.margin if margin is None else margin
        scale = compute_scale(
            seen, meta.scale, dtype, margin=margin, power_of_two=self.power_of_two
        )
        amax = jnp.asarray(amax, jnp.float32)
        rolled = jnp.roll(history, -1, axis=-1).at[..., 0].set(amax)
        finite = jnp.isfinite(amax)[..., None]
        return Fp8Meta(scale, jnp.where(finite, rolled, history))


def fp8_dot_general_delayed(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    state: Fp8DotState,
    recipe: DelayedScaling = DelayedScaling(),
    *,
    out_dtype: DTypeLike | None = None,
) -> tuple[jax.Array, Fp8DotState]:
    """`fp8_dot_general` with delayed scaling: returns the result and the advanced state.

    The operands are quantized with scales from their amax histories
    (`DelayedScaling.advance`), so a scale lags the tensor by one step; a
    value beyond the range saturates. The returned state holds the operands'
    new metadata; the output gradient's is folded in by `next_state` after
    differentiating with respect to the state:

        (loss, state), (grads, state_grads) = jax.value_and_grad(
            loss_fn, argnums=(0, 1), has_aux=True)(params, state, batch)
        state = next_state(state, state_grads, recipe)

    Args:
      lhs: the left operand, as for `lax.dot_general`.
      rhs: the right operand.
      dimension_numbers: `((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))`.
      state: this matmul's `Fp8DotState` (`recipe.init()`; stacked for a scanned stack).
      recipe: the `DelayedScaling` recipe.
      out_dtype: the result's dtype (default: `lhs`'s, float32 if that is float8).

    Returns:
      `(result, state)`.
    """
    if not isinstance(recipe, DelayedScaling):
        raise TypeError(
            f"Expected a jmp_policy.fp8.DelayedScaling for `recipe`, got {type(recipe).__name__}."
        )
    dimension_numbers, out_dtype = _dot_arguments(lhs, dimension_numbers, out_dtype)
    lhs_meta = recipe.advance(state.lhs, _amax(lhs), E4M3)
    rhs_meta = recipe.advance(state.rhs, _amax(rhs), E4M3)
    static = (recipe, out_dtype, np.dtype(lhs.dtype), np.dtype(rhs.dtype))
    out: jax.Array = _delayed_dot(  # pyright: ignore[reportAssignmentType]
        lhs, rhs, lhs_meta.scale, rhs_meta.scale, state.grad, state.grad_amax,
        dimension_numbers, static,
    )  # fmt: skip
    return out, dataclasses.replace(state, lhs=lhs_meta, rhs=rhs_meta)


def next_state(state: Fp8DotState, state_grads: Fp8DotState, recipe: DelayedScaling) -> Any:
    """Folds the output gradients' amaxes (from `jax.grad` w.r.t. the state) into `state`.

    Works on one `Fp8DotState`, stacked ones (a scanned layer stack), or any
    pytree of them with `state_grads` of the same structure.
    """
    is_state = lambda x: isinstance(x, Fp8DotState)  # noqa: E731

    def fold(s, g):
        grad_meta = recipe.advance_grad(s.grad, g.grad_amax)
        return dataclasses.replace(s, grad=grad_meta, grad_amax=jnp.zeros_like(s.grad_amax))

    return jax.tree.map(fold, state, state_grads, is_leaf=is_state)


def combine_microbatches(*states: Any) -> Any:
    """One step's state from its microbatches': every amax the largest any microbatch saw.

    Under gradient accumulation each microbatch's `fp8_dot_general_delayed` returns a
    state advanced from the same one (the same scales and history, its own amax at
    index 0), and `jax.grad` returns its own output-gradient amax (`grad_amax`). Summing
    those, or averaging them as `optax.MultiSteps` averages gradients, would record a
    wrong amax (an average underestimates it, and the next scale overflows: marin#7659).
    Combine the states, and separately the state gradients, with this (an elementwise
    max; pairwise, so it also serves as a `lax.scan` carry), then call `next_state` once:

        state = next_state(combine_microbatches(*states), combine_microbatches(*grads), recipe)

    Works on `Fp8DotState`s, stacked ones, or any pytree of them of one structure.
    """
    if not states:
        raise ValueError("Expected one or more states for `states`, got none.")
    return functools.reduce(lambda a, b: jax.tree.map(jnp.maximum, a, b), states)


def merge_microbatch(opt_state: Any, new: Any, old: Any) -> Any:
    """Under `optax.MultiSteps`, where each microbatch's call advances the state: one history
    entry per optimizer step, the largest amax of its microbatches, and one scale per step.

    Each call of `fp8_dot_general_delayed` and `next_state` writes an amax and moves the
    scale; when a step's microbatches are separate calls of the train step (`MultiSteps`
    applies the update on the k-th), that records each microbatch as a step of its own: with
    `amax_from="most_recent"` the next scale follows the last microbatch only (marin#7659).
    This keeps `new` (the state this call made) for the first microbatch of a step, and for
    the others `old` (the state the call started from: its scales, its history) with this
    call's amax merged into the latest entry by a max. Call it after `next_state`:

        fp8_state = merge_microbatch(opt_state, next_state(new, state_grads, recipe), fp8_state)

    Args:
      opt_state: the optimizer state given to this call's `update` (before it), holding one
        `optax.MultiStepsState` (an optax state, a Flax `TrainState` or an `nnx.Optimizer`).
      new: the state this call made (`next_state`'s).
      old: the state it started from.

    Raises:
      ValueError: `opt_state` holds no `optax.MultiStepsState` (or several).
    """
    import optax

    from jmp_policy._core.pytree import find_states

    found = find_states(opt_state, optax.MultiStepsState)
    if len(found) != 1:
        raise ValueError(
            "Expected the optimizer state given to this microbatch's update, holding one "
            f"optax.MultiStepsState, for `opt_state` of merge_microbatch; found {len(found)}."
        )
    first = found[0].mini_step == 0

    def merge(n: Any, o: Any) -> Any:
        if not isinstance(n, Fp8Meta):
            return n
        latest = jnp.maximum(o.amax_history[..., 0], n.amax_history[..., 0])
        merged = o.amax_history.at[..., 0].set(latest)
        return Fp8Meta(
            jnp.where(first, n.scale, o.scale),
            jnp.where(first, n.amax_history, merged),
        )

    is_meta = lambda x: isinstance(x, Fp8Meta)  # noqa: E731
    return jax.tree.map(merge, new, old, is_leaf=is_meta)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _delayed_dot(lhs, rhs, lhs_scale, rhs_scale, grad_meta, grad_amax, dimension_numbers, static):
    return _delayed_dot_fwd(
        lhs, rhs, lhs_scale, rhs_scale, grad_meta, grad_amax, dimension_numbers, static
    )[0]


def _delayed_dot_fwd(
    lhs, rhs, lhs_scale, rhs_scale, grad_meta, grad_amax, dimension_numbers, static
):
    _, out_dtype, _, _ = static
    q_lhs, q_rhs = quantize(lhs, E4M3, lhs_scale), quantize(rhs, E4M3, rhs_scale)
    out = _dequantized_dot(q_lhs, lhs_scale, q_rhs, rhs_scale, dimension_numbers, out_dtype)
    return out, (q_lhs, lhs_scale, q_rhs, rhs_scale, grad_meta, grad_amax)


def _delayed_dot_bwd(dimension_numbers, static, residuals, g):
    recipe, _, lhs_dtype, rhs_dtype = static
    q_lhs, s_lhs, q_rhs, s_rhs, grad_meta, grad_amax = residuals
    amax = _amax(g)
    s_g = recipe.advance_grad(grad_meta, amax).scale
    q_g = quantize(g, recipe.grad_dtype, s_g)
    d_lhs, d_rhs = _dequantized_grads(
        (q_g, s_g), (q_lhs, s_lhs), (q_rhs, s_rhs), dimension_numbers, (lhs_dtype, rhs_dtype)
    )
    zeros = jax.tree.map(jnp.zeros_like, (s_lhs, s_rhs, grad_meta))
    return d_lhs, d_rhs, *zeros, amax.astype(grad_amax.dtype)


_delayed_dot.defvjp(_delayed_dot_fwd, _delayed_dot_bwd)
