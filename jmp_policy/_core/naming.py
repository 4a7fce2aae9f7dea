"""Module paths in name stacks for NNX and Equinox models, while a program is traced.

Linen modules put their paths in every operation's name stack; NNX modules and Equinox modules
do not (unless `nnx.mixed_precision`'s wrapper scoped them). Inside `module_names()`, every call
of an NNX or Equinox module runs in a `jax.named_scope` of its path: the outermost module called
is a root, named by its class (as Linen names its root), and every module inside it by its
attribute or field path relative to it (`Transformer/layers/0/attn`). A module rebuilt inside a
transform (a scan or vmap body, e.g. `nnx.scan` over layers `nnx.vmap` made) is named by the
path of the one module of its class below its caller, the one it was rebuilt from (the path
`overrides` take); where there is no such single module, it is a root of its own, inside its
caller's scope.

Calls are seen by the calling thread's profile function (`sys.setprofile`, per thread) for
the duration of the trace, and only then: no class is changed, and other threads' calls run as
they are (`test_other_threads_call_modules_as_they_are_while_the_debugger_names_them`,
tests/test_threads.py). The debugger and `precision_report` use it, nothing in a train step
does. Scoped subclasses given to the instances instead (as `nnx.mixed_precision`'s wrapper gives
its own copy of a model's modules) would name only the modules among the arguments: not those
NNX's functional pattern builds inside the function (`nnx.merge(graphdef, state)` with the graph
definition closed over, the State the argument:
`test_nnx_layers_are_named_by_attribute_path[split-merge]`), nor a model the function closes
over. Every call passes through the thread's profile function. Modules are recognised by
identity (a list of the ones met, searched with `is`), not by a table of their `id()`s.

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
SCOPED_FROM = "_jmp_policy_scoped_from"
"""The class attribute (naming the user's class) of the classes `nnx.mixed_precision`'s wrapper
gives its own copy of a model's modules for a call: their calls open their own scopes."""


def active() -> bool:
    """Whether module calls are being named (part of autocast's program cache key)."""
    return getattr(_STATE, "known", None) is not None


def _bases() -> list[type]:
    """The module base classes of the libraries already imported (nothing is imported here)."""
    bases = []
    if "flax.nnx" in sys.modules:
        bases.append(sys.modules["flax.nnx"].Module)
    if "equinox" in sys.modules:
        bases.append(sys.modules["equinox"].Module)
    return bases


def _users_call(code: Any, module_name: str, module: Any) -> bool:
    """Whether a `__call__`'s code is a user's module's: not this library's own classes
    (`nnx.mixed_precision`'s scoped subclasses, which open their own scopes;
    `jmp_policy.eqx.MixedPrecision`, a wrapper), not the libraries' private wrappers
    (Equinox's `_VmapWrapper`; a user's private module is a module), nor Equinox's own
    machinery (a bound method is a module; its layers are `equinox.nn`'s)."""
    if module_name.startswith("jmp_policy"):
        return False
    qualname = getattr(code, "co_qualname", None)  # Python 3.11+; 3.10: the module's class
    if qualname is None:
        owner = type(module).__name__
    else:
        owner = qualname.rsplit(".", 2)[-2] if "." in qualname else ""
    if owner.startswith("_") and module_name.split(".")[0] in _LIBRARIES:
        return False
    return not (module_name.startswith("equinox.") and not module_name.startswith("equinox.nn"))


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


class _Entered:
    """A module call this thread is in: the module, its path, the frame of its `__call__`,
    and the name scopes it opened."""

    __slots__ = ("frame", "module", "path", "scopes")

    def __init__(self, module: Any, path: tuple[str, ...], frame: Any):
        self.module, self.path, self.frame = module, path, frame
        self.scopes = contextlib.ExitStack()


def _known_path(module: Any) -> tuple[str, ...] | None:
    return next((path for known, path in _STATE.known if known is module), None)


def _entering(frame: Any) -> None:
    """A `__call__` starts in this thread: if it is a module's, its call runs in the name
    scopes of its path (below the module calling it)."""
    code = frame.f_code
    if not code.co_argcount:
        return
    module = frame.f_locals.get(code.co_varnames[0])
    if not _is_module(module) or not _users_call(code, frame.f_globals.get("__name__", ""), module):
        return
    stack = _STATE.stack
    if stack and stack[-1].module is module:  # super().__call__: already in its scope
        return
    if SCOPED_FROM in vars(type(module)):
        return  # the copy `nnx.mixed_precision`'s wrapper runs: it opens its own scopes
    outer = stack[-1].path if stack else ()
    path = _known_path(module)
    if path is None:
        # A module rebuilt inside a transform (`nnx.scan` over layers `nnx.vmap` made)
        # stands for the one module of its class below its caller; else it is a root:
        # its class names it. Its submodules get paths below it.
        path = _stands_for(module, outer) or (*outer, _UNSAFE.sub("_", type(module).__name__))
        _STATE.known.append((module, path))
        for sub_path, sub in _submodules(module):
            if _known_path(sub) is None:
                _STATE.known.append((sub, path + sub_path))
    entered = _Entered(module, path, frame)
    for name in path[len(outer) :] if path[: len(outer)] == outer else path:
        entered.scopes.enter_context(jax.named_scope(name))
    stack.append(entered)


def _profile(event_frame: Any, event: str, arg: Any) -> None:
    """This thread's profile function while it names modules: Python calls and returns."""
    if event == "call":
        if event_frame.f_code.co_name == "__call__":
            _entering(event_frame)
    elif event == "return":
        stack = _STATE.stack
        if stack and stack[-1].frame is event_frame:  # returned, or raised out of
            stack.pop().scopes.close()


def _stands_for(module: Any, outer: tuple[str, ...]) -> tuple[str, ...] | None:
    """The path of the one known module of `module`'s class below the caller's path `outer`
    (a transform rebuilt `module` from it); None if there is none, or more than one."""
    if not outer:
        return None
    found = {
        path
        for known, path in _STATE.known
        if type(known) is type(module) and known is not module and path[: len(outer)] == outer
    }
    return found.pop() if len(found) == 1 else None


@contextlib.contextmanager
def module_names() -> Iterator[None]:
    """Within: NNX and Equinox module calls run in a name scope of their module path, in the
    calling thread only: its profile function (`sys.setprofile`, which is per thread) sees
    each module's `__call__` begin and end; no class is changed, and other threads' calls
    run as they are. A profile function the thread had before (a profiler's) is put back
    after, and is paused within."""
    if active():
        yield
        return
    before = sys.getprofile()
    _STATE.known, _STATE.stack = [], []
    sys.setprofile(_profile)
    try:
        yield
    finally:
        _put_back(before)
        while _STATE.stack:  # left by an exception raised through the context
            _STATE.stack.pop().scopes.close()
        _STATE.known = _STATE.stack = None


def _put_back(before: Any) -> None:
    """The thread's profile function as it was: a Python function (or None) by
    `sys.setprofile`; a C profiler's object (cProfile's on Python 3.10 and 3.11, which
    `sys.getprofile` returns and `sys.setprofile` cannot take) by its own `enable()`, which
    installs its callback again and keeps what it measured."""
    if before is None or callable(before):
        sys.setprofile(before)
    else:
        before.enable()


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
