"""Per-class and per-path policy overrides, shared by the Linen and NNX integrations.

An override maps a module class (matched with `isinstance`), a glob pattern on
the module's path (`fnmatch`, parts joined with "/", e.g. "*/head") or a
compiled regular expression (`re.fullmatch` on the same string) to a `Policy`.
The innermost module that matches decides; modules inside it inherit its
policy. A path match beats a class match on the same module.
"""

from __future__ import annotations

import contextlib
import fnmatch
import re
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy.policy import Policy, check_policy, get_policy

FLOAT32 = get_policy("float32")

FLOAT32_ISLAND = "jmp_float32_override"
"""The name scope around a module that an override keeps in float32.

`precision_report` and the integrations' float32 check read it from each
operation's name stack to tell a float32 matmul the user asked for from one
that slipped through; reports show module paths without it.
"""

FULL_PRECISION_REGION = "jmp_full_precision_region"
"""The name of the call around `autocast.full_precision`'s function (its float32 region)."""


def island_scope(own: Policy | None, compute: np.dtype) -> contextlib.AbstractContextManager:
    """The scope to run a module in: `FLOAT32_ISLAND` if its own override computes in float32."""
    if own is not None and compute == jnp.float32:
        return jax.named_scope(FLOAT32_ISLAND)
    return contextlib.nullcontext()


def is_compute_dtype(value: Any) -> bool:
    """Whether a module's `dtype` value is a computation dtype the policy decides.

    True for floating dtypes and None (Flax: inferred from the inputs); False for
    integer and bool dtypes (an index or mask dtype) and anything that is not a dtype.
    """
    if value is None:
        return True
    try:
        return bool(jnp.issubdtype(jnp.dtype(value), jnp.floating))
    except TypeError:
        return False


_SHOWN = 4  # module paths the unmatched-pattern warning shows


class Overrides:
    """Validated overrides with matching; tracks which patterns matched."""

    def __init__(self, overrides: Any, module_base: type, argument: str = "overrides"):
        if not isinstance(overrides, Mapping):
            raise TypeError(
                f"Expected a mapping {{module class or path pattern: Policy}} for `{argument}`, "
                f"got {type(overrides).__name__}."
            )
        self.classes: list[tuple[type, Policy]] = []
        self.patterns: list[tuple[Any, Policy]] = []
        for key, given in overrides.items():
            policy = check_policy(given, f"{argument}[{key!r}]")
            if isinstance(key, type) and issubclass(key, module_base):
                self.classes.append((key, policy))
            elif isinstance(key, (str, re.Pattern)):
                self.patterns.append((key, policy))
            else:
                raise TypeError(
                    f"Expected a {module_base.__module__}.{module_base.__name__} subclass, a glob "
                    f"pattern string or a compiled regex as a key of `{argument}`, got {key!r}."
                )
        self.matched: set[Any] = set()
        self.paths: list[str] = []  # the model's module paths seen, for the warning
        self.root: str | None = None  # the root module's class name

    def own_policy(self, path: tuple[str, ...], module: Any) -> Policy | None:
        """The policy this module is overridden with, or None to inherit.

        A pattern matches the module path (`encoder/norm`); one that starts with the root
        module's class name, as the precision debugger prints layers
        (`Transformer/encoder/norm`), matches the path after it.
        """
        text = "/".join(str(p) for p in path)
        if not path:
            self.root = type(module).__name__
        elif len(self.paths) < _SHOWN and text not in self.paths:
            self.paths.append(text)
        for key, policy in self.patterns:
            if isinstance(key, re.Pattern):
                hit = key.fullmatch(text)
            else:
                prefix = f"{self.root}/" if self.root else ""
                hit = fnmatch.fnmatchcase(text, key) or (
                    bool(prefix)
                    and key.startswith(prefix)
                    and fnmatch.fnmatchcase(text, key[len(prefix) :])
                )
            if hit:
                self.matched.add(key)
                return policy
        for cls, policy in self.classes:
            if isinstance(module, cls):
                return policy
        return None

    def warn_unmatched(self) -> None:
        for key, _ in self.patterns:
            if key not in self.matched:
                shown = key.pattern if isinstance(key, re.Pattern) else key
                examples = ", ".join(repr(p) for p in self.paths) or "'Encoder_0/Dense_1'"
                warnings.warn(
                    f"The override pattern {shown!r} matches no module path; this model's "
                    f"paths look like {examples} (parts joined with '/').",
                    UserWarning,
                    stacklevel=4,
                )
                self.matched.add(key)  # warn once
