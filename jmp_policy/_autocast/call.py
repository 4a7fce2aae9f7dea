"""The function `autocast`, `cast_at_use` and `full_precision` return: one program traced
per input signature (`_program`), evaluated by the rules in a region (`_build`: a
`jax.checkpoint` that keeps only what `_autocast_evaluation.RESIDUAL` names; autocast's
inline where the caller stages it, the others and eager calls under `jit`:
`_inline_when_traced`), NNX modules' states written back, and float8 delayed scaling's states
taken in (`fp8_state=`, `init_fp8_state`)."""

from __future__ import annotations

import functools
import re
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy import nvfp4
from jmp_policy._autocast.evaluation import (
    _FLOAT32,
    REGION_POLICY,
    REGION_POLICY_KEEPING_TRANSCENDENTALS,
    _cast,
    _Evaluation,
)
from jmp_policy._autocast.ops import _CAST_AT_USE
from jmp_policy._autocast.programs import _eval_closed
from jmp_policy._core import jaxpr as _jaxpr
from jmp_policy._core import naming as _naming
from jmp_policy._core import rules as _rules
from jmp_policy._core.compat import is_staged
from jmp_policy._core.overrides import FULL_PRECISION_REGION
from jmp_policy._core.pytree import (
    ByEquality,
    is_traced_leaf,
    nnx_graphdefs,
    write_back,
    written_back,
)
from jmp_policy._fp8.state import Sites, stateful
from jmp_policy.fp8 import DelayedScaling


