"""Delayed float8 scaling as model state (`mixed_float8` with a `DelayedScaling` recipe): the
matmul whose state's gradient is its next state (`delayed_dot_general`), the numbering of
autocast's float8 matmuls (`Sites`), and the writing of the state by `loss_scaling`
(`split_states`, `written`).

The output gradient's amax exists only in the backward pass, and a pure function can hand a
value out of the backward pass only as a gradient. So, as Flax's `Fp8DotGeneralOp` does, the
state sits among the values the train step differentiates (a Linen collection, an NNX `Param`,
a field of the Equinox wrapper, autocast's `fp8_state`), and its gradient is the state the
step leaves. Unlike Flax's, the gradient carries a count in the state's `grad_amax` slot (1 per
use): a state used by no matmul this step (a `cond` branch not taken) has count 0 and keeps
its value; a state used n times (a layer called twice, one example per call under `jax.vmap`)
gets the mean of its n next states. `loss_scaling` finds the states in the gradients by their
type (`Fp8DotState`), keeps them out of the inner optimizer (no clipping, no weight decay, no
unscaling) and hands back the update that writes them, or keeps them on a skipped step.

NVFP4's training recipe (`mixed_nvfp4` with an `nvfp4.Recipe`) keeps a state per matmul the same
way: the key of its draws (`nvfp4.State`), whose gradient counts its uses; the write is the key
after it (`nvfp4.advanced`) where the step is applied and used it.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jmp_policy import nvfp4
from jmp_policy._fp8.delayed import DelayedScaling, Fp8DotState
from jmp_policy._fp8.scaling import (
    E4M3,
    SCALINGS,
    _amax,
    _dequantized_dot,
    _dequantized_grads,
    _dot_arguments,
    quantize,
)

FP8_STATE = "fp8_state"
"""The Linen collection (and the Equinox wrapper's field) that holds the delayed-scaling
state of `mixed_float8`'s matmuls."""


STATEFUL = (DelayedScaling, nvfp4.Recipe)
"""The recipes whose matmuls keep a state per matmul: float8's delayed scaling (`Fp8DotState`),
and NVFP4's training recipe (`nvfp4.State`, the key of its draws)."""


def is_state(x: Any) -> bool:
    return isinstance(x, (Fp8DotState, nvfp4.State))


def stateful(scaling: Any) -> DelayedScaling | nvfp4.Recipe | None:
    """`scaling` if it is a recipe whose matmuls keep state (`STATEFUL`), else None."""
    return scaling if isinstance(scaling, STATEFUL) else None


def state_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    state: Any,
    recipe: DelayedScaling | nvfp4.Recipe,
    *,
    out_dtype: DTypeLike | None = None,
) -> jax.Array:
    """One matmul of a stateful recipe with its `state`, whose gradient `written` reads:
    `delayed_dot_general` for a `DelayedScaling`, `nvfp4.linear_dot_general` for NVFP4's."""
    if isinstance(recipe, nvfp4.Recipe):
        return nvfp4.linear_dot_general(
            lhs, rhs, dimension_numbers, state, recipe, out_dtype=out_dtype
        )
    return delayed_dot_general(lhs, rhs, dimension_numbers, state, recipe, out_dtype=out_dtype)


def fresh_state(recipe: DelayedScaling | nvfp4.Recipe, key: jax.Array | None = None) -> Any:
    """A matmul's first state: NVFP4's from `key` (a layer's own, folded from the recipe's
    seed), float8's the same for every matmul."""
    return recipe.init(key) if isinstance(recipe, nvfp4.Recipe) else recipe.init()


def delayed_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    state: Fp8DotState,
    recipe: DelayedScaling,
    *,
    out_dtype: DTypeLike | None = None,
) -> jax.Array:
    """`fp8_dot_general_delayed` whose next state is the gradient of `state`.

    Differentiate the loss with respect to `state` too (it is model state: a Linen collection,
    an NNX `Param`) and give the gradient to a `loss_scaling` optimizer, which writes it: the
    operands' metadata advanced by their amaxes of this step, the output gradient's by its
    amax in the backward pass, and a count of 1 in `grad_amax` (see the module docstring).
    """
    dimension_numbers, out_dtype = _dot_arguments(lhs, dimension_numbers, out_dtype)
    static = (recipe, out_dtype, np.dtype(lhs.dtype), np.dtype(rhs.dtype))
    return _state_dot(lhs, rhs, state, dimension_numbers, static)  # pyright: ignore[reportReturnType]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _state_dot(lhs, rhs, state, dimension_numbers, static):
    return _state_dot_fwd(lhs, rhs, state, dimension_numbers, static)[0]


