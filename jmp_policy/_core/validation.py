"""Checks of user-given loss-scale configuration, with errors that name the argument.

They run only when a user constructs a loss scale: JAX rebuilds states without
them (`jmp_policy._core.pytree`). Only Python and NumPy values are checked by value,
so an array given by a user never waits on the device.
"""

from __future__ import annotations

import numbers
import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

# What a float32 scalar can hold: a configuration number outside this range becomes inf or 0
# (a loss scale of 1e40 is inf in float32, one of 1e-46 is 0).
FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)
INT32_MAX = int(np.iinfo(np.int32).max)


def positive_number(value: Any, argument: str, *, allow_zero: bool = False) -> float:
    """`value` as a Python float, checked: a real number > 0 (>= 0 with `allow_zero`) that a
    float32 holds as a normal number (from 1.18e-38 to 3.40e+38), since every scale and
    factor is applied in float32."""
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
    if not (FLOAT32_TINY <= number <= FLOAT32_MAX or (allow_zero and number == 0)):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(
            f"Expected a finite number {bound} for `{argument}` that float32 holds (from "
            f"{FLOAT32_TINY:.3g} to {FLOAT32_MAX:.3g}), got {number:g}."
        )
    return number


def scale_leaf(value: Any, argument: str) -> Any:
    """Checks and converts a loss-scale leaf to float32.

    Only Python and NumPy values are checked by value and shape; JAX arrays
    (a user's `jnp.asarray(2.0**15)`, a tracer inside `vmap` of `init`) and
    `jax.ShapeDtypeStruct`s (an abstract state) are checked by dtype alone,
    which never waits on the device and lets a state be built batched or
    stacked. Anything else (a string, None, a list) is refused.
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
    if not isinstance(value, (jax.Array, jax.ShapeDtypeStruct)):
        raise TypeError(
            f"Expected a positive number (e.g. 2.0**15) or a float32 array for `{argument}`, "
            f"got {value!r}."
        )
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(
            f"Expected a floating array (float32) or a Python number for `{argument}`, "
            f"got an array of dtype {value.dtype}. Python numbers are converted for you."
        )
    if isinstance(value, jax.Array) and value.dtype != jnp.float32:
        return value.astype(jnp.float32)
    return value


def int_leaf(value: Any, argument: str) -> Any:
    """Checks and converts a counter leaf to int32: a Python or NumPy integer from 0 to
    2**31 - 1, or a JAX integer array or `jax.ShapeDtypeStruct` (checked by dtype alone, as
    `scale_leaf` checks its arrays). None passes (an optional leaf that is off)."""
    if value is None:
        return None
    if isinstance(value, (numbers.Integral, np.integer)) and not isinstance(
        value, (bool, np.bool_)
    ):
        if not 0 <= int(value) <= INT32_MAX:
            raise ValueError(
                f"Expected an integer from 0 to 2**31 - 1 (an int32 counter) for `{argument}`, "
                f"got {value}."
            )
        return jnp.asarray(value, jnp.int32)
    if not isinstance(value, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
        raise TypeError(f"Expected an integer for `{argument}`, got {value!r}.")
    if not jnp.issubdtype(value.dtype, jnp.integer):
        raise TypeError(f"Expected an int32 scalar for `{argument}`, got dtype {value.dtype}.")
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


def whole_number(value: Any, argument: str, *, low: int, high: int = INT32_MAX) -> int:
    """`value` as a Python int from `low` to `high` (by default what an int32 counter compared
    with it can reach)."""
    integral = isinstance(value, (numbers.Integral, np.integer)) or (
        isinstance(value, float) and value.is_integer()
    )
    if isinstance(value, (bool, np.bool_)) or not integral:
        raise TypeError(f"Expected an integer >= {low} for `{argument}`, got {value!r}.")
    if not low <= int(value) <= high:
        top = "2**31 - 1" if high == INT32_MAX else str(high)
        raise ValueError(
            f"Expected an integer >= {low} for `{argument}` (and <= {top}), got {value}."
        )
    return int(value)


def check_argnums(argnums: Any) -> list[int]:
    """`argnums` (an int or a non-empty sequence of ints, as JAX takes it) as a list."""
    ints = list(argnums) if isinstance(argnums, (tuple, list)) else [argnums]
    if not ints or any(
        isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)) for i in ints
    ):
        raise TypeError(
            f"Expected an int or a non-empty tuple of ints for `argnums`, got {argnums!r}."
        )
    return [int(i) for i in ints]


def argnum_positions(argnums: Any, count: int) -> list[int]:
    """The distinct positions `argnums` names among `count` arguments (negative ones counted
    from the end, as in JAX)."""
    positions = [argnum_position(i, count) for i in check_argnums(argnums)]
    if len(set(positions)) < len(positions):
        raise ValueError(
            f"Expected distinct positions in `argnums`, got {argnums!r} for {count} arguments."
        )
    return positions


def argnum_position(i: int, count: int) -> int:
    """The position `i` of `argnums` among `count` arguments; a negative one counts from the
    end, as in JAX."""
    if not -count <= i < count:
        raise ValueError(
            f"Expected `argnums` within the {count} argument(s) given (from {-count} to "
            f"{count - 1}), got {i}."
        )
    return i % count


def check_bool(value: Any, argument: str) -> bool:
    """`value` as a Python bool: True or False (a NumPy bool too), never a truthy string."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"Expected True or False for `{argument}`, got {value!r}.")
    return bool(value)


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
