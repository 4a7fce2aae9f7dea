"""The engine's interpreter, in the shape of `jax.experimental.checkify`: a rule keyed by
primitive object, `rule(ctx, eqn, invals) -> outvals`, for every equation of a program, loops,
branches, calls and custom derivatives included; rules grouped in rule sets, each a layer over
a base (`RuleSet.over`).

What each primitive means to mixed precision (runs in the compute dtype, in float32, ...) is
the table of `jmp_policy._core.rules`; a rule set says what an interpreter does with it:
autocast's (`jmp_policy._autocast.programs`: the base rebuilds loops, branches and
checkpoints; autocast, float8 and `cast_at_use` are layers over it) and the precision
debugger's (`jmp_policy._reports.debugger.interpreter`: calls inlined and every operation
recorded, with loops unrolled as a layer over that).

Which rule runs an equation: the rule registered for its primitive (by object, or by name for
a primitive JAX does not export) in the topmost layer that has one, then in the layers below;
then the topmost layer's default, then the defaults below. A rule may decline an equation
(return None): the next one in that order decides. Where none does, the equation is bound as
traced (`_jaxpr.bind`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from jmp_policy._core import jaxpr as _jaxpr

Rule = Callable[[Any, Any, list], "list | None"]
"""`rule(ctx, eqn, invals)`: the outputs of `eqn` on `invals`, or None (not this rule's)."""


@dataclasses.dataclass(frozen=True, eq=False)
class RuleSet:
    """One layer of rules (`rules` by primitive object, `by_name` by primitive name, `default`
    for any other primitive) over `base` (None: the bottom layer).

    Build the bottom layer with `RuleSet(name, rules, ...)` and each mode over it with
    `base.over(name, rules, ...)`."""

    name: str
    rules: Mapping[Any, Rule] = dataclasses.field(default_factory=dict)
    by_name: Mapping[str, Rule] = dataclasses.field(default_factory=dict)
    default: Rule | None = None
    base: RuleSet | None = None
    # primitive -> the rules that may run it, in order (a table of JAX's primitives, filled
    # as they are met: a program's primitives are few)
    _order: dict = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        clash = {p.name for p in self.rules} & set(self.by_name)
        if clash:
            raise ValueError(f"rule set {self.name!r} has two rules for {sorted(clash)}")

    def over(
        self,
        name: str,
        rules: Mapping[Any, Rule] | None = None,
        *,
        by_name: Mapping[str, Rule] | None = None,
        default: Rule | None = None,
    ) -> RuleSet:
        """A layer over this one."""
        return RuleSet(name, dict(rules or {}), dict(by_name or {}), default, self)

    def layers(self) -> Iterator[RuleSet]:
        """This layer, then the ones below it."""
        layer: RuleSet | None = self
        while layer is not None:
            yield layer
            layer = layer.base

    def own_rule(self, primitive: Any) -> Rule | None:
        """The rule this layer (alone) registers for `primitive`."""
        rule = self.rules.get(primitive)
        return rule if rule is not None else self.by_name.get(primitive.name)

    def candidates(self, primitive: Any) -> tuple[Rule, ...]:
        """The rules that may run an equation of `primitive`, in the order they are asked."""
        found = self._order.get(primitive)
        if found is None:
            layers = list(self.layers())
            own = [r for layer in layers if (r := layer.own_rule(primitive)) is not None]
            defaults = [layer.default for layer in layers if layer.default is not None]
            found = self._order[primitive] = tuple(own + defaults)
        return found

    def apply(self, ctx: Any, eqn: Any, invals: list) -> list:
        """The outputs of `eqn` on `invals`, by the first rule that takes it."""
        for rule in self.candidates(eqn.primitive):
            outs = rule(ctx, eqn, invals)
            if outs is not None:
                return outs
        return _jaxpr.bind(eqn, invals)

    def run(
        self,
        ctx: Any,
        jaxpr: Any,
        consts: Sequence[Any],
        args: Sequence[Any],
        records: _jaxpr.Records | None = None,
    ) -> list:
        """`jaxpr` run equation by equation by these rules (`_jaxpr.evaluate`), each value's
        record beside it where `records` are given."""
        return _jaxpr.evaluate(
            jaxpr, consts, args, lambda eqn, invals: self.apply(ctx, eqn, invals), records
        )
