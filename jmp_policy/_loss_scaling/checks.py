"""What `loss_scaling` is given, checked: its arguments when it is built (the parts they
compose in), the parameters at `init`, and at `update` the state, the gradients, the
parameters and the loss against each other. Every check runs in Python while the step traces
(structures, dtypes, types), so a compiled step pays nothing for it."""

from __future__ import annotations

import math
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_policy._core.compat import variable_value
from jmp_policy._core.pytree import find_states
from jmp_policy._core.validation import FLOAT32_MAX, whole_number
from jmp_policy._fp8.state import without_states
from jmp_policy._loss_scaling.gradient_stats import Statistics
from jmp_policy._loss_scaling.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from jmp_policy._loss_scaling.parts import Part
from jmp_policy._loss_scaling.records import Records
from jmp_policy._loss_scaling.spikes import SkipSpikes, Spikes
from jmp_policy._loss_scaling.state import LossScalingState
from jmp_policy.policy import normalise_dtype

_LOSS_SCALES = (NoOpLossScale, StaticLossScale, DynamicLossScale)


def check_arguments(
    inner: Any, loss_scale: Any, stats_every: Any, stats_dtype: Any, skip_spikes: Any
) -> tuple[optax.GradientTransformation, tuple[Part, ...]]:
    """`loss_scaling`'s arguments checked: `inner` as a transform (`optax.MultiSteps`' own),
    and the parts they compose in: the skip records, then statistics and spikes if asked."""
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
    if skip_spikes is not None and not isinstance(skip_spikes, SkipSpikes):
        raise TypeError(
            "Expected a jmp_policy.scaling.SkipSpikes (e.g. SkipSpikes(threshold=10.0)) or None "
            f"for `skip_spikes`, got {type(skip_spikes).__name__}."
        )
    judged_in = normalise_dtype(stats_dtype, "stats_dtype")
    parts: list[Part] = [Records()]
    if stats_every is not None:
        parts.append(Statistics(whole_number(stats_every, "stats_every", low=1), judged_in))
    if skip_spikes is not None:
        parts.append(Spikes(skip_spikes))
    return inner, tuple(parts)


def check_params(tree: Any, what: str = "params") -> None:
    """Refuses complex leaves: the finite check and the statistics judge real magnitudes."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and jnp.issubdtype(dtype, jnp.complexfloating):
            raise TypeError(
                f"Expected real floating leaves in `{what}` of loss_scaling, got "
                f"{jnp.dtype(dtype).name} at {jax.tree_util.keystr(path) or 'the root'}. "
                "Complex values are not unscaled or checked: keep their real and imaginary "
                "parts as two real leaves (e.g. `{'re': z.real, 'im': z.imag}`)."
            )


def check_given(
    state: Any,
    parts: tuple[Part, ...],
    inner: optax.GradientTransformation,
    grads: Any,
    params: Any,
    value: Any,
) -> jax.Array | None:
    """`update`'s arguments checked against the state and each other; returns `value` as an
    array (a Python number in float32; None where not given)."""
    _check_state(state)
    have = tuple(type(s).__name__ for s in state.parts)
    expected = tuple(p.state_type.__name__ for p in parts)
    if have != expected:
        raise TypeError(
            f"Expected a LossScalingState with the parts {expected} of this loss_scaling "
            f"(its skip_spikes= and stats_every=), got one with {have}: made by `init` of "
            "another configuration (an older checkpoint?). Build the transform as that state "
            "was built, or start a new state with `tx.init(params)`."
        )
    check_params(grads, "updates")
    given = _structure(grads)
    grads_are = "the gradients (`updates`)"
    init_params = state.nonfinite_leaves.treedef  # the skip records' own structure
    _same_structure(given, _structure(init_params), grads_are, "`init`'s params")
    if params is not None:
        _same_structure(given, _structure(params), grads_are, "`params`")
    _same_structure(
        _structure(state.inner_state),
        _structure(jax.eval_shape(inner.init, grads)),
        "the inner state",
        "`inner.init(params)`",
    )
    if value is None:
        return None
    if isinstance(value, bool) or not (
        isinstance(value, (int, float, np.generic, np.ndarray, jax.Array))
        and jnp.issubdtype(jnp.result_type(value), jnp.number)
        and not jnp.issubdtype(jnp.result_type(value), jnp.complexfloating)
    ):
        raise TypeError(
            "Expected the loss (a real scalar, e.g. from jax.value_and_grad) for `value` of "
            f"loss_scaling's update, got {value!r}."
        )
    if isinstance(value, (int, float)):
        # A Python number is read as float32 (as JAX reads it); one past float32's range is
        # inf, a non-finite loss (an int past int32 included), without NumPy's cast warning.
        number = float(value) if abs(value) <= FLOAT32_MAX else math.copysign(math.inf, value)
        return jnp.asarray(number, jnp.float32)
    return jnp.asarray(value)


def _structure(tree: Any) -> Any:
    """The structure of `tree` (or of a structure's placeholder tree) as `update` compares it:
    an NNX `Variable` as its value (`nnx.Optimizer` builds the state from Variables and
    updates with arrays), float8 states as the None `update` puts in their place."""
    if isinstance(tree, jax.tree_util.PyTreeDef):
        tree = jax.tree.unflatten(tree, [0] * tree.num_leaves)
    nnx = sys.modules.get("flax.nnx")  # no NNX loaded: no Variable to look for
    if nnx is not None:
        is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
        tree = jax.tree.map(
            lambda x: variable_value(x) if is_variable(x) else x, tree, is_leaf=is_variable
        )
    return jax.tree.structure(without_states(tree))


def _same_structure(got: Any, expected: Any, what: str, against: str) -> None:
    if got != expected:
        raise ValueError(
            f"Expected {what} of loss_scaling's update to have the structure of {against}, "
            f"got {got}, expected {expected}. Pass the gradients of the parameters this "
            "optimizer state was made for, and the state `tx.init(params)` made for this `tx`."
        )


def _check_state(state: Any) -> None:
    if isinstance(state, LossScalingState):
        return
    fix = (
        "Pass the state that `tx.init(params)` returned for `tx = jmp_policy.loss_scaling("
        "inner, scale)`: `updates, opt_state = tx.update(grads, opt_state, params)`."
    )
    if isinstance(state, _LOSS_SCALES):
        got = (
            f"a {type(state).__name__} (the loss scale alone; it lives inside the optimizer "
            "state, where `jmp_policy.get_loss_scale(opt_state)` reads it)"
        )
    elif find_states(state, LossScalingState):
        got = f"a {type(state).__name__} that holds a loss_scaling state inside it"
        fix = (
            "Pass the whole state to the transform it belongs to: the chain or wrapper "
            "around loss_scaling takes the whole state; loss_scaling's own `update` takes "
            "only its own part."
        )
    else:
        got = (
            f"a {type(state).__name__} with no loss_scaling state in it (the inner optimizer's "
            "state, e.g. from `inner.init(params)`?)"
        )
    raise TypeError(
        f"Expected a LossScalingState for `state` of loss_scaling's update, got {got}. {fix}"
    )
