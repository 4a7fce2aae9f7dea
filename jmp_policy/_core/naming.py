"""Module paths in name stacks for NNX and Equinox models, while a program is traced.

Linen modules put their paths in every operation's name stack; NNX modules and Equinox modules
do not (unless `nnx.mixed_precision` scoped them). Inside `module_names()`, every call of an
NNX or Equinox module runs in a `jax.named_scope` of its path: the outermost module called is a
root, named by its class (as Linen names its root), and every module inside it by its attribute
or field path relative to it (`Transformer/layers/0/attn`). A module rebuilt inside a
transform (a scan or vmap body, e.g. `nnx.scan` over layers `nnx.vmap` made) is named by the
path of the one module of its class below its caller, the one it was rebuilt from (the path
`overrides` take); where there is no such single module, it is a root of its own, inside its
caller's scope.

Calls are intercepted by replacing `__call__` on the module classes for the duration of the
trace (and only then; other threads' calls pass straight through:
`test_other_threads_call_modules_as_they_are_while_the_debugger_names_them`); the debugger and
`precision_report` use it, nothing in a train step does. Scoped subclasses given to the
instances instead (as `nnx.mixed_precision` does for good) would name only the modules among the
arguments: not those NNX's functional pattern builds inside the function
(`nnx.merge(graphdef, state)` with the graph definition closed over, the State the argument:
`test_nnx_layers_are_named_by_attribute_path[split-merge]`), nor a model the function closes
over. The classes are the one place every instance passes through.

`module_path` reads the module path a name stack names (Linen's, or these scopes), as the
integrations' `overrides` take it, and `relative` drops the root's own name.
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import jax

_STATE = threading.local()
_UNSAFE = re.compile(r"[^\w.\-]")
_LIBRARIES = ("equinox", "flax")


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
        # Private wrappers of the libraries (Equinox's `_VmapWrapper`); a user's private
        # module is a module.
        and not (c.__name__.startswith("_") and c.__module__.split(".")[0] in _LIBRARIES)
        # Equinox's own machinery (a bound method is a module); its layers are `equinox.nn`'s.
        and not (c.__module__.startswith("equinox.") and not c.__module__.startswith("equinox.nn"))
    }


def _is_module(x: Any) -> bool:
    return any(isinstance(x, base) for base in _bases())


def key_name(key: Any) -> str:
    for attribute in ("name", "idx", "key"):
        if hasattr(key, attribute):
            return _UNSAFE.sub("_", str(getattr(key, attribute)))
    return _UNSAFE.sub("_", str(key))


def _is_wrapper(x: Any) -> bool:
    """This library's wrappers of a model (`jmp_policy.eqx`'s): not modules of a path."""
    return type(x).__module__.startswith("jmp_policy") and hasattr(x, "model")


def module_tree(root: Any) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """(key path relative to `root`, module) for every Equinox module inside `root` (any
    pytree), outer modules first; a module this library wraps stands at its wrapper's path."""
    below = jax.tree_util.tree_flatten_with_path(
        root, is_leaf=lambda x: x is not root and _is_module(x)
    )[0]
    for key_path, leaf in below:
        if _is_module(leaf):
            yield tuple(key_path), leaf
            inner = leaf.model if _is_wrapper(leaf) else leaf
            if inner is not leaf:
                yield tuple(key_path), inner
            for sub_keys, sub in module_tree(inner):
                yield tuple(key_path) + sub_keys, sub


def _submodules(root: Any) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(path relative to `root`, module) for every module inside `root`."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(root, nnx.Module):
        for path, node in nnx.iter_graph(root):
            if path and isinstance(node, nnx.Module):
                yield tuple(_UNSAFE.sub("_", str(p)) for p in path), node
        return
    for keys, module in module_tree(root):  # Equinox (any pytree)
        yield tuple(key_name(k) for k in keys), module


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
        if known is None:
            # A module rebuilt inside a transform (`nnx.scan` over layers `nnx.vmap` made)
            # stands for the one module of its class below its caller; else it is a root:
            # its class names it. Its submodules get paths below it.
            outer = stack[-1][1] if stack else ()
            path = _stands_for(self, outer) or (*outer, _UNSAFE.sub("_", type(self).__name__))
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


def _stands_for(module: Any, outer: tuple[str, ...]) -> tuple[str, ...] | None:
    """The path of the one known module of `module`'s class below the caller's path `outer`
    (a transform rebuilt `module` from it); None if there is none, or more than one."""
    if not outer:
        return None
    found = {
        path
        for known, path in _STATE.paths.values()
        if type(known) is type(module) and known is not module and path[: len(outer)] == outer
    }
    return found.pop() if len(found) == 1 else None


class _Patches:
    """The classes' own `__call__`s while any thread names modules: patched when the first
    thread enters `module_names`, restored when the last one leaves, under one lock (threads
    that entered on their own each recorded the other's wrapper as the original, and the last
    to leave restored a wrapper)."""

    lock = threading.Lock()
    originals: dict[type, Any] = {}
    users = 0


@contextlib.contextmanager
def module_names() -> Iterator[None]:
    """Within: NNX and Equinox module calls run in a name scope of their module path (in the
    calling thread; other threads' calls pass through)."""
    if active():
        yield
        return
    with _Patches.lock:
        if _Patches.users == 0:
            _Patches.originals = {
                cls: vars(cls)["__call__"] for base in _bases() for cls in _classes_with_call(base)
            }
            for cls, original in _Patches.originals.items():
                type.__setattr__(cls, "__call__", _named(original))
        _Patches.users += 1
    _STATE.paths, _STATE.stack = {}, []
    try:
        yield
    finally:
        _STATE.paths = _STATE.stack = None
        with _Patches.lock:
            _Patches.users -= 1
            if _Patches.users == 0:
                for cls, original in _Patches.originals.items():
                    type.__setattr__(cls, "__call__", original)
                _Patches.originals = {}


# --- module paths from name stacks ---------------------------------------------------

TOP_LEVEL = "(top level)"
_TRANSFORMS = re.compile(r"^(?:[a-z_]+\()+")  # transpose(, jvp(, vmap(: transforms, not modules
# A module's name (or an NNX list index). Parts with a dot are not modules: Linen names a
# method called from another one `Class.method` (`Transformer.encode`), Equinox its class scopes.
_PART = re.compile(r"[A-Za-z_][\w\-]*|\d+")
_METHOD = re.compile(r"([A-Za-z_]\w*)\.[A-Za-z_]\w*")


def module_path(name_stack: str, markers: Sequence[str] = ()) -> str:
    """The modules a name stack names, joined with "/" (`TOP_LEVEL` if none): transforms
    (`jvp(`, `transpose(`), `markers` (region and island scopes), Linen method calls
    (`Transformer.encode`; first, the root called through a method, it names the root:
    `Transformer`), Equinox's class scopes (`eqx.nn.Linear`) and anything that is not a name
    (einsum specs, op names) left out; NNX list indices (`layers/0`) kept. The first part is
    the root module's name; `overrides` take the rest (`relative`)."""
    parts = []
    for part in name_stack.split("/"):
        part = _TRANSFORMS.sub("", part).rstrip(")")
        method = _METHOD.fullmatch(part)
        if method and not parts:  # the root called through a method: `apply(method=...)`
            parts.append(method.group(1))
        elif part and part not in markers and _PART.fullmatch(part):
            parts.append(part)
    return "/".join(parts) or TOP_LEVEL


def relative(path: str) -> str:
    """A `module_path` without the root module's own name: what `overrides` match."""
    parts = path.split("/")
    return "/".join(parts[1:]) if len(parts) > 1 else path
