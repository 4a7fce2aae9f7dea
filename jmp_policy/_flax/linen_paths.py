"""What a run of a Linen model under a policy showed about its modules (`Paths`): each
module path's policy and which layers cast their own parameters. A first call without an
earlier run learns them from one abstract recording run (`MixedPrecisionModule._learn_paths`),
not from the parameters' names."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jmp_policy.policy import Policy, cast_floating, casting_policy, is_floating_array


def keys_of(path: tuple) -> tuple[str, ...]:
    """A parameter's path in the variables (dict keys or attribute names) as strings."""
    return tuple(getattr(k, "key", getattr(k, "name", str(k))) for k in path)


def params_and_rest(variables: dict) -> tuple[Any, dict]:
    return variables.get("params", {}), {k: v for k, v in variables.items() if k != "params"}


@dataclasses.dataclass
class Paths:
    """What a run of the model showed: the policy of each module path it reached, the paths
    of Flax layers that cast their own parameters where they use them (a `promote_dtype`
    field: their parameters are not cast before the call)."""

    policies: dict[tuple[str, ...], Policy] = dataclasses.field(default_factory=dict)
    cast_at_use: set[tuple[str, ...]] = dataclasses.field(default_factory=set)

    def note(self, path: tuple[str, ...], module: nn.Module, policy: Policy) -> None:
        self.policies[path] = policy
        if "promote_dtype" in getattr(module, "__dataclass_fields__", {}):
            self.cast_at_use.add(path)

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

    def cast_target(self, module: tuple[str, ...], to: str, default: Policy) -> Any:
        """The dtype a parameter of `module` is cast to before the call (None: as stored);
        `to` "compute" or "param", `default` the model's policy."""
        if to == "compute" and module in self.cast_at_use:
            return None  # the layer casts it where it uses it
        policy = casting_policy(self.policy_of(module, default))
        return policy.compute_dtype if to == "compute" else policy.param_dtype

    def cast_params(self, params: Any, to: str, default: Policy) -> Any:
        def cast(path, leaf):
            target = self.cast_target(keys_of(path)[:-1], to, default)
            return leaf if target is None else cast_floating(leaf, target)

        return jax.tree_util.tree_map_with_path(cast, params)

    def in_half(self, default: Policy) -> bool:
        """Whether a module computes in 16 bits: then the model runs under
        `autocast.cast_at_use`, which also keeps the float32 list in the model's own code.
        (A float8 policy computes in bfloat16 besides its float8 matmuls: `fp8_dot_for`.)"""
        policies = [default, *self.policies.values()]
        return any(casting_policy(p).compute_dtype.itemsize == 2 for p in policies)

    def casts_own_weights(self, variables: dict, reduce_dtype: Any) -> bool:
        """Whether a 16-bit module owns a parameter (the weights then go into `cast_at_use` in
        float32, `reduce_dtype` set, each matmul on one taking it in float32)."""
        if reduce_dtype is None or "params" not in variables:
            return False
        leaves = jax.tree_util.tree_leaves_with_path(variables["params"])
        owners = {self.owner(keys_of(path)[:-1]) for path, _ in leaves}
        # 16 bits; a float8 policy's layers are left as they are (`fp8_dot_for`).
        return any(
            owner is not None and self.policies[owner].compute_dtype.itemsize == 2
            for owner in owners
        )

    def plan(self, variables: dict, ran: Paths, default: Policy, reduce_dtype: Any) -> tuple:
        """What these paths decide for the traced program: the route (`cast_at_use` or not),
        and the dtype each floating parameter of a module that `ran` is cast to (None: none,
        or its own dtype)."""

        def target(path, leaf) -> Any:
            dtype = self.cast_target(keys_of(path)[:-1], "compute", default)
            return None if dtype is None or not is_floating_array(leaf) else jnp.dtype(dtype)

        leaves = jax.tree_util.tree_leaves_with_path(variables.get("params", {}))
        targets = tuple(
            None if (t := target(path, leaf)) == leaf.dtype else t
            for path, leaf in leaves
            if keys_of(path)[:-1] in ran.policies
        )
        return self.in_half(default), self.casts_own_weights(variables, reduce_dtype), targets
