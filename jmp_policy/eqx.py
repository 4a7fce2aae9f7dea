"""A policy on an Equinox model, and the loss-scaled gradient Equinox users call.

Equinox models are pytrees that hold arrays and non-arrays (activation
functions, flags, sizes); they have no compute-dtype attribute to set, so the
policy is applied as a transform of the call: `mixed_precision(model, policy)`
returns an `eqx.Module` that stores the parameters in `param_dtype` and runs
the model under `jmp_policy.autocast` (matmuls and convs in the compute dtype;
exp, log, softmax, normalisation statistics and large sums in float32;
outputs, `eqx.nn.State` batch statistics included, in `output_dtype`).
`filter_value_and_scaled_grad` is `value_and_scaled_grad` with
`eqx.filter_value_and_grad`. Every state of this library passes through
`eqx.filter_jit`, `eqx.partition`/`eqx.combine` and `eqx.filter_grad`.

Equinox is an extra (`pip install "jmp_policy[equinox]"`); this module is
imported on first use of `jmp_policy.eqx`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx

from jmp_policy._core import naming as _naming
from jmp_policy._core.overrides import Overrides
from jmp_policy._fp8.state import checked_scaling, stateful
from jmp_policy._loss_scaling.scaled_grad import value_and_scaled_grad
from jmp_policy.autocast import autocast, full_precision
from jmp_policy.policy import Policy, check_model_policy


def _call(model: Any, *args: Any, **kwargs: Any) -> Any:
    return model(*args, **kwargs)


@functools.cache
def _call_under(policy: Policy, fp8_scaling: Any = "tensorwise") -> Callable[..., Any]:
    # One autocast function per policy: its program cache is shared by every
    # model run under that policy.
    return autocast(_call, policy, fp8_scaling=fp8_scaling)


_IN_FLOAT32 = full_precision(_call)


class MixedPrecision(eqx.Module):
    """An Equinox model run under a policy; call it like the model.

    Attributes:
      model: the wrapped model, its floating arrays in the policy's `param_dtype`.
      policy: the policy (static).
      fp8_scaling: under a float8 policy, "tensorwise", "rowwise" or a
        `jmp_policy.fp8.DelayedScaling` recipe; under `"mixed_nvfp4"`, also a
        `jmp_policy.nvfp4.Recipe` (NVIDIA's training recipe) (static).
      fp8_state: with a `DelayedScaling` recipe, the float8 matmuls' scales and amax
        histories; with an `nvfp4.Recipe`, each linear layer's key (`init_fp8_state`):
        floating arrays that `eqx.filter_grad` differentiates, their gradient read by a
        `loss_scaling` optimizer, which writes the next state unless it skips the step
        (docs/fp8.md). None otherwise.
    """

    model: Any
    policy: Policy = eqx.field(static=True)
    fp8_scaling: Any = eqx.field(static=True, default="tensorwise")
    fp8_state: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        run = _call_under(self.policy, self.fp8_scaling)
        if stateful(self.fp8_scaling) is None:
            return run(self.model, *args, **kwargs)
        if self.fp8_state is None:
            raise ValueError(
                f"This model's matmuls keep state ({type(self.fp8_scaling).__name__} recipe) "
                "and it has none yet: `model = model.init_fp8_state(*example_args)` (the "
                "arguments of one call)."
            )
        return run(self.model, *args, fp8_state=self.fp8_state, **kwargs)

    def init_fp8_state(self, *args: Any, **kwargs: Any) -> MixedPrecision:
        """The model with a fresh state for its float8 (delayed scaling) or NVFP4 (recipe)
        matmuls, made from the arguments of one call (one example, for a model run under
        `jax.vmap`)."""
        run = _call_under(self.policy, self.fp8_scaling)
        if stateful(self.fp8_scaling) is None:
            raise ValueError(
                "init_fp8_state is for a float8 policy with a DelayedScaling recipe "
                "(`mixed_precision(model, 'mixed_float8', fp8_scaling=DelayedScaling())`) or "
                "'mixed_nvfp4' with `fp8_scaling=jmp_policy.nvfp4.Recipe()`."
            )
        state = run.init_fp8_state(self.model, *args, **kwargs)  # pyright: ignore
        return eqx.tree_at(lambda m: m.fp8_state, self, state, is_leaf=lambda x: x is None)

    def __getattr__(self, name: str) -> Any:
        # Only for names the wrapper does not have: `wrapped.layers` reads `model.layers`.
        if name.startswith("__") or name in ("model", "policy", "fp8_scaling", "fp8_state"):
            raise AttributeError(name)  # not set yet (while Equinox builds the module)
        return getattr(self.model, name)


class _Overridden(MixedPrecision):
    """A part of the model an override gives another policy: a float32 one runs as a
    `full_precision` region (a float32 island), another under its own `autocast`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.policy.compute_dtype.itemsize >= 4:
            return _IN_FLOAT32(self.model, *args, **kwargs)
        return _call_under(self.policy)(self.model, *args, **kwargs)


def _with_overrides(model: Any, overrides: Overrides) -> Any:
    """`model` with each module an override matches wrapped in `_Overridden` (the innermost
    match decides: a module inside a matched one runs in its region)."""
    overrides.own_policy((), model)
    matched = []
    for keys, module in _naming.module_tree(model):
        policy = overrides.own_policy(tuple(_naming.key_name(k) for k in keys), module)
        if policy is not None and not isinstance(module, MixedPrecision):
            matched.append((keys, policy))
    overrides.warn_unmatched()
    for keys, policy in sorted(matched, key=lambda m: -len(m[0])):  # inner ones first
        model = eqx.tree_at(
            lambda m, keys=keys: _at(m, keys),
            model,
            replace_fn=lambda module, policy=policy: _Overridden(module, policy),
        )
    return model


def _at(tree: Any, keys: tuple) -> Any:
    """The node of `tree` at a key path (attribute, index or dict key)."""
    for key in keys:
        if hasattr(key, "name"):
            tree = getattr(tree, key.name)
        elif hasattr(key, "idx"):
            tree = tree[key.idx]
        else:
            tree = tree[key.key]
    return tree


def mixed_precision(
    model: Any,
    policy: Policy | str = "mixed_float16",
    overrides: Mapping[Any, Any] | None = None,
    *,
    fp8_scaling: Any = "tensorwise",
) -> MixedPrecision:
    """Applies `policy` to an Equinox model (any pytree that is callable).

    Args:
      model: an `eqx.Module` (or any callable pytree).
      policy: a `Policy` or a policy string, e.g. "mixed_float16".
      overrides: `{module class | glob path pattern | compiled regex: Policy}` for parts of
        the model that run under another policy, as the Flax integrations take them: a path
        is the module's field path (`"cell"`, `"layers/0"`; the precision debugger's layer
        names and `advice()["overrides"]`). A part overridden with a float32 policy runs as
        a `full_precision` region. Default: none (normalisation statistics, softmax and
        the other float32-list operations run in float32 without one).
      fp8_scaling: under a float8 policy, "tensorwise" (default), "rowwise", or a
        `jmp_policy.fp8.DelayedScaling` recipe ("delayed": the default one); then make
        the state with `model = model.init_fp8_state(*example_args)` (docs/fp8.md).

    Returns:
      A new `MixedPrecision` module (Equinox models are immutable: write
      `model = jmp.eqx.mixed_precision(model, ...)`); it reads the model's
      attributes through (`wrapped.layers` is `model.layers`), and applied to
      a `MixedPrecision` again, the new policy replaces the old. Differentiate
      it with `eqx.filter_grad` (or `filter_value_and_scaled_grad`) and update
      it with `eqx.apply_updates` as you would the model; its gradients arrive
      in `param_dtype`.

    Raises:
      TypeError: `model` is not callable, `policy` (or an override's value) is not a
        policy, or an override's key is neither a module class nor a pattern.

    Examples:
      >>> import jax, jax.numpy as jnp, equinox as eqx
      >>> import jmp_policy as jmp
      >>> mlp = eqx.nn.MLP(4, 2, 16, 2, key=jax.random.key(0))
      >>> model = jmp.eqx.mixed_precision(mlp, "mixed_float16")
      >>> model(jnp.ones(4)).dtype, model.model.layers[0].weight.dtype
      (dtype('float32'), dtype('float32'))
      >>> jmp.precision_report(model, jnp.ones(4)).counts["dot_general"]
      {'float16': 3}
    """
    if not callable(model):
        raise TypeError(
            f"Expected a callable Equinox module for `model`, got {type(model).__name__}."
        )
    policy = check_model_policy(policy, "jmp_policy.eqx.mixed_precision")
    rules = Overrides({} if overrides is None else overrides, eqx.Module)
    if isinstance(model, MixedPrecision):  # applied again: the new policy replaces the old
        model = model.model
    if rules.patterns or rules.classes:
        model = _with_overrides(model, rules)
    scaling = checked_scaling(fp8_scaling, policy)
    return MixedPrecision(policy.cast_to_param(model), policy, scaling)


def filter_value_and_scaled_grad(
    fun: Callable[..., Any], *, has_aux: bool = False
) -> Callable[..., tuple[Any, Any]]:
    """`value_and_scaled_grad` for Equinox: `(opt_state, model, *args) -> (value, grads)`.

    Differentiates the scaled loss with respect to the floating arrays of the
    first argument (`eqx.filter_value_and_grad`); `value` is the unscaled loss
    (`(loss, aux)` with `has_aux`) and `grads` go to `tx.update` of a
    `loss_scaling` optimizer.

    Examples:
      >>> import jax, jax.numpy as jnp, equinox as eqx, optax
      >>> import jmp_policy as jmp
      >>> model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
      >>> tx = jmp.loss_scaling(optax.sgd(0.1), jmp.DynamicLossScale(2.0**10))
      >>> opt_state = tx.init(eqx.filter(model, eqx.is_array))
      >>> loss_fn = lambda m, x: jnp.sum(m(x) ** 2)
      >>> loss, grads = jmp.eqx.filter_value_and_scaled_grad(loss_fn)(
      ...     opt_state, model, jnp.ones(2))
      >>> bool(jnp.allclose(grads.weight, 2**10 * jax.grad(lambda w: loss_fn(
      ...     eqx.tree_at(lambda m: m.weight, model, w), jnp.ones(2)))(model.weight)))
      True
    """
    return value_and_scaled_grad(fun, has_aux=has_aux, grad_fn=eqx.filter_value_and_grad)


__all__ = [
    "MixedPrecision",
    "filter_value_and_scaled_grad",
    "mixed_precision",
]
