"""Whether a 16-bit optimizer-state field rounded to nearest follows the gradients: each
field's decay measured on a one-element probe (`field_decays`), and the warning
`low_precision_optimizer` gives for a field whose per-step change rounds away
(`warn_if_fields_stall`)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_policy.policy import is_floating_array

F32 = np.dtype(np.float32)


def _field_names(path: tuple) -> list[str]:
    """The state fields (NamedTuple attributes, as optax states are) on a leaf's path.

    Dict keys are left out: they name parameters (a layer called "mu"), not moments.
    """
    return [e.name for e in path if isinstance(e, jax.tree_util.GetAttrKey)]


def field_decays(inner: optax.GradientTransformation, params: Any = None) -> dict[str, float]:
    """Per floating state field of `inner`, the decay d of its update `f <- d f + c h(g)`.

    Measured, not read from the optimizer's arguments (optax keeps them in closures): two
    updates with a unit gradient on a one-element parameter give `f1 = c` and
    `f2 = (1 + d) c`, so `d = f2 / f1 - 1` (Adam: `b1` for `mu`, `b2` for `nu`; a momentum
    trace: its decay). A field that is zero after the first step, or whose measured decay is
    not in (0, 1) (not a moving average or a decaying sum), is left out: its decay cannot be
    known this way. `params`: the parameters' structure, for an optimizer that needs it
    (`optax.masked`, `optax.multi_transform`): each leaf is probed as one element per axis.

    Raises:
      What `inner` raises where it cannot run on the probe (`_probed_decays` handles it).
    """
    params = (
        jnp.ones((1,), F32)
        if params is None
        else jax.tree.map(lambda p: jnp.ones((1,) * jnp.ndim(p), F32), params)
    )
    with jax.ensure_compile_time_eval(), jax.numpy_dtype_promotion("standard"):
        state = inner.init(params)
        grads = jax.tree.map(jnp.ones_like, params)
        _, first = inner.update(grads, state, params)
        _, second = inner.update(grads, first, params)
        decays: dict[str, float] = {}
        pairs = zip(
            jax.tree_util.tree_leaves_with_path(first), jax.tree.leaves(second), strict=True
        )
        for (path, f1), f2 in pairs:
            if not is_floating_array(f1) or f1.size != 1:
                continue
            before, after = float(f1.reshape(())), float(f2.reshape(()))
            if before == 0 or not math.isfinite(before) or not math.isfinite(after):
                continue
            decay = after / before - 1
            if 0 < decay < 1:
                for name in _field_names(path):
                    decays[name] = max(decays.get(name, 0.0), decay)
    return decays


# What an optimizer raises on a probe whose structure it was not built for (a mask or label
# tree of `optax.masked`/`multi_transform` against a single array; a shape it needs).
_PROBE_ERRORS = (ValueError, TypeError, KeyError, IndexError)


def warn_if_fields_stall(
    inner: optax.GradientTransformation, dtypes: Mapping[str, Any], params: Any = None
) -> bool:
    """Warns about 16-bit fields rounded to nearest whose per-step change rounds away
    (`field_decays`). Returns False where `inner` cannot run on a one-element probe and
    `params` (their structure) is not known yet: the check is then made at `init`; where it
    cannot run on a probe of the parameters' structure either, a warning says so."""
    half = {name: dtype for name, dtype in dtypes.items() if dtype != F32}
    if not half:
        return True
    try:
        decays = field_decays(inner, params)
    except _PROBE_ERRORS as error:
        if params is None:
            return False
        warnings.warn(
            f"low_precision_optimizer could not check whether the 16-bit fields {sorted(half)} "
            "follow the gradients when rounded to nearest: the inner optimizer did not run on "
            f"a one-element probe of the parameters ({type(error).__name__}: {error}). A field "
            "that decays by more than 1 - half an ulp a step stops following them (float32, "
            "or rounding='stochastic', avoid it).",
            UserWarning,
            stacklevel=4,
        )
        return True
    for name, dtype in half.items():
        decay = decays.get(name)
        half_ulp = 2.0 ** -(jnp.finfo(dtype).nmant + 1)
        if decay is not None and 1 - decay < half_ulp:
            warnings.warn(
                f"low_precision_optimizer: `moment_dtypes[{name!r}]` keeps {name!r} in "
                f"{jnp.dtype(dtype).name} rounded to nearest, but the inner optimizer decays it "
                f"by {decay:.6g} a step: its updates change it by 1 - {decay:.6g} = "
                f"{1 - decay:.3g} of its value, below half a {jnp.dtype(dtype).name} ulp "
                f"({half_ulp:.3g}), so they round away and {name!r} stops following the "
                f"gradients. Store it in float32 (`moment_dtypes={{..., {name!r}: 'float32'}}`) "
                "or use rounding='stochastic', which keeps 16-bit fields unbiased.",
                UserWarning,
                stacklevel=3 if params is None else 4,
            )
    return True
