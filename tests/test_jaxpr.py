"""The one reader of JAX programs (`jmp_policy._core.jaxpr`) and what every part learns from it.

A matmul inside each structure JAX programs are made of must be rewritten by autocast,
counted by `precision_report` and named by the precision debugger, and each primitive table
holds primitives of the installed JAX.
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import Primitive
from jax.extend.core import primitives as jax_primitives

import jmp_policy as jmp
from jmp_policy._core import jaxpr as _jaxpr
from jmp_policy._core import naming as _naming
from jmp_policy._core import rules as _rules
from jmp_policy._core.compat import bind_params
from jmp_policy._reports.census import iter_equations

W = jax.random.normal(jax.random.key(0), (8, 8)) * 0.5
X = jax.random.normal(jax.random.key(1), (4, 8))


def layer(w, x):
    """The one matmul, in a named scope the debugger must name."""
    with jax.named_scope("mm"):
        return jnp.tanh(x @ w)


def in_closed_call(w, x):
    program = jax.make_jaxpr(layer)(w, x)
    subfuns, params = bind_params(jax_primitives.closed_call_p, {"call_jaxpr": program})
    return jax_primitives.closed_call_p.bind(*subfuns, w, x, **params)[0]


@jax.custom_jvp
def with_custom_jvp(w, x):
    return layer(w, x)


@with_custom_jvp.defjvp
def _(primals, tangents):
    (w, x), (dw, dx) = primals, tangents
    y = layer(w, x)
    return y, (1 - y**2) * (dx @ w + x @ dw)


@jax.custom_vjp
def with_custom_vjp(w, x):
    return layer(w, x)


def _forward(w, x):
    y = layer(w, x)
    return y, (w, x, y)


def _backward(residuals, g):
    w, x, y = residuals
    g = g * (1 - y**2)
    return x.T @ g, g @ w.T


with_custom_vjp.defvjp(_forward, _backward)


def ragged(w, x):
    with jax.named_scope("mm"):
        groups = jnp.array([x.shape[0]], jnp.int32)
        return jnp.tanh(lax.ragged_dot(x, w[None], groups))


STRUCTURES = {
    "jit": lambda w, x: jax.jit(layer)(w, x),
    "closed_call": in_closed_call,
    "remat": lambda w, x: jax.checkpoint(layer)(w, x),
    "scan": lambda w, x: lax.scan(lambda c, _: (layer(w, c), None), x, None, length=2)[0],
    "while": lambda w, x: lax.fori_loop(0, 2, lambda i, c: layer(w, c), x),
    "cond": lambda w, x: lax.cond(jnp.sum(x) > -1e9, layer, lambda w, x: x, w, x),
    "custom_jvp": with_custom_jvp,
    "custom_vjp": with_custom_vjp,
    "ragged_dot": ragged,
}


def matmul_dtypes(program) -> set:
    return {str(e.invars[0].aval.dtype) for e in iter_equations(program) if _jaxpr.is_matmul(e)}


def matmul_rows(report) -> dict:
    return {(p, d): c for p, d, c, _ in report.rows if p in _jaxpr.matmul_names()}


@pytest.mark.parametrize("structure", sorted(STRUCTURES))
def test_a_matmul_in_every_structure_is_rewritten_counted_and_named(structure):
    fun = STRUCTURES[structure]
    mixed = jmp.autocast(fun, "mixed_float16")
    # autocast rewrites it: the matmul takes float16 operands, wherever it sits.
    assert matmul_dtypes(jax.make_jaxpr(mixed)(W, X)) == {"float16"}
    name = _jaxpr.RAGGED_DOT.name if structure == "ragged_dot" else "dot_general"
    # precision_report counts it, in the dtype it runs in.
    assert set(matmul_rows(jmp.precision_report(fun, W, X))) == {(name, "float32")}
    assert set(matmul_rows(jmp.precision_report(mixed, W, X))) == {(name, "float16")}
    # The debugger names it by the scope it is in (and its backward pass, where JAX derives
    # it: a custom rule's own code is named where it is written).
    report = jmp.debug_precision(lambda w, x: jnp.sum(fun(w, x) ** 2), W, X)
    directions = {s.direction for s in report.layers if s.layer == "mm"}
    assert directions == ({"forward"} if "custom" in structure else {"forward", "backward"})
    # The result is float32's, within float16's rounding.
    np.testing.assert_allclose(mixed(W, X), fun(W, X), atol=2e-2)


@pytest.mark.parametrize("structure", ["custom_jvp", "custom_vjp"])
def test_custom_derivatives_keep_their_rules_under_autocast(structure):
    """The function's own computation runs by autocast's rules; its derivative rule gives
    the gradient the user wrote, under `grad` and `jit`: a `custom_jvp`'s rule on values in
    the dtypes it was written for, a `custom_vjp`'s backward pass by the rules too (torch.amp's
    `custom_bwd`: its matmuls in half precision, on the residuals the forward pass kept)."""
    fun = STRUCTURES[structure]

    def loss(w, x):
        return jnp.sum(fun(w, x) ** 2)

    want = jax.grad(loss, argnums=(0, 1))(W, X)
    got = jax.jit(jax.grad(jmp.autocast(loss, "mixed_float16"), argnums=(0, 1)))(W, X)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(g, w, atol=2e-2 * float(jnp.max(jnp.abs(w))))
    program = jax.make_jaxpr(jax.grad(jmp.autocast(loss, "mixed_float16")))(W, X)
    assert matmul_dtypes(program) == {"float16"}  # forward, and the backward rule's


def test_a_custom_vjp_with_an_integer_argument_under_autocast():
    @jax.custom_vjp
    def scaled(x, n):
        return x @ x.T * jnp.asarray(n, x.dtype)

    def forward(x, n):
        return scaled(x, n), (x, n)

    scaled.defvjp(forward, lambda r, g: ((g + g.T) @ r[0] * jnp.asarray(r[1], g.dtype), None))
    grad = jax.grad(jmp.autocast(lambda x: jnp.sum(scaled(x, 3)), "mixed_bfloat16"))(X)
    np.testing.assert_allclose(grad, jax.grad(lambda x: jnp.sum(scaled(x, 3)))(X), rtol=2e-2)


def test_the_primitive_tables_hold_primitives_of_the_installed_jax():
    tables = [
        _jaxpr.MATMULS,
        _jaxpr.CALLS,
        _jaxpr.CUSTOM_DERIVATIVES,
        _jaxpr.STRUCTURAL,
        [_jaxpr.REMAT, _jaxpr.SCAN, _jaxpr.WHILE, _jaxpr.COND],
    ]
    for table in tables:
        assert table and all(isinstance(p, Primitive) for p in table)

    # Each is what JAX binds for its public function.
    def first(fun, *args):
        return jax.make_jaxpr(fun)(*args).eqns[0].primitive

    assert first(jax.jit(layer), W, X) in _jaxpr.CALLS
    assert first(jax.checkpoint(layer), W, X) is _jaxpr.REMAT
    assert first(with_custom_jvp, W, X) is _jaxpr.CUSTOM_JVP
    assert first(with_custom_vjp, W, X) is _jaxpr.CUSTOM_VJP
    assert first(lambda w, x: x @ w, W, X) is _jaxpr.DOT_GENERAL
    assert {e.primitive for e in jax.make_jaxpr(ragged)(W, X).eqns} & {_jaxpr.RAGGED_DOT}
    assert jmp.casting.ALLOW == _jaxpr.matmul_names()


def test_fallback_names_are_absent_on_purpose_and_still_read():
    """A call primitive only JAX's main branch stages (`eval_jaxpr`) is not a primitive this
    JAX puts in programs, and is read as a call when one does."""
    public = {p.name for p in vars(jax_primitives).values() if isinstance(p, Primitive)}
    for name in _jaxpr.FALLBACK_NAMES:
        assert name not in public
        renamed = types.SimpleNamespace(primitive=Primitive(name), params={})
        assert _jaxpr.is_call(renamed)
    # None of the names the library used to keep for primitives no supported JAX has.
    names = {p.name for p in _jaxpr.STRUCTURAL | _jaxpr.CUSTOM_DERIVATIVES}
    assert not names & {"pjit", "core_call", "remat", "checkpoint", "custom_vjp_call_jaxpr"}


@pytest.mark.parametrize(
    ("stack", "path"),
    [
        ("Transformer/Transformer.encode/encoder/encoder_norm", "Transformer/encoder/encoder_norm"),
        ("transpose(jvp(GPT))/Block_0/jmp_float32_override/LayerNorm_0", "GPT/Block_0/LayerNorm_0"),
        ("Model/layers/0/attn/...hqk,...khd->...qhd", "Model/layers/0/attn"),
        ("MLP/eqx.nn.Linear/layers/1", "MLP/layers/1"),
        ("", _naming.TOP_LEVEL),
    ],
)
def test_one_module_path_from_a_name_stack(stack, path):
    assert _naming.module_path(stack, ("jmp_float32_override",)) == path


def test_the_primitives_read_by_name_or_found_inside_a_call_are_what_jax_binds():
    """`jax.nn.scaled_matmul`'s GEMM (found inside its `jit`), the conversions, and the two
    kinds read by name: `shard_map` (its object needs a mesh at import) and host callbacks."""

    def inner(fun, *args):
        return [e.primitive for e, _ in _jaxpr.walk(jax.make_jaxpr(fun)(*args))]

    f8, scale = jnp.float8_e4m3fn, jnp.float8_e8m0fnu
    blocks = [
        jax.ShapeDtypeStruct(shape, dtype)
        for shape, dtype in (((1, 32, 64), f8), ((1, 16, 64), f8), ((1, 32, 2), scale))
    ]
    blocks.append(jax.ShapeDtypeStruct((1, 16, 2), scale))
    assert _jaxpr.BLOCK_SCALED_MATMUL in inner(jax.nn.scaled_matmul, *blocks)
    assert inner(lambda x: x.astype(jnp.float16), X) == [_jaxpr.CONVERT]
    assert inner(lambda x: lax.bitcast_convert_type(x, jnp.int32), X) == [_jaxpr.BITCAST]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("i",))
    mapped = jax.shard_map(lambda x: x * 2, mesh=mesh, in_specs=jax.P("i"), out_specs=jax.P("i"))
    assert [p.name for p in inner(mapped, X)][0] == _jaxpr.SHARD_MAP_NAME

    def calls(x):
        jax.debug.callback(lambda v: None, x)
        return jax.pure_callback(lambda v: v, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    program = jax.make_jaxpr(calls)(X)
    assert [_jaxpr.is_callback(e) for e in program.eqns] == [True, True]


def test_every_primitive_the_installed_jax_exports_has_one_rule():
    """What each primitive means is decided once (`_rules.RULES`): a JAX release that adds a
    primitive fails here until its rule is written."""
    exported = {p for p in vars(jax_primitives).values() if isinstance(p, Primitive)}
    structural = _jaxpr.STRUCTURAL | _jaxpr.CUSTOM_DERIVATIVES
    missing = sorted(p.name for p in exported - structural if _rules.rule_of(p) is None)
    assert not missing, f"primitives without a rule in _rules.RULES: {missing}"
    for rule in {*_rules.RULES.values(), *_rules.RULES_BY_NAME.values()}:
        assert rule.runs_in in (
            _rules.COMPUTE,
            _rules.FLOAT32,
            _rules.NO_HALF_KERNEL,
            _rules.OPERANDS,
            _rules.AS_TRACED,
        )
    # The lists users read and write by name are the table's.
    assert jmp.casting.ALLOW == _rules.names_running_in(_rules.COMPUTE) == _jaxpr.matmul_names()
    assert jmp.casting.DENY == _rules.names_running_in(_rules.FLOAT32)
    assert {"exp", "log", "reduce_sum", "cumsum", "rsqrt"} <= jmp.casting.DENY
    assert {"fft", "svd", "cholesky"} <= jmp.casting.NO_HALF_KERNEL


def test_the_rules_read_by_name_are_for_primitives_jax_binds_and_does_not_export():
    """`RULES_BY_NAME` holds primitives the installed JAX binds without exporting them: each
    that a public function reaches is what that function binds."""
    exported = {p.name for p in vars(jax_primitives).values() if isinstance(p, Primitive)}
    assert not set(_rules.RULES_BY_NAME) & exported
    four = jnp.ones(4)
    bound = {
        "split": lambda x: lax.split(x, (2, 2)),
        "optimization_barrier": lax.optimization_barrier,
    }
    for name, fun in bound.items():
        (eqn,) = jax.make_jaxpr(fun)(four).eqns
        assert eqn.primitive.name == name and _rules.rule_of(eqn) is _rules.RULES_BY_NAME[name]


def test_the_rules_read_by_name_include_equinox_loop_primitives():
    """diffrax's solvers run Equinox's loops, which bind Equinox's own primitives: they have
    rules (autocast would say it has none, once per process), under the names Equinox gives."""
    eqxi = pytest.importorskip("equinox.internal")
    from equinox.internal._primitive import _vprim_p

    for primitive in (eqxi.maybe_set_p, eqxi.select_if_vmap_p, _vprim_p):
        assert _rules.RULES_BY_NAME[primitive.name].runs_in == _rules.AS_TRACED


def test_elementwise_means_the_operands_broadcast_to_the_output():
    """`Rule.elementwise` is what lets a rewriter broadcast an operand to the output's shape:
    true of `add` (a literal operand stays 0-d), false of what joins or moves values."""
    assert _rules.rule_of(jax_primitives.add_p).elementwise
    assert _rules.rule_of(jax_primitives.div_p).elementwise
    for p in (jax_primitives.concatenate_p, jax_primitives.scatter_add_p, jax_primitives.pad_p):
        assert not _rules.rule_of(p).elementwise, p
    assert _rules.rule_of(jax_primitives.scatter_add_p).reduction
    assert _rules.rule_of(jax_primitives.reshape_p).layout
    assert not _rules.rule_of(jax_primitives.slice_p).layout  # it drops values
    (eqn,) = jax.make_jaxpr(lambda x: x / 0.9)(X).eqns
    assert eqn.primitive is _jaxpr.DIV and eqn.invars[1].aval.shape == ()


def test_only_the_jaxpr_core_decides_by_a_primitive_name():
    """No library module but the jaxpr core (`_core/jaxpr.py`, `_core/rules.py`) writes a
    primitive's name to decide what it means. The strings kept are not primitives: Flax's
    layer hooks (`dot_general`), parameter keys (`name`), fp8's `amax_from="max"`, the
    low-precision `"split"` mode, report row keys."""
    import ast
    import pathlib

    names = set(_rules._TABLE_BY_NAME) | {
        p.name for p in vars(jax_primitives).values() if isinstance(p, Primitive)
    }
    not_primitives = {
        "matmul.py": {"dot_general", "conv_general_dilated"},  # Flax layer hooks
        "_flax/layers.py": {"dot_general", "conv_general_dilated"},
        "linen.py": {"dot_general"},
        "nnx.py": {"dot_general"},
        "_fp8/delayed.py": {"max"},
        "_low_precision/optimizer.py": {"split"},  # the mode
        "_core/naming.py": {"call"},  # a profile function's event
    }
    root = pathlib.Path(jmp.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() in ("_core/jaxpr.py", "_core/rules.py"):
            continue
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        allowed = not_primitives.get(path.relative_to(root).as_posix(), set()) | {"name"}
        found += [
            f"{path.relative_to(root)}:{node.lineno} {node.value!r}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and node.value in names - allowed
        ]
    assert not found, found


def test_no_value_is_known_by_its_id():
    """Nothing in the library keys what it knows of a value by `id()` (an id is reused once its
    object is gone, and says nothing of what the value is): values carry records
    (`_jaxpr.Records`), modules are found by identity. The check reads every module's code."""
    import ast
    import pathlib

    import jmp_policy

    root = pathlib.Path(jmp_policy.__file__).parent
    calls = [
        f"{path.relative_to(root)}:{node.lineno}"
        for path in sorted(root.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "id"
    ]
    assert calls == []


def test_a_record_follows_its_value_into_an_inlined_call_and_back():
    """`evaluate` with `Records`: a call's body reads the caller's record of the value it is
    given, and the caller reads the record the body made for what it returns; a program run
    again (`scan`-like) finds its constants' records; once closed, nothing is found."""

    @jax.jit
    def inner(y):
        return jnp.cos(y)

    closed = jax.make_jaxpr(lambda x: inner(jnp.sin(x)) * 2.0)(1.0)
    records = _jaxpr.Records(dict)
    read: dict = {}

    def rule(eqn, invals):
        body = _jaxpr.inlined_body(eqn)
        if body is not None:
            return _jaxpr.evaluate(body.jaxpr, body.consts, invals, rule, records)
        outs = _jaxpr.bind(eqn, invals)
        read[eqn.primitive.name] = [records.find(x) for x in invals]
        records.of(outs[0])["made by"] = eqn.primitive.name
        return outs

    def run(x):
        return _jaxpr.evaluate(closed.jaxpr, closed.consts, [x], rule, records)

    jax.make_jaxpr(run)(1.0)
    assert read["cos"] == [{"made by": "sin"}]  # inside the call: the caller's record
    assert read["mul"][0] == {"made by": "cos"}  # after it: the record the body made

    weights = jnp.arange(3.0)
    scaled = jax.make_jaxpr(lambda x: x * weights)(jnp.ones(3))
    assert len(scaled.consts) == 1
    twice = [
        (_jaxpr.evaluate(scaled.jaxpr, scaled.consts, [jnp.ones(3)], rule, records), read["mul"])
        for _ in range(2)
    ]
    assert twice[0][1][1] is twice[1][1][1] is not None  # the constant's one record
    records.close()
    assert records.find(scaled.consts[0]) is None and records.of(scaled.consts[0]) is None