class _Autocast:
    """The function `autocast` returns; caches one program per input signature."""

    def __init__(self, fun, rules, static_argnums, static_argnames, cast_inputs, region_name):
        functools.update_wrapper(self, fun)
        self._fun = fun
        self._rules = rules
        self._static_argnums = static_argnums
        self._static_argnames = static_argnames
        self._cast_inputs = cast_inputs
        self._region_name = region_name
        self._programs = ByEquality()  # a signature holds NNX graph definitions

    @property
    def _recipe(self) -> DelayedScaling | nvfp4.Recipe | None:
        fp8 = self._rules.fp8
        return None if fp8 is None else stateful(fp8[0])

    def init_fp8_state(self, *args, **kwargs) -> tuple:
        """The state of this call's float8 or NVFP4 matmuls (an autocast function with a
        `DelayedScaling` or `nvfp4.Recipe` recipe): a tuple, one `Fp8DotState` (`nvfp4.State`)
        per matmul in the order the program runs them (a `scan`'s: one tuple, stacked over its
        steps). Pass it as `fp8_state=` and differentiate with respect to it; a `loss_scaling`
        optimizer writes the next state from its gradient, unless it skips the step
        (docs/fp8.md)."""
        recipe = self._recipe
        if recipe is None:
            raise ValueError(
                "init_fp8_state is for an autocast function under a float8 policy with a "
                "DelayedScaling recipe (`fp8_scaling=jmp_policy.fp8.DelayedScaling(...)`), or "
                "under 'mixed_nvfp4' with `fp8_scaling=jmp_policy.nvfp4.Recipe()`; this one "
                "has no state."
            )
        graphdefs = nnx_graphdefs(args)
        if graphdefs:
            args = _states_of(args, graphdefs)
        arrays, (_, _, closed) = self._program(args, kwargs, graphdefs or None)
        sites = Sites(recipe)

        def run(*flat):
            ev = _Evaluation(self._rules, sites=sites)
            try:
                _eval_closed(closed, list(flat), ev)
            finally:
                ev.close()

        jax.eval_shape(run, *arrays)
        return sites.build()

    def _program(self, args, kwargs, graphdefs=None, fp8_state=None):
        """`(traced leaves, (region, out_tree, closed jaxpr))` of a call; with `graphdefs`
        (`_pytree.nnx_graphdefs`), of `fun` on those NNX modules' states, also returning
        their states as the call left them."""
        static_args = tuple((i, args[i]) for i in self._static_argnums if i < len(args))
        static_kwargs = tuple(sorted((k, kwargs[k]) for k in self._static_argnames if k in kwargs))
        dyn_args = [a for i, a in enumerate(args) if i not in self._static_argnums]
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self._static_argnames}
        flat, in_tree = jax.tree.flatten((dyn_args, dyn_kwargs))
        # Leaves that are not arrays (an Equinox module's activation function,
        # a bool flag, a name) are passed to `fun` as they are, like
        # `eqx.filter_jit` does: they are part of the program, not its inputs.
        traced = tuple(is_traced_leaf(x) for x in flat)
        specs = tuple(
            jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.result_type(x), weak_type=_weak(x))
            if is_traced
            else _StaticLeaf(x)
            for x, is_traced in zip(flat, traced, strict=True)
        )
        arrays = [x for x, is_traced in zip(flat, traced, strict=True) if is_traced]
        # Inside `shard_map`, which mesh axes each input varies over is part of its type: the
        # program is traced on the inputs' types (with it), so the `pvary`s JAX inserts for
        # constants meeting varying values are in it.
        varying = tuple(getattr(jax.typeof(x), "vma", None) for x in arrays)
        # Traced again while the debugger names NNX/Equinox modules (`_naming`): a program
        # built before has no module paths in its name stacks.
        nnx_key = None if graphdefs is None else tuple(graphdefs.items())
        # Float8 delayed scaling: the matmuls' states go in after the arrays.
        state_leaves, state_tree = jax.tree.flatten(fp8_state)
        state_key = tuple((np.shape(x), jnp.result_type(x)) for x in state_leaves)
        key = (in_tree, specs, varying, static_args, static_kwargs, _naming.active(), nnx_key)
        key = (*key, fp8_state is None, state_tree, state_key)

        def build():
            fun = self._fun if graphdefs is None else written_back(self._fun, graphdefs)
            return self._build(
                fun, in_tree, specs, arrays, dict(static_args), dict(static_kwargs), len(args),
                None if fp8_state is None else state_tree,
            )  # fmt: skip

        program = self._programs.get(key, build)
        return [*arrays, *state_leaves], program

    def _build(
        self, fun, in_tree, specs, arrays, static_args, static_kwargs, n_args, state_tree=None
    ):
        def flat_fun(*arrays):
            given = iter(arrays)
            flat = [next(given) if isinstance(s, jax.ShapeDtypeStruct) else s.value for s in specs]
            dyn_args, dyn_kwargs = jax.tree.unflatten(in_tree, flat)
            dyn = iter(dyn_args)
            full = [static_args[i] if i in static_args else next(dyn) for i in range(n_args)]
            return fun(*full, **dyn_kwargs, **static_kwargs)

        _BUILDING.depth += 1
        try:
            closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*arrays)
        finally:
            _BUILDING.depth -= 1
        out_tree = jax.tree.structure(out_shape)
        rules, cast_inputs = self._rules, self._cast_inputs
        # `cast_at_use` (its weights in float32): the traced leaves of the first argument are
        # the weights; NVFP4's recipe tells a layer's weight from a float32 input by them
        # (`ops._weight_side`).
        n_weights = 0
        recipe = self._recipe
        weights_named = (rules.at_use and rules.reduce) or isinstance(recipe, nvfp4.Recipe)
        if weights_named and in_tree.children()[0].children():
            first = in_tree.children()[0].children()[0].num_leaves
            n_weights = sum(isinstance(s, jax.ShapeDtypeStruct) for s in specs[:first])

        # In half precision the region keeps for the backward pass only what `RESIDUAL`
        # names (its matmuls' operands and outputs, ...): its float32 islands are computed
        # again from them, as the Linen policy's are.
        checkpointed = not rules.at_use and rules.compute != _FLOAT32
        # And its half-precision transcendentals' outputs, unless a checkpoint of the user's
        # is inside: JAX would apply the region's policy inside it too.
        transcendentals = checkpointed and not any(
            eqn.primitive is _jaxpr.REMAT for eqn, _ in _jaxpr.walk(closed)
        )

        n_state = 0 if state_tree is None else state_tree.num_leaves
        # Under a float8 policy, where each input sits in the arguments (`model.out.weight`):
        # what names a matmul outside any name scope (an Equinox layer's) in a warning.
        input_names = []
        if rules.fp8:
            placed = jax.tree_util.tree_flatten_with_path(
                jax.tree.unflatten(in_tree, list(specs)),
                is_leaf=lambda x: isinstance(x, _StaticLeaf),
            )[0]
            input_names = [
                _argument_name(path) for path, s in placed if isinstance(s, jax.ShapeDtypeStruct)
            ]

        def region(*flat):
            flat, state = flat[: len(flat) - n_state], flat[len(flat) - n_state :]
            if cast_inputs:
                flat = [_cast(x, rules.compute) for x in flat]
            sites = None
            if state_tree is not None and recipe is not None:
                sites = Sites(recipe, jax.tree.unflatten(state_tree, state))
            keeps = _rules.kept_for_backward if checkpointed else None
            ev = _Evaluation(rules, keeps=keeps, sites=sites, transcendentals=transcendentals)
            for weight in flat[:n_weights]:
                ev.add_weight(weight)
            ev.name_inputs(flat[: len(input_names)], input_names)
            try:
                outs = _eval_closed(closed, list(flat), ev)
            finally:
                ev.close()
            if sites is not None:
                sites.check_used()
            if rules.at_use:
                return outs  # the output dtypes as traced
            return [_cast(o, rules.output) for o in outs]

        region.__name__ = region.__qualname__ = self._region_name
        if checkpointed:
            # prevent_cse stays True: without it XLA merges the recomputation with the
            # forward pass and keeps what was to be recomputed (compiled temp bytes of the
            # Equinox example 40.8 -> 48.0 MiB, the GPT loop 41.5 -> 48.7 MiB on XLA:CPU).
            policy = REGION_POLICY_KEEPING_TRANSCENDENTALS if transcendentals else REGION_POLICY
            region = jax.checkpoint(region, policy=policy)
        # A `full_precision` region is found by its name; a `cast_at_use` region (the Linen
        # and NNX policies) compiles slower inline on XLA:CPU (the Linen GPT's bfloat16
        # gradient step: 57 ms against 43-47 ms as a nested jit, float16 the same).
        keep_jit = self._region_name in (FULL_PRECISION_REGION, _CAST_AT_USE)
        return _inline_when_traced(region, keep_jit), out_tree, closed

    def __call__(self, *args, **kwargs):
        state = None
        if self._recipe is not None:
            state = kwargs.pop("fp8_state", None)
            if not isinstance(state, tuple):
                raise ValueError(
                    "Expected the state of this autocast function's float8 (NVFP4) "
                    f"matmuls for `fp8_state`, got {type(state).__name__}: make it with "
                    "`state = f.init_fp8_state(*args)`, call `f(*args, fp8_state=state)` and "
                    "differentiate with respect to it (docs/fp8.md)."
                )
        graphdefs = nnx_graphdefs(args)
        if not graphdefs:
            flat, (region, out_tree, _) = self._program(args, kwargs, fp8_state=state)
            return jax.tree.unflatten(out_tree, region(*flat))
        # NNX modules go in as their states and come back written (BatchNorm's statistics,
        # Dropout's RNG counts), as under `nnx.jit`.
        pure = _states_of(args, graphdefs)
        flat, (region, out_tree, _) = self._program(pure, kwargs, graphdefs, state)
        out, states = jax.tree.unflatten(out_tree, region(*flat))
        write_back(args, graphdefs, states)
        return out

    def traced_program(self, *args, **kwargs):
        """The program as traced, before casts (for reports and debugging)."""
        return self._program(args, kwargs)[1][2]


