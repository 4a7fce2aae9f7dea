"""What a run of a Linen model under a policy showed about its modules (`Paths`): each
module path's policy, which layers cast their own parameters, which modules' matmuls are not
taken over; and the guess a first call makes without an earlier run (`guessed_paths`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax

from jmp_policy._flax_layers import TAKEN_OVER
from jmp_policy.policy import Policy


def keys_of(path: tuple) -> tuple[str, ...]:
    """A parameter's path in the variables (dict keys or attribute names) as strings."""
    return tuple(getattr(k, "key", getattr(k, "name", str(k))) for k in path)


LAYER_PARAMS = frozenset({"kernel", "bias", "embedding", "scale"})
"""The names Flax's layers (Dense, Conv, Embed, the norms) give their parameters."""


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


def guessed_paths(variables: dict, policy: Policy) -> Paths:
    """Paths for a first call without an earlier run (parameters restored in a new
    process), guessed from the parameters' names: a module holding only the names Flax's
    layers give theirs (`LAYER_PARAMS`) casts its own (they go in as stored; a float32
    island's are float32 already); a module holding another is taken to use it itself,
    under the model's policy (cast where used: `cast_at_use`). The call checks the guess
    against the modules it ran."""
    names: dict[tuple[str, ...], set[str]] = {}
    for path, _ in jax.tree_util.tree_leaves_with_path(variables.get("params", {})):
        keys = keys_of(path)
        names.setdefault(keys[:-1], set()).add(keys[-1])
    guess = Paths()
    for module, held in names.items():
        if held <= LAYER_PARAMS:
            guess.cast_at_use.add(module)
        else:
            guess.policies[module] = policy
            guess.not_taken_over.add(module)
    return guess