def _state_dot_fwd(lhs, rhs, state, dimension_numbers, static):
    recipe, out_dtype, _, _ = static
    lhs_meta = recipe.advance(state.lhs, _amax(lhs), E4M3)
    rhs_meta = recipe.advance(state.rhs, _amax(rhs), E4M3)
    q_lhs, q_rhs = quantize(lhs, E4M3, lhs_meta.scale), quantize(rhs, E4M3, rhs_meta.scale)
    out = _dequantized_dot(
        q_lhs, lhs_meta.scale, q_rhs, rhs_meta.scale, dimension_numbers, out_dtype
    )
    return out, (q_lhs, q_rhs, lhs_meta, rhs_meta, state.grad)


def _state_dot_bwd(dimension_numbers, static, residuals, g):
    recipe, _, lhs_dtype, rhs_dtype = static
    q_lhs, q_rhs, lhs_meta, rhs_meta, grad_meta = residuals
    grad_meta = recipe.advance_grad(grad_meta, _amax(g))
    q_g = quantize(g, recipe.grad_dtype, grad_meta.scale)
    d_lhs, d_rhs = _dequantized_grads(
        (q_g, grad_meta.scale),
        (q_lhs, lhs_meta.scale),
        (q_rhs, rhs_meta.scale),
        dimension_numbers,
        (lhs_dtype, rhs_dtype),
    )
    # Under `jax.vmap`, JAX sums the cotangent of an unmapped state over the examples, but
    # only of the fields that vary with them: tied to every operand (times 0), each field
    # and the count vary, so the sum over n examples divided by the count n is a mean.
    tie = sum(
        jnp.where(jnp.isfinite(a), a, 0.0) * 0.0 for a in (lhs_meta.scale, rhs_meta.scale, _amax(g))
    )
    lhs_meta, rhs_meta, grad_meta = jax.tree.map(lambda x: x + tie, (lhs_meta, rhs_meta, grad_meta))
    return d_lhs, d_rhs, Fp8DotState(lhs_meta, rhs_meta, grad_meta, jnp.asarray(1.0 + tie))


_state_dot.defvjp(_state_dot_fwd, _state_dot_bwd)


# loss_scaling's side ----------------------------------------------------------------------


def _state_or_none(x: Any) -> bool:
    return x is None or is_state(x)


def split_states(tree: Any) -> tuple[Any, list, Any] | None:
    """`(tree without its Fp8DotStates, leaves, treedef)`: the states replaced by None (an
    empty subtree), `leaves` the flat list with the states, and the Nones the tree already
    held (Equinox's filtered trees), as single leaves; None if `tree` holds no state."""
    if tree is None:
        return None
    leaves, treedef = jax.tree.flatten(tree, is_leaf=_state_or_none)
    if not any(is_state(leaf) for leaf in leaves):
        return None
    rest = jax.tree.unflatten(treedef, [None if is_state(x) else x for x in leaves])
    return rest, leaves, treedef


def without_states(tree: Any) -> Any:
    """`tree` with its Fp8DotStates replaced by None (`tree` itself if it holds none)."""
    split = split_states(tree)
    return tree if split is None else split[0]


