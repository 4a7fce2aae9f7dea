"""`low_precision_optimizer`: an optax optimizer whose parameters and moments live in 16 bits,
its state (`LowPrecisionState`) and `master_params`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import DTypeLike

from jmp_policy._core.compat import variable_value
from jmp_policy._core.pytree import find_states
from jmp_policy._low_precision.rounding import (
    _random_bits_for,
    _round_up_by,
    join_float32,
    split_float32,
)
from jmp_policy._low_precision.stall_check import _field_names, warn_if_fields_stall
from jmp_policy.policy import is_floating_array

MODES = ("stochastic", "kahan", "split")
BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
_STORAGE = (F32, BF16, jnp.dtype(jnp.float16))


_NO_RESIDUAL = jnp.uint8  # a scalar of this dtype: no residual (one byte per leaf)


class LowPrecisionState(NamedTuple):
    """The state of `low_precision_optimizer`.

    Attributes:
      inner_state: the wrapped optimizer's state, its moments stored in their 16-bit dtypes.
      key: the raw PRNG key (uint32[2]) of stochastic rounding; it advances once per applied
        step, so a step skipped by `loss_scaling` leaves it, like everything else, unchanged.
      residual: per parameter, what the 16-bit parameter lacks: the bfloat16 Kahan
        compensation ("kahan"), the int16 low half of the float32 master ("split"), or a
        uint8 zero ("stochastic", and parameters kept in float32; a scalar rather than an
        empty array, which checkpointers such as orbax refuse to save).
    """

    inner_state: optax.OptState
    key: jax.Array
    residual: chex.ArrayTree

    # Read by `loss_scaling` (without importing this module): its warning about half-precision
    # master weights stays silent for a state that keeps their updates on purpose.
    keeps_16_bit_updates = True


def _check_dtypes(moment_dtypes: Any) -> dict[str, np.dtype]:
    if not isinstance(moment_dtypes, Mapping):
        raise TypeError(
            "Expected a mapping {state field name: dtype} for `moment_dtypes`, e.g. "
            f"{{'mu': 'bfloat16', 'nu': 'bfloat16'}}, got {type(moment_dtypes).__name__}."
        )
    out = {}
    for name, dtype in moment_dtypes.items():
        try:
            dtype = jnp.dtype(dtype)
        except TypeError:
            dtype = None
        if dtype not in _STORAGE:
            raise TypeError(
                f"Expected float32, bfloat16 or float16 for `moment_dtypes[{name!r}]`, "
                f"got {moment_dtypes[name]!r}."
            )
        if name == "nu" and dtype == jnp.float16:
            raise ValueError(
                "`moment_dtypes['nu']` cannot be float16: Adam's second moment is the squared "
                "gradient, and squares below 6e-8 flush to zero in float16 (then the update "
                "divides by eps alone). Use bfloat16, which has float32's range."
            )
        out[str(name)] = dtype
    return out


def _moment_dtype(path: tuple, leaf: Any, dtypes: Mapping[str, np.dtype]) -> np.dtype | None:
    """The storage dtype of an inner-state leaf, or None to leave it as the inner makes it."""
    if is_floating_array(leaf):
        for name in _field_names(path):
            if name in dtypes:
                return dtypes[name]
    return None


_DEFAULT_MOMENTS: dict[str, dict[str, Any]] = {
    "stochastic": {"mu": BF16, "nu": BF16},  # unbiased by stochastic rounding
    "kahan": {"mu": BF16, "nu": F32},  # nu's 0.1% steps vanish rounded to nearest
    "split": {},  # the inner optimizer's own float32 moments: exact
}


def _floating_fields(tree: Any) -> list[str]:
    return sorted(
        {
            name
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
            if is_floating_array(leaf)
            for name in _field_names(path)
        }
    )


def low_precision_optimizer(
    inner: optax.GradientTransformation,
    rounding: Literal["stochastic", "kahan", "split"] = "stochastic",
    *,
    moment_dtypes: Mapping[str, DTypeLike] | None = None,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """Wraps `inner` so that 16-bit parameters and moments lose none of the small updates.

    Keep the parameters you want in 16 bits as bfloat16 (e.g. `get_policy("params=bfloat16,
    compute=bfloat16,output=float32").cast_to_param(params)`) and the rest in float32. Each step
    computes `inner`'s update in float32 against the float32 value of the parameters, then
    writes the result back to 16 bits by `rounding`. The returned updates are such that
    `optax.apply_updates` lands exactly on those 16-bit values; float32 parameters get `inner`'s
    update unchanged.

    Args:
      inner: the optimizer, e.g. `optax.adamw(1e-3)`.
      rounding: "stochastic" (unbiased random rounding: the bfloat16 parameter alone), "kahan"
        (plus a bfloat16 compensation buffer: 4 bytes a parameter) or "split" (plus an int16
        remainder: 4 bytes, exactly a float32 master). Moments come on top.
      moment_dtypes: `{field name of inner's state: dtype}`, the storage dtype of each moment
        (e.g. `{"mu": "bfloat16", "nu": "bfloat16"}` for Adam; float16 is refused for "nu",
        whose squares underflow; a name the state lacks is a `ValueError` at `init`). They are
        rounded the same way as the parameters with "stochastic", to nearest otherwise. Every
        default keeps each 16-bit field unbiased: "stochastic" stores "mu" and "nu" in bfloat16
        (rounded stochastically: 6 bytes a parameter with the parameter); "kahan" stores "mu" in
        bfloat16 and "nu" in float32 (10 bytes), since Adam's `nu` moves by `1 - b2` = 0.1% a
        step, below half a bfloat16 ulp, and rounded to nearest it stops following the
        gradients; "split" keeps the inner optimizer's own dtypes (that is what keeps it exact).
        A field stored rounded to nearest in 16 bits whose decay makes its updates vanish
        (`1 - decay` below half an ulp) is warned about here, naming the field and its decay.
      seed: the seed of stochastic rounding; a run is deterministic for a given seed.

    Returns:
      An optax transformation; its state is a `LowPrecisionState`. `update` needs `params`.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import jmp_policy as jmp
      >>> params = {"w": jnp.ones(1000, jnp.bfloat16)}
      >>> tx = jmp.low_precision_optimizer(optax.sgd(1e-4), "kahan")
      >>> state = tx.init(params)
      >>> for _ in range(1000):  # add 1e-4 a thousand times: round-to-nearest stays at 1.0
      ...     updates, state = tx.update({"w": -jnp.ones(1000)}, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> params["w"].dtype, round(float(params["w"][0]), 2)
      (dtype(bfloat16), 1.1)
    """
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(
            f"Expected an optax.GradientTransformation for `inner`, got {type(inner).__name__}."
        )
    if not isinstance(rounding, str) or rounding not in MODES:
        raise ValueError(f"Expected one of {MODES} for `rounding`, got {rounding!r}.")
    given = moment_dtypes is not None
    if moment_dtypes is None:
        moment_dtypes = _DEFAULT_MOMENTS[rounding]
    dtypes = _check_dtypes(moment_dtypes)
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
        raise TypeError(f"Expected an int for `seed`, got {seed!r}.")
    inner = optax.with_extra_args_support(inner)
    # Checked now, or at `init` where the inner optimizer needs the parameters' structure.
    checked = rounding == "stochastic" or warn_if_fields_stall(inner, dtypes)

    def check_params(params: Any) -> None:
        for path, p in jax.tree_util.tree_leaves_with_path(params):
            dtype = jnp.dtype(getattr(p, "dtype", F32))
            if jnp.issubdtype(dtype, jnp.floating) and dtype not in (F32, BF16):
                raise TypeError(
                    f"low_precision_optimizer keeps parameters in bfloat16 or float32; "
                    f"{jax.tree_util.keystr(path)} is {dtype.name}. float16's range is too "
                    "narrow for weights updated in place: cast it to bfloat16."
                )

    def master(params: Any, residual: Any) -> Any:
        """The float32 value of the parameters the inner optimizer works on."""

        def one(p, r):
            if p.dtype != BF16:
                return p
            if rounding == "split":
                return join_float32(p, r)
            if rounding == "kahan":
                return p.astype(F32) + r.astype(F32)
            return p.astype(F32)

        return jax.tree.map(one, params, residual)

    def store_moments(tree: Any, key: jax.Array | None) -> Any:
        leaves = jax.tree_util.tree_leaves_with_path(tree)
        targets = [_moment_dtype(path, leaf, dtypes) for path, leaf in leaves]
        rounded = [
            i
            for i, ((_, leaf), dtype) in enumerate(zip(leaves, targets, strict=True))
            if key is not None and dtype == BF16 and leaf.dtype != BF16
        ]
        bits = _random_bits_for(key, [leaves[i][1] for i in rounded]) if key is not None else []
        noise = dict(zip(rounded, bits, strict=True))
        out = []
        for i, ((_, leaf), dtype) in enumerate(zip(leaves, targets, strict=True)):
            if dtype is None or dtype == leaf.dtype:
                out.append(leaf)
            elif i in noise:
                out.append(_round_up_by(leaf, noise[i]))
            else:
                out.append(leaf.astype(dtype))
        return jax.tree.unflatten(jax.tree.structure(tree), out)

    def load_moments(tree: Any) -> Any:
        return jax.tree_util.tree_map_with_path(
            lambda path, x: (
                x.astype(F32) if _moment_dtype(path, x, dtypes) not in (None, F32) else x
            ),
            tree,
        )

    def init_fn(params):
        check_params(params)
        if not checked:
            warn_if_fields_stall(inner, dtypes, params)

        def residual(p):
            if p.dtype != BF16 or rounding == "stochastic":
                return jnp.zeros((), _NO_RESIDUAL)
            return jnp.zeros(p.shape, BF16 if rounding == "kahan" else jnp.int16)

        residuals = jax.tree.map(residual, params)
        inner_state = inner.init(master(params, residuals))
        found = _floating_fields(inner_state)
        missing = sorted(set(dtypes) - set(found))
        if missing and given:
            raise ValueError(
                f"`moment_dtypes` names {missing}, which the inner optimizer's state does not "
                f"have; its floating fields are {found}."
            )
        return LowPrecisionState(
            inner_state=store_moments(inner_state, None),
            key=jax.random.key_data(jax.random.key(seed)),
            residual=residuals,
        )

    def update_fn(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError("low_precision_optimizer needs `params` in `update`.")
        key, step_key = jax.random.split(jax.random.wrap_key_data(state.key))
        full = master(params, state.residual)
        grads = jax.tree.map(
            lambda g: g.astype(F32) if jnp.issubdtype(g.dtype, jnp.floating) else g, updates
        )
        inner_updates, inner_state = inner.update(
            grads, load_moments(state.inner_state), full, **extra_args
        )
        flat_params, treedef = jax.tree.flatten(params)
        flat_full = treedef.flatten_up_to(full)
        flat_updates = treedef.flatten_up_to(inner_updates)
        flat_residual = treedef.flatten_up_to(state.residual)
        half = [i for i, p in enumerate(flat_params) if p.dtype == BF16]
        noise = {}
        if rounding == "stochastic":
            bits = _random_bits_for(jax.random.fold_in(step_key, 0), [flat_params[i] for i in half])
            noise = dict(zip(half, bits, strict=True))
        new_updates, new_residual = [], []
        for i, (p, f, u, r) in enumerate(
            zip(flat_params, flat_full, flat_updates, flat_residual, strict=True)
        ):
            if p.dtype != BF16:
                new_updates.append(u)
                new_residual.append(r)
                continue
            target = f + u.astype(F32)
            if rounding == "stochastic":
                new_p = _round_up_by(target, noise[i])
            elif rounding == "kahan":
                new_p = target.astype(BF16)
                r = (target - new_p.astype(F32)).astype(BF16)
            else:
                new_p, r = split_float32(target)
            # apply_updates computes p + u in float32 and casts: exactly new_p.
            new_updates.append(new_p.astype(F32) - p.astype(F32))
            new_residual.append(r)
        moment_key = jax.random.fold_in(step_key, 1)
        return jax.tree.unflatten(treedef, new_updates), LowPrecisionState(
            inner_state=store_moments(
                inner_state, moment_key if rounding == "stochastic" else None
            ),
            key=jax.random.key_data(key),
            residual=jax.tree.unflatten(treedef, new_residual),
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def master_params(params: chex.ArrayTree, opt_state: Any) -> chex.ArrayTree:
    """The float32 master value of `params` kept by a `low_precision_optimizer` in `opt_state`.

    `opt_state` may be an optax state (the optimizer may sit inside `optax.chain` or
    `loss_scaling`), a Flax `TrainState` or an `nnx.Optimizer`.

    "split": exactly the float32 master; "kahan": the parameter plus its compensation;
    "stochastic": the parameter itself. For evaluation and for float32 checkpoints.
    """
    state = _find_state(opt_state)

    def one(r, p):
        if hasattr(p, "get_value") or hasattr(p, "value"):
            p = variable_value(p)  # an nnx.Variable holding its array
        if p.dtype != BF16 or r.dtype == _NO_RESIDUAL:
            return p.astype(F32) if jnp.issubdtype(p.dtype, jnp.floating) else p
        if r.dtype == jnp.int16:
            return join_float32(p, r)
        return p.astype(F32) + r.astype(F32)

    # The residuals have the structure of the parameters the optimizer saw, down to arrays.
    return jax.tree.map(one, state.residual, params)


def _find_state(opt_state: Any) -> LowPrecisionState:
    found = find_states(opt_state, LowPrecisionState)
    if len(found) != 1:
        raise ValueError(
            "Expected exactly one `low_precision_optimizer` state in `opt_state`, found "
            f"{len(found) or 'none'} in a {type(opt_state).__name__}."
        )
    return found[0]
