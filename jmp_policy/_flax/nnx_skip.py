"""`revert_if_skipped`: around an NNX train step, a step `loss_scaling` skips leaves every
variable of the model as it was (NNX layers write theirs in place during the forward pass)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from flax import nnx

from jmp_policy._core.compat import set_variable_value, variable_value
from jmp_policy._loss_scaling.state import find_loss_scaling_state, unless_skipped


@contextlib.contextmanager
def revert_if_skipped(model: nnx.Module, optimizer: nnx.Optimizer) -> Iterator[None]:
    """Around an NNX train step: a skipped step leaves the model's state as it was.

    NNX layers write their state in place during the forward pass (BatchNorm's
    `BatchStat` running averages, RNG counts, caches). A step that
    `loss_scaling` skips leaves the parameters and the optimizer state as they
    were; this leaves every other variable of `model` (all but the
    optimizer's `wrt`) as it was too. A forward pass that overflows writes NaN
    batch statistics, and kept, they poison every later step. The optimizer's
    `step` (Flax's count of `update` calls) is kept too, so it counts applied
    steps, as `find_loss_scaling_state(optimizer).applied_steps` does.

    Use it inside the jitted step, around the gradient and `optimizer.update`:
    the choice is `jmp_policy.unless_skipped`, a `select` per array, no host sync.

    Args:
      model: the NNX model the step trains.
      optimizer: the `nnx.Optimizer` built with a `loss_scaling` transform.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> import jmp_policy as jmp
      >>> model = nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)),
      ...                        nnx.BatchNorm(2, rngs=nnx.Rngs(0)))
      >>> tx = jmp.loss_scaling(optax.sgd(0.1), jmp.DynamicLossScale(2.0**10))
      >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
      >>> @nnx.jit
      ... def train_step(model, optimizer, x):
      ...     with jmp.nnx.revert_if_skipped(model, optimizer):
      ...         loss_fn = lambda model: jnp.mean(model(x) ** 2)
      ...         _, grads = jmp.value_and_scaled_grad(loss_fn, grad_fn=nnx.value_and_grad)(
      ...             optimizer, model)
      ...         optimizer.update(model, grads)
      >>> train_step(model, optimizer, jnp.array([[1.0, jnp.inf], [0.0, 1.0]]))  # overflows
      >>> model.layers[1].mean[...].tolist()  # not NaN: the step was skipped
      [0.0, 0.0]
    """
    if not isinstance(optimizer, nnx.Optimizer):
        raise TypeError(
            "Expected the nnx.Optimizer that trains `model` for `optimizer` (built as "
            "`nnx.Optimizer(model, jmp_policy.loss_scaling(tx, scale), wrt=nnx.Param)`), got "
            f"{type(optimizer).__name__}."
        )
    find_loss_scaling_state(optimizer)  # raises now, not after the step, if there is none
    others = nnx.Not(getattr(optimizer, "wrt", nnx.Param))
    # The variables are the model's own (changed in place): keep their values now.
    before = {path: variable_value(v) for path, v in nnx.to_flat_state(nnx.state(model, others))}
    counter = getattr(optimizer, "step", None)  # Flax's count of `update` calls
    step = None if counter is None else variable_value(counter)
    yield
    if counter is not None:  # ...kept on a skip: it counts applied steps
        set_variable_value(counter, unless_skipped(optimizer, variable_value(counter), step))
    after = dict(nnx.to_flat_state(nnx.state(model, others)))
    # Variables the step created (e.g. sown intermediates) have nothing to go back to.
    paths = [path for path in before if path in after]
    kept = unless_skipped(
        optimizer, [variable_value(after[p]) for p in paths], [before[p] for p in paths]
    )
    for path, value in zip(paths, kept, strict=True):
        set_variable_value(after[path], value)
