"""One call for a loss-scaled step: the loss for logging, the gradients for `update`.

`loss_scaling`'s `update` takes gradients of the *scaled* loss. Scaling by hand
leaves room for mix-ups that fail silently: gradients of the unscaled loss, or
gradients unscaled by hand (jmp's style) and then unscaled again by `update`,
train with updates ~S times too small. `value_and_scaled_grad` takes the scale
from the optimizer state itself, so there is nothing to mix up.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jmp_policy._core.pytree import find_states
from jmp_policy._core.validation import argnum_positions, check_argnums
from jmp_policy._loss_scaling.state import LossScalingState, get_loss_scale


def value_and_scaled_grad(
    fun: Callable[..., Any],
    *,
    has_aux: bool = False,
    argnums: int | Sequence[int] = 0,
    grad_fn: Callable[..., Callable[..., Any]] = jax.value_and_grad,
) -> Callable[..., tuple[Any, Any]]:
    """Wraps `fun` for a `loss_scaling` step: `(opt_state, *args) -> (value, grads)`.

    The returned function reads the current loss scale S from `opt_state` (an
    optax state holding a `loss_scaling` state, a Flax `TrainState` or an
    `nnx.Optimizer`), differentiates `S * fun(*args)` (S applied in float32, so
    a float16 loss does not overflow), and returns:

    - `value`: `fun`'s own value, unscaled (`(loss, aux)` with `has_aux`), for
      logging, and for `tx.update(grads, opt_state, params, value=loss)`, which then
      tells a non-finite loss from overflowing gradients (`SKIP_CAUSES`);
    - `grads`: the gradients of the scaled loss with respect to `args[argnums]`,
      exactly what `tx.update(grads, opt_state, params)` expects.

    Args:
      fun: the loss function; it returns a scalar, or `(scalar, aux)` with
        `has_aux`.
      has_aux: as in `jax.value_and_grad`.
      argnums: as in `jax.value_and_grad` (positions in `args`, after
        `opt_state`).
      grad_fn: the value-and-grad transform: `jax.value_and_grad` (default),
        `flax.nnx.value_and_grad` for NNX modules, or one that differentiates
        its first argument only and takes no `argnums`, such as
        `equinox.filter_value_and_grad` (then `argnums` must be 0).

    Returns:
      A function `(opt_state, *args, **kwargs) -> (value, grads)`; it works
      under `jit` (and `eqx.filter_jit`).

    Raises:
      TypeError: `fun` or `grad_fn` is not callable; (when called) the first
        argument holds no `loss_scaling` state (the optimizer state left out).
      ValueError: `argnums` is not 0 with a `grad_fn` that takes no `argnums`.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import jmp_policy as jmp
      >>> tx = jmp.loss_scaling(optax.sgd(0.5), jmp.DynamicLossScale(2.0**10))
      >>> params = {"w": jnp.array([1.0, -2.0])}
      >>> opt_state = tx.init(params)
      >>> loss_fn = lambda p, x: jnp.sum((p["w"] * x) ** 2)
      >>> loss, grads = jmp.value_and_scaled_grad(loss_fn)(opt_state, params, jnp.ones(2))
      >>> float(loss), grads["w"].tolist()  # the loss unscaled; gradients of 2**10 * loss
      (5.0, [2048.0, -4096.0])
      >>> updates, opt_state = tx.update(grads, opt_state, params)
      >>> optax.apply_updates(params, updates)["w"].tolist()
      [0.0, 0.0]
    """
    if not callable(fun):
        raise TypeError(f"Expected a callable loss function for `fun`, got {type(fun).__name__}.")
    if not callable(grad_fn):
        raise TypeError(
            "Expected a value-and-grad transform such as jax.value_and_grad or "
            f"flax.nnx.value_and_grad for `grad_fn`, got {type(grad_fn).__name__}."
        )

    check_argnums(argnums)
    first_only = not _takes_argnums(grad_fn)
    if first_only and argnums != 0:
        raise ValueError(
            f"Expected `argnums=0` with a `grad_fn` that takes no `argnums` ({_name(grad_fn)} "
            f"differentiates its first argument only), got argnums={argnums!r}. Put what to "
            "differentiate first (e.g. an Equinox model), or use jax.value_and_grad."
        )

    def scaled(scale, *args, **kwargs):
        out = fun(*args, **kwargs)
        loss, aux = out if has_aux else (out, None)
        return scale.scale(loss), (loss, aux)

    def scaled_first(first, scale, *rest, **kwargs):
        return scaled(scale, first, *rest, **kwargs)

    def wrapped(opt_state, *args, **kwargs):
        if not find_states(opt_state, LossScalingState):
            raise TypeError(
                "Expected the optimizer state first, then the loss function's own arguments: "
                "`jmp_policy.value_and_scaled_grad(loss_fn)(opt_state, params, ...)` (a "
                "TrainState or nnx.Optimizer does too), got a "
                f"{type(opt_state).__name__} with no loss_scaling state in it as the first "
                "argument. Was `opt_state` left out? It carries the loss scale the loss is "
                "multiplied by. (Or the optimizer was built without loss_scaling: "
                "`tx = jmp_policy.loss_scaling(optax.adam(1e-3), "
                "jmp_policy.DynamicLossScale(2.0**15))`.)"
            )
        scale = get_loss_scale(opt_state)
        if first_only:
            differentiate = grad_fn(scaled_first, has_aux=True)
            (_, (loss, aux)), grads = differentiate(args[0], scale, *args[1:], **kwargs)
        else:
            # Positions after `opt_state`; negative ones count from the end of `args`, as JAX's.
            positions = [i + 1 for i in argnum_positions(argnums, len(args))]
            shifted = tuple(positions) if isinstance(argnums, (tuple, list)) else positions[0]
            differentiate = grad_fn(scaled, argnums=shifted, has_aux=True)
            (_, (loss, aux)), grads = differentiate(scale, *args, **kwargs)
        return ((loss, aux) if has_aux else loss), grads

    return wrapped


def _takes_argnums(grad_fn: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(grad_fn).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): assume jax's
        return True
    # Only a named `argnums`: Equinox's transforms take `**gradkwargs` and
    # then refuse `argnums`. The first-argument call works with any transform.
    return "argnums" in parameters


def _name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}".lstrip(".")
