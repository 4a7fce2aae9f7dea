"""Checks of user-given loss-scale configuration, with errors that name the argument.

They run only when a user constructs a loss scale: JAX rebuilds states without
them (`jmp_policy._core.pytree`). Only Python and NumPy values are checked by value,
so an array given by a user never waits on the device.
"""

from __future__ import annotations

import math
import numbers
import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer


def positive_number(value: Any, argument: str, *, allow_zero: bool = False) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (numbers.Real, np.ndarray, np.generic, jax.Array)
    ):
        raise TypeError(f"Expected a positive finite number for `{argument}`, got {value!r}.")
    if isinstance(value, (np.ndarray, jax.Array)) and value.shape != ():
        raise TypeError(f"Expected a scalar for `{argument}`, got an array of shape {value.shape}.")
    if isinstance(value, Tracer):
        raise TypeError(
            f"Expected a concrete number for `{argument}` (it is static configuration), "
            "got a traced value: build the loss scale outside `jit`."
        )
    dtype = getattr(value, "dtype", None)
    if dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"Expected a Python number or a floating scalar for `{argument}`, got dtype {dtype}."
        )
    number = float(value)
    low_ok = number >= 0 if allow_zero else number > 0
    if not (low_ok and math.isfinite(number)):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"Expected a finite number {bound} for `{argument}`, got {number}.")
    return number


def scale_leaf(value: Any, argument: str) -> Any:
    """Checks and converts a loss-scale leaf to float32.

    Only Python and NumPy values are checked by value and shape; JAX arrays
    (a user's `jnp.asarray(2.0**15)`, a tracer inside `vmap` of `init`) are
    checked by dtype alone, which never waits on the device and lets a state
    be built batched or stacked.
    """
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"Expected a positive float for `{argument}`, got {value!r}.")
    if isinstance(value, numbers.Real) or isinstance(value, (np.ndarray, np.generic)):
        dtype = getattr(value, "dtype", None)
        if dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"Expected a floating array (float32) or a Python number for `{argument}`, "
                f"got an array of dtype {dtype}. Python numbers are converted for you."
            )
        number = positive_number(value, argument)
        # A JAX array from the start: a jitted step then sees the same argument
        # types on its first and later calls, and compiles once.
        return jnp.asarray(number, jnp.float32)
    dtype = getattr(value, "dtype", None)
    if dtype is None or not hasattr(value, "shape"):
        return value  # e.g. `jax.ShapeDtypeStruct` for an abstract state
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"Expected a floating array (float32) or a Python number for `{argument}`, "
            f"got an array of dtype {dtype}. Python numbers are converted for you."
        )
    if isinstance(value, jax.Array) and dtype != jnp.float32:
        return value.astype(jnp.float32)
    return value


def int_leaf(value: Any, argument: str) -> Any:
    if isinstance(value, (numbers.Integral, np.integer)) and not isinstance(value, bool):
        return jnp.asarray(value, jnp.int32)
    if isinstance(value, (bool, numbers.Real)):
        raise TypeError(f"Expected an integer for `{argument}`, got {value!r}.")
    dtype = getattr(value, "dtype", None)
    if dtype is not None and not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"Expected an int32 scalar for `{argument}`, got dtype {dtype}.")
    return value


def check_flag(grads_finite: Any, argument: str = "grads_finite") -> jax.Array:
    if isinstance(grads_finite, bool):
        return jnp.asarray(grads_finite)
    shape = getattr(grads_finite, "shape", None)
    dtype = getattr(grads_finite, "dtype", None)
    if shape != () or dtype != jnp.bool_:
        got = f"shape {shape}, dtype {dtype}" if dtype is not None else repr(grads_finite)
        raise TypeError(
            f"Expected a scalar boolean (e.g. from `all_finite`) for `{argument}`, got {got}."
        )
    return grads_finite


def whole_number(value: Any, argument: str, *, low: int) -> int:
    integral = isinstance(value, (numbers.Integral, np.integer)) or (
        isinstance(value, float) and value.is_integer()
    )
    if isinstance(value, bool) or not integral:
        raise TypeError(f"Expected an integer >= {low} for `{argument}`, got {value!r}.")
    if int(value) < low:
        raise ValueError(f"Expected an integer >= {low} for `{argument}`, got {value}.")
    return int(value)


# Where library code lives, not the user's: frames in these folders (and Python's own) are
# skipped when a warning or a source line names the user's code.
LIBRARY_DIRS = (
    "/jax/", "/jaxlib/", "/flax/", "/optax/", "/jmp_policy/", "/chex/", "/equinox/", "/haiku/",
)  # fmt: skip


def is_library_file(file_name: str) -> bool:
    name = file_name.replace("\\", "/")
    return any(d in name for d in LIBRARY_DIRS) or "/python3." in name or name.startswith("<frozen")


_SAID: set[str] = set()


def warn_once_per_mistake(
    mistake: str, message: str, category: type[Warning], where: tuple | None = None
) -> None:
    """`warn_at_user_line`, once per process for each `mistake`: the places that can see one
    mistake (a half-precision policy at the model, then its parameters at `tx.init`) say it
    once, not once each."""
    if mistake in _SAID:
        return
    _SAID.add(mistake)
    warn_at_user_line(message, category, where)


def said(mistake: str) -> bool:
    """Whether `mistake` was said in this process (a check that can stop looking)."""
    return mistake in _SAID


HALF_MASTER_WEIGHTS = "half-precision master weights"
"""The mistake of training float16/bfloat16 parameters without `low_precision_optimizer`."""
UNSCALED_ARRIVED = "unscaled gradients from another function"
"""The mistake of gradients of the plain loss computed in one jitted function and given to
`update` in another."""
MANY_SPIKES = "many spikes"
"""Spikes skipped at a rate no healthy run shows (`loss_scaling_report`)."""


def user_frame() -> tuple:
    """The innermost line of the user's code on the stack, not a line of JAX, Flax, optax or
    this library (which a fixed `stacklevel` cannot find under `jit`, `nnx.Optimizer` or
    `eqx.filter_jit`): `(filename, lineno, module, registry)` for `warnings.warn_explicit`."""
    frame = sys._getframe(1)
    while frame.f_back is not None and is_library_file(frame.f_code.co_filename):
        frame = frame.f_back
    return (
        frame.f_code.co_filename,
        frame.f_lineno,
        frame.f_globals.get("__name__", "__main__"),
        frame.f_globals.setdefault("__warningregistry__", {}),
    )


def warn_at_user_line(message: str, category: type[Warning], where: tuple | None = None) -> None:
    """`warnings.warn(message, category)` attributed to the innermost line of the user's code
    on the stack (`user_frame`), or to `where`, a `user_frame` found before (a warning said by
    a callback of a running step, at the line where the step was traced)."""
    filename, lineno, module, registry = user_frame() if where is None else where
    warnings.warn_explicit(message, category, filename, lineno, module=module, registry=registry)