class _StaticLeaf:
    """A leaf passed through untouched: compared by value where it can be, else by identity
    (`is`: an unhashable leaf hashes by its type alone, no table of `id()`s)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def _hashable(self) -> bool:
        try:
            hash(self.value)
        except TypeError:
            return False
        return True

    def __hash__(self) -> int:
        value = self.value
        return hash((type(value), value) if self._hashable() else type(value))

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, _StaticLeaf) or type(self.value) is not type(other.value):
            return False
        if self._hashable() and other._hashable():
            return bool(self.value == other.value)
        return self.value is other.value


def _weak(x: Any) -> bool:
    return bool(
        getattr(x, "weak_type", isinstance(x, (int, float, complex)) and not isinstance(x, bool))
    )


class _Building(threading.local):
    """How many autocast programs this thread is tracing (`_Autocast._build`): an autocast
    function called while another one traces stays one `jit` named by its region, which the
    outer program leaves as it is (`programs._eval_call`)."""

    depth = 0


_BUILDING = _Building()


def _inline_when_traced(region, keep_jit: bool):
    """`region` run inline where its inputs are staged into a program (inside the caller's
    `jit` or `scan`, under any `grad` or `vmap`: its equations join the caller's program), and
    compiled (`jax.jit`) where they are not (an eager call, an eager `jax.grad`, whose
    operations would otherwise run one by one), or where it stays a `jit` of its own
    (`keep_jit`), and in any region traced inside another autocast program, which leaves it
    as it is by its name. A `jit` nested in the caller's trace costs a second linearization:
    `jax.grad` of a program holding one linearizes its body again to transpose it (a 12-block
    GPT's first `value_and_grad` trace: 2.1 s of 6.8 s profiled, JAX 0.10)."""
    compiled = jax.jit(region)

    @functools.wraps(region)
    def run(*flat):
        if any(map(is_staged, flat)) and not keep_jit and not _BUILDING.depth:
            return region(*flat)
        return compiled(*flat)

    return run


def _states_of(args: tuple, graphdefs: dict) -> tuple:
    """`args` with each NNX module (at the positions `graphdefs` holds) replaced by its state."""
    from flax import nnx

    return tuple(nnx.state(a) if i in graphdefs else a for i, a in enumerate(args))


def _argument_name(path: tuple) -> str:
    """An input's place in the arguments as attributes and indices (`model.out.weight`), the
    argument list's own indices left out."""
    return re.sub(r"^(\[\d+\])+\.?", "", jax.tree_util.keystr(path))
