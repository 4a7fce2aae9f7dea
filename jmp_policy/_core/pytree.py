"""How every state class of this library becomes a pytree.

`jax.tree_util.register_dataclass` rebuilds an object by calling its
constructor, and constructors validate what users give them
(`DynamicLossScale(True)` must raise). But JAX, Equinox, orbax and sharding
helpers rebuild states from trees of other things: `eqx.filter_jit` maps every
leaf to a bool, checkpointing code to `jax.ShapeDtypeStruct`, sharding code to
`PartitionSpec`, orbax to None. So states are registered from their dataclass
fields (leaves: fields without `static` metadata; configuration: the static
ones, as in `register_dataclass`) and rebuilt by setting the fields directly:
validation runs only where a user constructs an object. Every field is
derived from `dataclasses.fields`, so none can be dropped.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import numpy as np

C = TypeVar("C", bound=type)
T = TypeVar("T")


def leaf_names(cls: type) -> tuple[str, ...]:
    """The per-step (array) fields of a state class, in declaration order."""
    return tuple(f.name for f in dataclasses.fields(cls) if not f.metadata.get("static"))


def new_unchecked(cls: type, fields: dict[str, Any]) -> Any:
    """An instance of the frozen dataclass `cls` with `fields`, its constructor not run."""
    new = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(new, name, value)
    return new


def register_state(cls: C) -> C:
    """Registers the frozen dataclass `cls` as a pytree rebuilt without validation."""
    data = leaf_names(cls)
    meta = tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("static"))
    keys = tuple(jax.tree_util.GetAttrKey(name) for name in data)

    def flatten_with_keys(state: Any):
        return tuple((k, getattr(state, n)) for k, n in zip(keys, data, strict=True)), tuple(
            getattr(state, n) for n in meta
        )

    def flatten(state: Any):
        return tuple(getattr(state, n) for n in data), tuple(getattr(state, n) for n in meta)

    def unflatten(aux: tuple, children: Any) -> Any:
        fields = dict(zip(data, children, strict=True))
        fields.update(zip(meta, aux, strict=True))
        return new_unchecked(cls, fields)

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    return cls


def is_traced_leaf(x: Any) -> bool:
    """Whether a leaf is traced (an input of the program) or passed through as it is.

    Arrays (JAX and NumPy) and abstract arrays (`jax.ShapeDtypeStruct`) are
    traced; every other leaf stays the Python value it is, as `eqx.filter_jit`
    keeps it: an Equinox module's activation function, a name, and numbers
    (flags, sizes, a dropout rate) that a model may branch on
    (`if self.p == 0:`). Pass a number as an array to trace it.
    """
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic))


def split_traced(tree: Any) -> tuple[list[Any], Callable[[Sequence[Any]], Any]]:
    """The traced leaves of `tree`, and a function that puts new ones in their places."""
    leaves, treedef = jax.tree.flatten(tree)
    traced = [is_traced_leaf(x) for x in leaves]

    def rebuild(arrays: Sequence[Any]) -> Any:
        given = iter(arrays)
        full = [next(given) if t else x for x, t in zip(leaves, traced, strict=True)]
        return jax.tree.unflatten(treedef, full)

    return [x for x, t in zip(leaves, traced, strict=True) if t], rebuild


def signature(tree: Any) -> Any:
    """What decides a trace of a call: the structure, the traced leaves' shapes and
    dtypes, and the values of the other leaves (e.g. `train=False`)."""
    leaves, treedef = jax.tree.flatten(tree)
    described = []
    for leaf in leaves:
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            described.append((tuple(leaf.shape), str(leaf.dtype)))
        else:
            try:
                hash(leaf)
                described.append(leaf)
            except TypeError:
                described.append(type(leaf))
    return treedef, tuple(described)


def nnx_graphdefs(args: Sequence[Any]) -> dict[int, Any]:
    """`{position: nnx.GraphDef}` of the NNX modules among `args` (none without Flax)."""
    nnx = getattr(sys.modules.get("flax"), "nnx", None)  # never loads Flax
    if nnx is None:
        return {}
    return {i: nnx.graphdef(a) for i, a in enumerate(args) if isinstance(a, nnx.Module)}


def written_back(fun: Callable[..., Any], graphdefs: dict[int, Any]) -> Callable[..., Any]:
    """`fun` on the states of the NNX modules at `graphdefs`' positions (`nnx.split`), merged
    back inside: it returns `(fun's output, the modules' states as the call left them)`, for
    the caller to write back (`write_back`), as `nnx.jit` does: a module that writes a
    variable when called (BatchNorm's statistics, Dropout's RNG counts, a counter) keeps
    what it wrote."""
    from flax import nnx

    def stateful(*args: Any, **kwargs: Any) -> tuple[Any, tuple]:
        merged = [nnx.merge(graphdefs[i], a) if i in graphdefs else a for i, a in enumerate(args)]
        out = fun(*merged, **kwargs)
        return out, tuple(nnx.state(merged[i]) for i in sorted(graphdefs))

    return stateful


def write_back(args: Sequence[Any], graphdefs: dict[int, Any], states: Sequence[Any]) -> None:
    """Updates the NNX modules among `args` with the states `written_back` returned."""
    from flax import nnx

    for i, state in zip(sorted(graphdefs), states, strict=True):
        nnx.update(args[i], state)


def pure_nnx(args: tuple) -> tuple[tuple, Callable[[Sequence[Any]], tuple]]:
    """`args` with each NNX module replaced by its state (`nnx.split`, outside any trace),
    and a function that merges them back (`nnx.merge`, inside the trace): a module that
    writes a variable when called (BatchNorm's statistics, Dropout's RNG counts) cannot be
    called in a trace it was not split for (Flax's TraceContextError). Without Flax loaded,
    `args` as they are."""
    nnx = getattr(sys.modules.get("flax"), "nnx", None)  # never loads Flax
    if nnx is None or not any(isinstance(a, nnx.Module) for a in args):
        return args, tuple
    graphdefs, pure = {}, []
    for i, arg in enumerate(args):
        if isinstance(arg, nnx.Module):
            graphdefs[i], arg = nnx.split(arg)
        pure.append(arg)

    def merge(inner: Sequence[Any]) -> tuple:
        return tuple(
            nnx.merge(graphdefs[i], x) if i in graphdefs else x for i, x in enumerate(inner)
        )

    return tuple(pure), merge


def find_states(opt_state: Any, cls: type[T]) -> list[T]:
    """Every `cls` inside `opt_state`: a pytree of states (`optax.chain`, `MultiSteps`,
    `inject_hyperparams`, ...), a Flax `TrainState` or an `nnx.Optimizer`."""
    tree = optimizer_state_of(opt_state)
    return [
        x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, cls)) if isinstance(x, cls)
    ]


def optimizer_state_of(obj: Any) -> Any:
    # Without Flax loaded, `obj` cannot be an nnx.Optimizer: do not import it.
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(obj, nnx.Optimizer):
        # nnx wraps every leaf of the optax state in a Variable; unwrap them.
        from jmp_policy._core.compat import pure

        return pure(obj.opt_state)
    return obj


class ByEquality:
    """Values kept by key and found by `==`, never by hash: a key may hold a user's objects
    (an NNX graph definition's static attributes, such as a config holding a list) that need
    not be hashable. For the few programs a function has; a lookup compares each key."""

    def __init__(self) -> None:
        self._pairs: list[tuple[Any, Any]] = []

    def get(self, key: Any, make: Callable[[], Any]) -> Any:
        """The value kept for `key`, made by `make()` and kept the first time."""
        for known, value in self._pairs:
            if known == key:
                return value
        value = make()
        self._pairs.append((key, value))
        return value
