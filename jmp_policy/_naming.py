"""Module paths in name stacks for NNX and Equinox models, while a program is traced.

Linen modules put their paths in every operation's name stack; NNX modules and Equinox modules
do not (unless `nnx.mixed_precision` scoped them). Inside `module_names()`, every call of an
NNX or Equinox module runs in a `jax.named_scope` of its path: the outermost module called is a
root, named by its class (as Linen names its root), and every module inside it by its attribute
or field path relative to it (`Transformer/layers/0/attn`). A module rebuilt inside a
transform (a scan or vmap body) is a root of its own, inside its caller's scope.

Calls are intercepted by replacing `__call__` on the module classes for the duration of the
trace (and only then; other threads' calls pass straight through); the debugger uses it,
nothing in a train step does.
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading
from collections.abc import Iterator
from typing import Any

import jax

_STATE = threading.local()
_UNSAFE = re.compile(r"[^\w.\-]")


def active() -> bool:
    """Whether module calls are being named (part of autocast's program cache key)."""
    return getattr(_STATE, "paths", None) is not None


def _bases() -> list[type]:
    """The module base classes of the libraries already imported (nothing is imported here)."""
    bases = []
    if "flax.nnx" in sys.modules:
        bases.append(sys.modules["flax.nnx"].Module)
    if "equinox" in sys.modules:
        bases.append(sys.modules["equinox"].Module)
    return bases


def _classes_with_call(base: type) -> set[type]:
    found, todo = set(), [base]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    # This library's own classes (`nnx.mixed_precision`'s scoped subclasses, which open their
    # own scopes; `jmp_policy.eqx.MixedPrecision`, a wrapper) and private ones are not the
    # user's modules.
    return {
        c
        for c in found
        if "__call__" in vars(c)
        and "_jmp_policy_base" not in vars(c)
        and not c.__module__.startswith("jmp_policy")
        and not c.__name__.startswith("_")  # private wrappers (Equinox's `_VmapWrapper`)
        # Equinox's own machinery (a bound method is a module); its layers are `equinox.nn`'s.
        and not (c.__module__.startswith("equinox.") and not c.__module__.startswith("equinox.nn"))
    }


def _is_module(x: Any) -> bool:
    return any(isinstance(x, base) for base in _bases())


def _key_name(key: Any) -> str:
    for attribute in ("name", "idx", "key"):
        if hasattr(key, attribute):
            return _UNSAFE.sub("_", str(getattr(key, attribute)))
    return _UNSAFE.sub("_", str(key))


def _submodules(root: Any) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(path relative to `root`, module) for every module inside `root`."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(root, nnx.Module):
        for path, node in nnx.iter_graph(root):
            if path and isinstance(node, nnx.Module):
                yield tuple(_UNSAFE.sub("_", str(p)) for p in path), node
        return
    # Equinox (any pytree): the modules directly below, then theirs.
    below = jax.tree_util.tree_flatten_with_path(
        root, is_leaf=lambda x: x is not root and _is_module(x)
    )[0]
    for key_path, leaf in below:
        if _is_module(leaf):
            path = tuple(_key_name(k) for k in key_path)
            yield path, leaf
            for sub_path, sub in _submodules(leaf):
                yield path + sub_path, sub


def _named(original: Any) -> Any:
    def __call__(self, *args, **kwargs):
        call = original.__get__(self, type(self))
        if not active():  # another thread, tracing while the classes are patched
            return call(*args, **kwargs)
        stack = _STATE.stack
        if stack and stack[-1][0] is self:  # super().__call__: already in its scope
            return call(*args, **kwargs)
        if hasattr(self, "_jmp_policy_scope") and not hasattr(self, "_jmp_policy_root"):
            return call(*args, **kwargs)  # scoped by `nnx.mixed_precision` already
        known = _STATE.paths.get(id(self))
        if known is None:  # a root: its class names it, its submodules get paths below it
            outer = stack[-1][1] if stack else ()
            path = (*outer, _UNSAFE.sub("_", type(self).__name__))
            _STATE.paths[id(self)] = (self, path)
            for sub_path, sub in _submodules(self):
                _STATE.paths.setdefault(id(sub), (sub, path + sub_path))
        else:
            path = known[1]
        outer = stack[-1][1] if stack else ()
        scope = path[len(outer) :] if path[: len(outer)] == outer else path
        stack.append((self, path))
        try:
            with contextlib.ExitStack() as scopes:
                for name in scope:
                    scopes.enter_context(jax.named_scope(name))
                return call(*args, **kwargs)
        finally:
            stack.pop()

    return __call__


@contextlib.contextmanager
def module_names() -> Iterator[None]:
    """Within: NNX and Equinox module calls run in a name scope of their module path."""
    if active():
        yield
        return
    patched = {cls: vars(cls)["__call__"] for base in _bases() for cls in _classes_with_call(base)}
    _STATE.paths, _STATE.stack = {}, []
    try:
        for cls, original in patched.items():
            type.__setattr__(cls, "__call__", _named(original))
        yield
    finally:
        for cls, original in patched.items():
            type.__setattr__(cls, "__call__", original)
        _STATE.paths = _STATE.stack = None
