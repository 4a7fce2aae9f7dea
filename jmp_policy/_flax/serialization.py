"""Flax serialization (`flax.serialization.to_bytes`, `to_state_dict`) of every state class.

Registering needs `flax.serialization`, and importing it loads Flax, which jmp and optax users do
not need. So the classes are registered when Flax is first imported, whether that happens before or
after `jmp_policy` (a post-import hook), and `import jmp_policy` never loads Flax itself.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, TypeVar

import wrapt

T = TypeVar("T")


def _register(serialization: ModuleType) -> None:
    from jmp_policy._core.pytree import leaf_names
    from jmp_policy._loss_scaling.leaf_flags import LeafFlags
    from jmp_policy._loss_scaling.loss_scale import (
        DynamicLossScale,
        NoOpLossScale,
        StaticLossScale,
        rebuild,
    )
    from jmp_policy._reports.debugger import PrecisionStats
    from jmp_policy.fp8 import Fp8DotState, Fp8Meta

    def to_state_dict(state: Any) -> dict[str, Any]:
        return {
            name: serialization.to_state_dict(getattr(state, name))
            for name in leaf_names(type(state))
            if getattr(state, name) is not None
        }

    def from_state_dict(target: T, state_dict: dict[str, Any]) -> T:
        # Configuration comes from `target`; only per-step values are restored.
        restored = {
            name: serialization.from_state_dict(getattr(target, name), state_dict[name], name)
            for name in leaf_names(type(target))
            if getattr(target, name) is not None
        }
        return rebuild(target, **restored)

    for cls in (
        NoOpLossScale,
        StaticLossScale,
        DynamicLossScale,
        LeafFlags,
        Fp8Meta,
        Fp8DotState,
        PrecisionStats,
    ):
        serialization.register_serialization_state(cls, to_state_dict, from_state_dict)


def register_when_flax_loads() -> None:
    """Registers the classes now if Flax is loaded, else as soon as it is."""
    wrapt.register_post_import_hook(_register, "flax.serialization")