def written(updates: Any, grads: tuple[list, Any], params: Any, applied: jax.Array) -> Any:
    """The full update: the inner optimizer's `updates` (None where the states were), and for
    each state of `grads` (`split_states`' leaves and treedef) the update that writes its
    next state (`new - old`: `optax.apply_updates` gives the next state to within float32
    rounding) where the step is `applied` and the state was used, else zeros."""
    grad_leaves, treedef = grads
    if params is None:
        raise ValueError(
            "Expected `params` in `update` of a loss_scaling optimizer whose gradients hold "
            "matmul state (mixed_float8 with a DelayedScaling recipe, or mixed_nvfp4 with an "
            "nvfp4.Recipe): the next state is written as `next - params`. Call "
            "`tx.update(grads, opt_state, params)`."
        )
    param_leaves = jax.tree.flatten(params, is_leaf=_state_or_none)[0]
    update_leaves = jax.tree.flatten(updates, is_leaf=_state_or_none)[0]
    if not (len(param_leaves) == len(grad_leaves) == len(update_leaves)):
        raise ValueError(
            "Expected `params` of the gradients' structure in `update` of a loss_scaling "
            f"optimizer; got {len(param_leaves)} leaves for {len(grad_leaves)}."
        )
    out = [
        _write(g, p, applied) if is_state(g) else u
        for g, p, u in zip(grad_leaves, param_leaves, update_leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, out)


def stepped(grad: Any, old: Any) -> Any:
    """The state an applied step writes from `grad`, the gradient of a state `old` that a
    policy's matmuls used (its next value, summed over its uses, which `grad_amax` counts);
    `old` where it was not used."""
    return jax.tree.map(jnp.add, old, _write(grad, old, jnp.asarray(True)))


def _write(grad: Any, old: Any, applied: jax.Array) -> Any:
    if isinstance(grad, nvfp4.State):
        return _write_key(grad, old, applied)
    return _write_delayed(grad, old, applied)


def _write_key(grad: nvfp4.State, old: nvfp4.State, applied: jax.Array) -> nvfp4.State:
    """An NVFP4 layer's key advanced (`nvfp4.advanced`) where the step is `applied` and used
    it: as the update `next - old`, exact in float32 (16-bit halves)."""
    write = (applied & (grad.uses > 0))[..., None]
    step = nvfp4.advanced(old).key - old.key
    return nvfp4.State(jnp.where(write, step, jnp.zeros_like(old.key)), -old.uses)


def _write_delayed(grad: Fp8DotState, old: Fp8DotState, applied: jax.Array) -> Fp8DotState:
    count = grad.grad_amax  # uses this step (summed, as gradients are)
    write = applied & (count > 0)
    safe = jnp.where(count > 0, count, 1.0)

    def update(g: jax.Array, o: jax.Array) -> jax.Array:
        mean = g / safe.reshape(safe.shape + (1,) * (g.ndim - safe.ndim))
        keep = write.reshape(write.shape + (1,) * (g.ndim - write.ndim))
        return jnp.where(keep, mean - o, jnp.zeros_like(o))

    lhs, rhs, grad_meta = jax.tree.map(
        update, (grad.lhs, grad.rhs, grad.grad), (old.lhs, old.rhs, old.grad)
    )
    return Fp8DotState(lhs, rhs, grad_meta, -old.grad_amax)  # the slot back to 0


# autocast's numbering ------------------------------------------------------------------------


class _ScanEntry(NamedTuple):
    length: int
    sites: Sites


class Sites:
    """The states of an autocast program's float8 matmuls, numbered in the order the
    evaluation first meets each equation (a sub-program evaluated twice, e.g. once for its
    output types, meets the same equations). A `scan`'s matmuls are one entry of its
    enclosing program: a tuple of their states stacked over the scan's length, sliced per
    step (`child`). Built with `states` (a call) or without (`init_fp8_state`: each matmul
    records a fresh `recipe.init()`)."""

    def __init__(self, recipe: DelayedScaling | nvfp4.Recipe, states: tuple | None = None):
        self.recipe = recipe
        self._states = states
        self._index: dict[Any, int] = {}  # equation (hashed by identity) -> its number
        self._entries: list[Any] = []  # init: what each index holds

    def _number(self, eqn: Any) -> tuple[int, bool]:
        found = self._index.get(eqn)
        if found is not None:
            return found, False
        index = len(self._index)
        self._index[eqn] = index
        if self._states is not None and index >= len(self._states):
            raise ValueError(
                "The `fp8_state` given holds fewer matmul states than this program has float8 "
                f"matmuls (more than {len(self._states)}): make it for this call with "
                "`init_fp8_state`."
            )
        return index, True

    def state_for(self, eqn: Any) -> Any:
        """The state of the matmul `eqn`: an `Fp8DotState`, or an `nvfp4.State`."""
        index, new = self._number(eqn)
        if self._states is None:
            if new:
                self._entries.append("matmul")  # its state made outside the trace (`build`)
            return fresh_state(self.recipe)
        state = self._states[index]
        if not is_state(state):
            raise ValueError(
                f"The `fp8_state` entry {index} is a {type(state).__name__}, where this "
                "program has a matmul: make the state for this call with `init_fp8_state`."
            )
        return state

    def scan_entry(self, eqn: Any) -> tuple[Any, Sites | None]:
        """`(stacked states, None)` of a scan's matmuls in a call; `(None, child)` in
        `init_fp8_state`, the child recording them."""
        index, new = self._number(eqn)
        if self._states is None:
            if new:
                self._entries.append(_ScanEntry(eqn.params["length"], Sites(self.recipe)))
            return None, self._entries[index].sites
        entry = self._states[index]
        if not isinstance(entry, tuple):
            raise ValueError(
                f"The `fp8_state` entry {index} is a {type(entry).__name__}, where this "
                "program has a scan: make the state for this call with `init_fp8_state`."
            )
        return entry, None

    def child(self, sliced: tuple) -> Sites:
        return Sites(self.recipe, sliced)

    def check_used(self) -> None:
        if self._states is not None and len(self._index) != len(self._states):
            raise ValueError(
                f"The `fp8_state` given holds {len(self._states)} entries where this program "
                f"has {len(self._index)} float8 matmuls and scans: make it for this call with "
                "`init_fp8_state`."
            )

    def build(self, key: jax.Array | None = None) -> tuple:
        """The states `init_fp8_state` hands out: one per matmul, a stacked tuple per scan.
        NVFP4's from `key` (default: the recipe's seed), one folded in per entry and split
        over a scan's steps, so that no two layers draw alike."""
        if key is None and isinstance(self.recipe, nvfp4.Recipe):
            key = jax.random.key(self.recipe.seed)

        def built(index: int, entry: Any) -> Any:
            own = None if key is None else jax.random.fold_in(key, index)
            if entry == "matmul":
                return fresh_state(self.recipe, own)
            if own is not None:
                return jax.vmap(entry.sites.build)(jax.random.split(own, entry.length))
            return jax.tree.map(
                lambda x: jnp.broadcast_to(x, (entry.length, *x.shape)).copy(),
                entry.sites.build(),
            )

        return tuple(built(i, e) for i, e in enumerate(self._entries))


def checked_scaling(scaling: Any, policy: Any, argument: str = "fp8_scaling") -> Any:
    """`scaling` as a float8 integration takes it: "tensorwise" or "rowwise" (current
    scaling), or a `DelayedScaling` ("delayed": the default recipe), which only a per-tensor
    float8 policy (`mixed_float8`) takes."""
    if isinstance(scaling, str) and scaling == "delayed":
        scaling = DelayedScaling()
    nvfp4_policy = np.dtype(policy.compute_dtype) == np.dtype(jnp.float4_e2m1fn)
    if isinstance(scaling, nvfp4.Recipe):
        if not nvfp4_policy:
            raise ValueError(
                f"A jmp_policy.nvfp4.Recipe for `{argument}` is NVFP4's training recipe, for "
                "a 'mixed_nvfp4' policy; the policy computes in "
                f"{np.dtype(policy.compute_dtype).name}."
            )
        return scaling
    if isinstance(scaling, DelayedScaling):
        if policy.compute_dtype.itemsize == 1 and np.dtype(policy.compute_dtype) not in (
            np.dtype(E4M3),
            np.dtype(jnp.float8_e5m2),
        ):
            raise ValueError(
                f"A DelayedScaling recipe for `{argument}` is for per-tensor float8 "
                f"(mixed_float8); the policy computes in {np.dtype(policy.compute_dtype).name}, "
                "a block-scaled format with its own scales."
            )
        return scaling
    if not isinstance(scaling, str) or scaling not in SCALINGS:
        raise ValueError(
            f"Unknown `{argument}` {scaling!r}: expected 'tensorwise', 'rowwise', 'delayed', "
            "a jmp_policy.fp8.DelayedScaling recipe, or (under 'mixed_nvfp4') a "
            "jmp_policy.nvfp4.Recipe."
        )
    return scaling


__all__ = [
    "FP8_STATE",
    "STATEFUL",
    "fresh_state",
    "Sites",
    "checked_scaling",
    "delayed_dot_general",
    "is_state",
    "state_dot_general",
    "stateful",
    "split_states",
    "without_states",
    "written",
]
