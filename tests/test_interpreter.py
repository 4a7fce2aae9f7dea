"""The engine's interpreter (`jmp_policy._core.interpreter`): rules keyed by primitive, in
rule sets layered over a base, and the rule sets autocast and the debugger run by."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import primitives as P

from jmp_policy._autocast import programs
from jmp_policy._autocast.evaluation import _Rules
from jmp_policy._core import jaxpr as _jaxpr
from jmp_policy._core.interpreter import RuleSet
from jmp_policy._reports.debugger import interpreter as debugger


def _program():
    def f(x):
        return jnp.sin(x) * 2.0 + jnp.cos(x)

    return jax.make_jaxpr(f)(jnp.float32(0.5))


def _run(rules: RuleSet, calls: list) -> float:
    closed = _program()
    (out,) = rules.run(calls, closed.jaxpr, closed.consts, [jnp.float32(0.5)])
    return float(out)


def _named(tag: str, outputs=None):
    """A rule that notes it ran; it gives `outputs(invals)`, or declines (None)."""

    def rule(calls, eqn, invals):
        calls.append((tag, eqn.primitive.name))
        return None if outputs is None else outputs(invals)

    return rule


def _as(fun):
    return lambda invals: [fun(*invals)]


def test_no_rule_binds_as_traced():
    calls: list = []
    assert _run(RuleSet("empty"), calls) == pytest.approx(2 * np.sin(0.5) + np.cos(0.5))
    assert calls == []


def test_a_primitives_own_rule_runs_before_any_default_and_the_top_layer_first():
    base = RuleSet(
        "base",
        {P.sin_p: _named("base sin", _as(jnp.cos))},
        default=_named("base default"),
    )
    top = base.over("top", default=_named("top default"))
    calls: list = []
    # sin is replaced by cos: cos(0.5) * 2 + cos(0.5)
    assert _run(top, calls) == pytest.approx(3 * np.cos(0.5))
    by_op: dict = {}
    for tag, name in calls:
        by_op.setdefault(name, []).append(tag)
    assert by_op["sin"] == ["base sin"]  # the base's own rule beats the top's default
    # other primitives: the top default, then the base default (both decline), then bound
    assert by_op["cos"] == ["top default", "base default"]
    assert by_op["mul"] == ["top default", "base default"]


def test_a_layer_overrides_the_rule_below_and_may_decline_to_it():
    base = RuleSet("base", {P.sin_p: _named("base", _as(jnp.cos))})
    replacing = base.over("replacing", {P.sin_p: _named("top", _as(lambda x: x))})
    declining = base.over("declining", {P.sin_p: _named("top")})
    calls: list = []
    assert _run(replacing, calls) == pytest.approx(2 * 0.5 + np.cos(0.5))
    assert calls == [("top", "sin")]
    calls = []
    assert _run(declining, calls) == pytest.approx(3 * np.cos(0.5))
    assert calls == [("top", "sin"), ("base", "sin")]


def test_a_rule_registered_by_name_is_found():
    rules = RuleSet("by name", by_name={"sin": _named("named", _as(jnp.cos))})
    calls: list = []
    assert _run(rules, calls) == pytest.approx(3 * np.cos(0.5))
    assert calls == [("named", "sin")]


def test_one_layer_cannot_hold_two_rules_for_one_primitive():
    with pytest.raises(ValueError, match="two rules for \\['sin'\\]"):
        RuleSet("twice", {P.sin_p: _named("a")}, by_name={"sin": _named("b")})


_STRUCTURE = [*_jaxpr.CALLS, _jaxpr.REMAT, _jaxpr.SCAN, _jaxpr.WHILE, _jaxpr.COND]


@pytest.mark.parametrize(
    "rules", [programs.AUTOCAST, programs.FLOAT8, programs.CAST_AT_USE], ids=lambda r: r.name
)
def test_autocast_registers_loops_branches_and_calls_like_any_primitive(rules):
    for primitive in _STRUCTURE:
        first = rules.candidates(primitive)[0]
        assert first is programs.STRUCTURE.own_rule(primitive), primitive
    custom = rules.candidates(_jaxpr.CUSTOM_VJP)[0]
    # `cast_at_use` runs a custom derivative as it runs any equation: as traced but for
    # weights' casts; autocast rebuilds it with its derivative rule kept
    expected = (
        programs._eval_cast_at_use
        if rules is programs.CAST_AT_USE
        else programs._eval_custom_derivative
    )
    assert custom is expected
    # the float8 layer adds a rule for dot_general over autocast's, which it may decline to
    dot = rules.candidates(P.dot_general_p)
    if rules is programs.FLOAT8:
        assert dot[:2] == (programs._float8_matmul, programs._by_meaning)
    else:
        assert programs._float8_matmul not in dot
    if rules is programs.CAST_AT_USE:  # a cast and a matmul each read in one rule of its own
        assert rules.candidates(_jaxpr.CONVERT)[0] is programs._at_use_convert
        for matmul in _jaxpr.LAX_MATMULS:
            assert rules.candidates(matmul)[0] is programs._at_use_matmul


def test_every_primitive_of_the_rules_table_has_its_own_autocast_rule():
    from jmp_policy._core import rules as _rules

    layer = programs.AUTOCAST
    expected = {
        _rules.COMPUTE: programs._by_meaning,
        _rules.FLOAT32: programs._by_meaning,
        _rules.OPERANDS: programs._by_meaning,
        _rules.NO_HALF_KERNEL: programs._without_half_kernel,
        _rules.AS_TRACED: programs._kept_as_traced,
    }
    for primitive, rule in _rules.RULES.items():
        assert layer.own_rule(primitive) is expected[rule.runs_in], primitive
    for name, rule in _rules.RULES_BY_NAME.items():
        assert layer.by_name[name] is expected[rule.runs_in], name
    # the table never shadows the structure below it
    for primitive in _STRUCTURE:
        assert layer.own_rule(primitive) is None, primitive
    assert layer.default is programs._eval_primitive


def test_a_regions_rules_choose_its_rule_set():
    plain = _Rules(np.dtype(jnp.bfloat16), np.dtype(jnp.float32), frozenset(), frozenset())
    assert programs.rule_set(plain) is programs.AUTOCAST
    assert programs.rule_set(dataclasses.replace(plain, at_use=True)) is programs.CAST_AT_USE
    assert programs.rule_set(dataclasses.replace(plain, fp8=(None, "e4m3"))) is programs.FLOAT8


def test_the_debugger_records_by_a_rule_set_with_loops_unrolled_as_a_layer():
    for primitive in _STRUCTURE[:-3]:  # calls and remat: inlined in both
        assert debugger.RECORDING.candidates(primitive)[0] is debugger._inlined
    for primitive in (_jaxpr.SCAN, _jaxpr.WHILE, _jaxpr.COND):
        assert debugger.RECORDING.candidates(primitive) == (debugger._recorded,)
        assert debugger.UNROLLING.candidates(primitive)[-1] is debugger._recorded
        assert len(debugger.UNROLLING.candidates(primitive)) == 2
    assert debugger._Collector.rule_set is debugger.UNROLLING
    assert debugger._Interpreter.rule_set is debugger.RECORDING


def test_loops_run_by_the_debuggers_unrolling_layer_record_each_step():
    """The `_Collector`'s scan rule records the body's operations once per step; the plain
    rule set records the loop as one operation."""

    def f(x):
        return lax.scan(lambda c, _: (jnp.sin(c), None), x, None, length=3)[0]

    closed = jax.make_jaxpr(f)(jnp.float32(0.5))

    class Names(debugger._Interpreter):
        def __init__(self):
            self.names: list = []

        def _record(self, eqn, stack, invals, outs, gradient=None, from_literals=False):
            self.names.append(eqn.primitive.name)

    plain = Names()
    (out,) = plain.run(closed.jaxpr, closed.consts, [jnp.float32(0.5)], "")
    assert plain.names == ["scan"]
    assert float(out) == pytest.approx(np.sin(np.sin(np.sin(0.5))))

    class Unrolled(debugger._Collector):  # the collector itself, recording names only
        def __init__(self):
            super().__init__(acc=None)
            self.names: list = []

        _record = Names._record

    unrolled = Unrolled()
    (out,) = unrolled.run(closed.jaxpr, closed.consts, [jnp.float32(0.5)], "")
    assert unrolled.names == ["sin"] * 3
    assert float(out) == pytest.approx(np.sin(np.sin(np.sin(0.5))))
