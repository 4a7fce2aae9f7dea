"""What a run of a Linen model under a policy showed about its modules (`Paths`): each
module path's policy, which layers cast their own parameters, which modules' matmuls are not
taken over. A first call without an earlier run learns them from one abstract recording run
(`MixedPrecisionModule._learn_paths`), not from the parameters' names."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn

from jmp_policy._flax_layers import TAKEN_OVER
from jmp_policy.policy import Policy


def keys_of(path: tuple) -> tuple[str, ...]:
    """A parameter's path in the variables (dict keys or attribute names) as strings."""
    return tuple(getattr(k, "key", getattr(k, "name", str(k))) for k in path)


def params_and_rest(variables: dict) -> tuple[Any, dict]:
    return variables.get("params", {}), {k: v for k, v in variables.items() if k != "params"}


@dataclasses.dataclass
class Paths:
    """What a run of the model showed: the policy of each module path it reached, the paths
    of Flax layers that cast their own parameters where they use them (a `promote_dtype`
    field: their parameters are not cast before the call), and the paths of modules whose
    matmuls are not taken over (not `_flax_layers.TAKEN_OVER`)."""

    policies: dict[tuple[str, ...], Policy] = dataclasses.field(default_factory=dict)
    cast_at_use: set[tuple[str, ...]] = dataclasses.field(default_factory=set)
    not_taken_over: set[tuple[str, ...]] = dataclasses.field(default_factory=set)

    def note(self, path: tuple[str, ...], module: nn.Module, policy: Policy) -> None:
        self.policies[path] = policy
        if "promote_dtype" in getattr(module, "__dataclass_fields__", {}):
            self.cast_at_use.add(path)
        if not isinstance(module, TAKEN_OVER):
            self.not_taken_over.add(path)

    def owner(self, module_path: tuple[str, ...]) -> tuple[str, ...] | None:
        """The innermost recorded module at or above `module_path`: the one owning its
        parameters."""
        for cut in range(len(module_path), -1, -1):
            if module_path[:cut] in self.policies:
                return module_path[:cut]
        return None

    def policy_of(self, module_path: tuple[str, ...], default: Policy) -> Policy:
        owner = self.owner(module_path)
        return default if owner is None else self.policies[owner]
