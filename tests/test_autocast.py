"""Tests for jmp_policy.autocast: op lists applied to unmodified programs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from models import MODEL, PARAMS, RNN_PARAMS, XS, X, Y, loss_fn, rnn, widened_on_cpu

import jmp_policy as jmp
from jmp_policy._reports.census import MATMULS, iter_equations, report_of_jaxpr

F32 = jnp.dtype("float32")
HALF = [jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)]
FRAGILE = {"exp", "log", "reduce_sum"}


def operand_dtypes(eqn):
    return {v.aval.dtype for v in eqn.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)}


def check_forward(jaxpr, half):
    """Dots/convs take `half` operands; exp/log/reduce_sum take float32."""
    seen = {"matmul": 0, "fragile": 0}
    for eqn in iter_equations(jaxpr):
        if eqn.primitive.name in MATMULS:
            assert operand_dtypes(eqn) == {half}, eqn
            seen["matmul"] += 1
        elif eqn.primitive.name in FRAGILE and operand_dtypes(eqn):
            assert operand_dtypes(eqn) == {F32}, eqn
            seen["fragile"] += 1
    assert seen["matmul"] >= 7 and seen["fragile"] >= 5, seen
    return seen


def cosine(a, b):
    # On the host, in float64: no eager JAX operation to compile per leaf shape.
    a = np.concatenate([np.ravel(x).astype(np.float64) for x in jax.tree.leaves(a)])
    b = np.concatenate([np.ravel(x).astype(np.float64) for x in jax.tree.leaves(b)])
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("name", ["mixed_float16", "mixed_bfloat16"])
def test_flax_transformer_with_conv_stem(name):
    policy = jmp.get_policy(name)
    mixed = jmp.autocast(loss_fn, policy)
    forward = jax.make_jaxpr(mixed)(PARAMS, X, Y)
    check_forward(forward, policy.compute_dtype)
    backward = jax.make_jaxpr(jax.grad(mixed))(PARAMS, X, Y)
    for eqn in iter_equations(backward):
        if eqn.primitive.name in MATMULS:
            operands = operand_dtypes(eqn)
            if widened_on_cpu(eqn, policy.compute_dtype):
                operands = {policy.compute_dtype}  # exact bfloat16 values, widened for XLA:CPU
            assert operands == {policy.compute_dtype}, eqn
    print(f"\nautocast {name}, forward: {report_of_jaxpr(forward)}")
    print(f"autocast {name}, forward+backward: {report_of_jaxpr(backward)}")

    reference_loss, reference_grads = jax.jit(jax.value_and_grad(loss_fn))(PARAMS, X, Y)
    loss, grads = jax.jit(jax.value_and_grad(mixed))(PARAMS, X, Y)
    assert loss.dtype == F32
    assert abs(float(loss) - float(reference_loss)) <= 0.01 * abs(float(reference_loss))
    assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}  # the parameters' dtype
    similarity = cosine(grads, reference_grads)
    print(
        f"loss {float(loss):.5f} vs float32 {float(reference_loss):.5f}; "
        f"gradient cosine {similarity:.5f}"
    )
    assert similarity >= 0.999


@pytest.mark.parametrize("half", HALF)
def test_scan_recurrence(half):
    mixed = jmp.autocast(rnn, jmp.Policy(F32, half, F32))
    jaxpr = jax.make_jaxpr(mixed)(RNN_PARAMS, XS)
    scans = [e for e in iter_equations(jaxpr) if e.primitive.name == "scan"]
    assert len(scans) == 1
    body = list(iter_equations(scans[0].params["jaxpr"]))
    dots = [e for e in body if e.primitive.name == "dot_general"]
    assert len(dots) == 2 and all(operand_dtypes(e) == {half} for e in dots)
    assert all(
        operand_dtypes(e) == {F32} for e in body if e.primitive.name in ("exp", "reduce_sum")
    )
    carry_in = scans[0].params["jaxpr"].in_avals[0]
    assert carry_in.dtype == F32  # the carry keeps its initial dtype
    print(f"\nscan recurrence {half.name}: {report_of_jaxpr(jaxpr)}")
    np.testing.assert_allclose(mixed(RNN_PARAMS, XS), rnn(RNN_PARAMS, XS), rtol=2e-2)
    grads = jax.jit(jax.grad(mixed))(RNN_PARAMS, XS)
    assert jax.tree.map(lambda g: g.dtype, grads) == {"w": F32, "u": F32}


def test_vmap_of_and_inside():
    mixed = jmp.autocast(lambda w, x: jnp.exp(x @ w).sum())
    w, xs = jnp.ones((3, 2)) * 0.1, jnp.ones((5, 4, 3))
    out = jax.vmap(mixed, in_axes=(None, 0))(w, xs)
    assert out.shape == (5,)
    inside = jmp.autocast(lambda w, xs: jax.vmap(lambda x: x @ w)(xs).sum())
    census = jmp.precision_report(inside, w, xs)
    assert census.counts["dot_general"] == {"float16": 1}
    np.testing.assert_allclose(inside(w, xs), (xs @ w).sum(), rtol=1e-2)


def test_nested_jit_while_cond_and_checkpoint():
    @jax.jit
    def inner(w, x):
        return x @ w

    def f(w, x):
        y = inner(w, x)
        y = jax.checkpoint(lambda a: jnp.sin(a @ w.T @ w))(y)
        n, y = lax.while_loop(
            lambda s: s[0] < 3, lambda s: (s[0] + 1, s[1] @ (w.T @ w) * 0.5), (0, y)
        )
        y = lax.cond(y.sum() > 0, lambda a: a @ w.T, lambda a: a[:, :1] * jnp.ones((1, 3)), y)
        return jnp.log(jnp.abs(y).sum() + 1.0)

    w, x = jnp.full((3, 3), 0.2), jnp.ones((2, 3))
    mixed = jmp.autocast(f)
    jaxpr = jax.make_jaxpr(mixed)(w, x)
    dots = [e for e in iter_equations(jaxpr) if e.primitive.name == "dot_general"]
    assert dots and all(operand_dtypes(e) == {jnp.dtype(jnp.float16)} for e in dots)
    assert {e.primitive.name for e in iter_equations(jaxpr)} >= {"while", "cond", "remat2"}
    np.testing.assert_allclose(mixed(w, x), f(w, x), rtol=1e-2)

    def g(w, x):  # reverse mode (no while_loop: JAX cannot differentiate it)
        y = jax.checkpoint(lambda a: jnp.sin(inner(w, a)))(x)
        return jnp.log(lax.cond(y.sum() > 0, lambda a: (a @ w.T) ** 2, lambda a: a, y).sum())

    grads = jax.jit(jax.grad(jmp.autocast(g)))(w, x)
    assert grads.dtype == F32
    np.testing.assert_allclose(grads, jax.grad(g)(w, x), rtol=5e-2, atol=1e-3)


def test_full_precision_region_stays_float32():
    def layer_norm(x):
        mean = x.mean(-1, keepdims=True)
        return (x - mean) * lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)

    def f(w, x):
        h = x @ w
        h = jmp.full_precision(lambda a: layer_norm(a) @ w.T)(h)  # autocast(enabled=False)
        return (h @ w).sum()

    w, x = jnp.ones((4, 4)) * 0.1, jnp.ones((2, 4))
    jaxpr = jax.make_jaxpr(jmp.autocast(f))(w, x)
    regions = [
        e for e in iter_equations(jaxpr) if e.params.get("name") == "jmp_full_precision_region"
    ]
    assert len(regions) == 1
    inside = list(iter_equations(regions[0].params["jaxpr"]))
    assert all(operand_dtypes(e) <= {F32} for e in inside), "everything in the region is float32"
    assert [operand_dtypes(e) for e in inside if e.primitive.name == "dot_general"] == [{F32}]
    census = report_of_jaxpr(jaxpr)
    print(f"\nfull_precision inside autocast: {census}")
    assert census.counts["dot_general"] == {"float16": 2, "float32": 1}


def test_nested_autocast_keeps_its_policy():
    inner = jmp.autocast(lambda w, x: x @ w, "mixed_bfloat16")
    outer = jmp.autocast(lambda w, x: inner(w, x) @ w.T + x @ w @ w.T, "mixed_float16")
    census = jmp.precision_report(outer, jnp.ones((3, 3)), jnp.ones((2, 3)))
    assert census.counts["dot_general"] == {"bfloat16": 1, "float16": 3}


def test_custom_vjp_rule_is_kept():
    @jax.custom_vjp
    def scaled(x):
        return x * 2.0

    scaled.defvjp(lambda x: (x * 2.0, None), lambda _, ct: (ct * 100.0,))  # not the true derivative

    def f(w, x):
        return scaled(x @ w).sum()

    w, x = jnp.ones((3, 2)), jnp.ones((4, 3))
    grads = jax.jit(jax.grad(jmp.autocast(f)))(w, x)
    np.testing.assert_allclose(grads, jax.grad(f)(w, x))
    np.testing.assert_allclose(grads, jnp.full((3, 2), 400.0))  # 100 x 4 rows, not 2 x 4
    jaxpr = jax.make_jaxpr(jmp.autocast(f))(w, x)
    assert any(e.primitive.name == "custom_vjp_call" for e in iter_equations(jaxpr))


def test_custom_jvp_rule_is_kept():
    mixed = jmp.autocast(lambda w, x: jax.nn.relu(x @ w).sum())  # relu is a custom_jvp
    w, x = jnp.ones((3, 2)), jnp.array([[1.0, -1.0, 0.0]])
    jaxpr = jax.make_jaxpr(mixed)(w, x)
    assert any(e.primitive.name == "custom_jvp_call" for e in iter_equations(jaxpr))
    np.testing.assert_allclose(
        jax.grad(mixed)(w, x), jax.grad(lambda w: jax.nn.relu(x @ w).sum())(w)
    )


def test_static_arguments_and_cache():
    calls = []

    def f(x, power):
        calls.append(power)
        return jnp.sum(x**power)

    mixed = jmp.autocast(f, static_argnums=1)
    x = jnp.ones(3)
    assert float(mixed(x, 2)) == 3.0 and float(mixed(x, 3)) == 3.0
    mixed(x, 2)
    assert calls == [2, 3]  # traced once per signature
    kw = jmp.autocast(lambda x, *, axis: x.sum(axis=axis), static_argnames="axis")
    assert kw(jnp.ones((2, 3)), axis=1).shape == (2,)


def test_a_non_array_leaf_is_part_of_the_program_by_value_or_by_identity():
    """Leaves that are not arrays go into the program as they are, like `eqx.filter_jit`'s: one
    program per equal hashable value, and per object for an unhashable one (equal or not: its
    value could change in place)."""
    import types

    calls = []

    def f(x, config):
        calls.append(config)
        return x * config.scale

    mixed = jmp.autocast(f, "mixed_float16")
    x = jnp.ones(3)
    first, second = types.SimpleNamespace(scale=2.0), types.SimpleNamespace(scale=2.0)
    mixed(x, first), mixed(x, first)
    assert calls == [first]
    mixed(x, second)  # equal, but another object
    assert len(calls) == 2 and calls[1] is second
    frozen = dataclasses.make_dataclass("Frozen", [("scale", float)], frozen=True)
    mixed(x, frozen(3.0)), mixed(x, frozen(3.0))  # hashable: by value
    assert len(calls) == 3


def test_integer_bool_and_key_values_untouched():
    def f(x, idx, mask, key):
        noise = jax.random.normal(key, (2, 2))
        return jnp.where(mask, x[idx] + noise, 0.0).sum(), idx * 2

    args = (jnp.ones((3, 2)), jnp.array([0, 2]), jnp.array([True, False]), jax.random.key(0))
    mixed = jmp.autocast(f, "mixed_float16")
    out, idx2 = mixed(*args)
    assert idx2.dtype == jnp.int32 and out.dtype == F32
    # The values are untouched (the output cast alone would hide a cast of an
    # index, a mask or a key): same indices, same mask, same random numbers.
    expected_out, expected_idx2 = f(*args)
    assert idx2.tolist() == expected_idx2.tolist()
    np.testing.assert_allclose(out, expected_out, rtol=1e-3)

    # And autocast adds no convert of an integer, bool or key value (the
    # original already converts random bits to floats once).
    def non_floating_converts(fn):
        return sorted(
            str(e.invars[0].aval.dtype)
            for e in iter_equations(jax.make_jaxpr(fn)(*args))
            if e.primitive.name == "convert_element_type"
            and not jnp.issubdtype(e.invars[0].aval.dtype, jnp.floating)
        )

    assert non_floating_converts(mixed) == non_floating_converts(f)


def test_custom_op_lists():
    f = lambda w, x: jnp.tanh(x @ w).sum()  # noqa: E731
    default = jmp.precision_report(
        jmp.autocast(f, "mixed_float16"), jnp.ones((2, 2)), jnp.ones((2, 2))
    )
    assert default.counts["tanh"] == {"float16": 1}
    custom = jmp.autocast(f, "mixed_float16", deny=jmp.casting.DENY | {"tanh"})
    assert jmp.precision_report(custom, jnp.ones((2, 2)), jnp.ones((2, 2))).counts["tanh"] == {
        "float32": 1
    }
    matmul_f32 = jmp.autocast(f, "mixed_float16", allow=set())
    assert jmp.precision_report(matmul_f32, jnp.ones((2, 2)), jnp.ones((2, 2))).counts[
        "dot_general"
    ] == {"float32": 1}


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            dict(deny={"softmax"}),
            ValueError,
            r"Unknown primitive name\(s\) \['softmax'\] in `deny`",
        ),
        (dict(allow="dot_general"), TypeError, "`allow`"),
        (dict(allow={"exp"}), ValueError, r"in both `allow` and `deny`"),
        (dict(policy="mixed_float61"), ValueError, "Unknown dtype or policy name.*'mixed_float16'"),
        (dict(policy=3), TypeError, "`policy`"),
        (dict(static_argnums="x"), TypeError, "`static_argnums`"),
        (dict(static_argnames=[1]), TypeError, "`static_argnames`"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        jmp.autocast(lambda x: x, **kwargs)


def test_shard_map_inside_is_a_clear_error():
    # Explicit axes: JAX's default from 0.9, named so that 0.8 does not warn of the change.
    mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    f = jax.shard_map(lambda x: x @ x.T, mesh=mesh, in_specs=jax.P(), out_specs=jax.P())
    with pytest.raises(NotImplementedError, match="shard_map"):
        jmp.autocast(f)(jnp.ones((2, 2)))


@pytest.mark.standard_promotion  # optax's adam mixes int32 and float
def test_training_with_autocast_and_loss_scaling_matches_float32():
    x = jax.random.normal(jax.random.key(5), (64, 12, 6))
    y = (x.mean(axis=(1, 2)) > 0).astype(jnp.int32) + 2 * (x[:, 0, 0] > 0).astype(jnp.int32)

    def train(policy):
        params = MODEL.init(jax.random.key(2), x)["params"]
        scale = jmp.DynamicLossScale(2.0**15) if policy else jmp.NoOpLossScale()
        tx = jmp.loss_scaling(optax.adam(3e-3), scale)
        opt_state = tx.init(params)
        loss = jmp.autocast(loss_fn, policy) if policy else loss_fn

        @jax.jit
        def step(params, opt_state):
            s = jmp.get_loss_scale(opt_state)
            grads = jax.grad(lambda p: s.scale(loss(p, x, y)))(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        for _ in range(20):
            params, opt_state = step(params, opt_state)
        return float(loss_fn(params, x, y))

    reference = train(None)
    for name in ("mixed_float16", "mixed_bfloat16"):
        final = train(jmp.get_policy(name))
        print(f"\n{name}: final loss {final:.6f} vs float32 {reference:.6f}")
        assert abs(final - reference) <= 0.02 * reference
    assert reference < 0.9  # it learned (chance: log 5 = 1.61)


def test_every_positional_argument_static():
    # Nothing positional is traced: the program has keyword inputs only, or none.
    f = jmp.autocast(lambda n, x=None: (jnp.ones((2, 2)) @ jnp.ones((2, 2))) * n, static_argnums=0)
    assert f(3).dtype == jnp.float32 and float(f(3)[0, 0]) == 6.0
    report = jmp.precision_report(f, 3)
    assert report.counts["dot_general"] == {"float16": 1}


def test_nnx_modules_keep_what_they_write_under_autocast():
    """An NNX module passed to an autocast function keeps the variables it writes (BatchNorm's
    statistics, Dropout's RNG count, a counter of its own), eagerly and under `nnx.jit` +
    `nnx.value_and_grad`, as it would without autocast: before, each call started from the
    same state (the same dropout mask every step, statistics never updated)."""
    import flax_examples as ex
    from flax import nnx

    batch = {"x": jnp.linspace(0, 1, 16)[:, None], "y": jnp.linspace(0, 1, 16)[:, None] ** 2}
    plain, mixed = ex.ToyMLP(1, 8, 1, rngs=nnx.Rngs(0)), ex.ToyMLP(1, 8, 1, rngs=nnx.Rngs(0))
    loss = jmp.autocast(ex._toy_loss, "mixed_float16")
    expected = [float(ex._toy_loss(plain, batch)) for _ in range(3)]
    got = [float(loss(mixed, batch)) for _ in range(3)]
    np.testing.assert_allclose(got, expected, rtol=1e-2)
    assert len(set(got)) == 3  # a new dropout mask each call

    step = nnx.jit(lambda m, b: nnx.value_and_grad(loss)(m, b)[0])
    before = float(mixed.bn.mean[...][0])
    step(mixed, batch)
    step(mixed, batch)
    assert int(mixed.count[...]) == int(plain.count[...]) + 2 == 5
    assert float(mixed.bn.mean[...][0]) != before
    plain_step = nnx.jit(lambda m, b: nnx.value_and_grad(ex._toy_loss)(m, b)[0])
    plain_step(plain, batch)
    plain_step(plain, batch)
    np.testing.assert_allclose(mixed.bn.mean[...], plain.bn.mean[...], rtol=1e-2, atol=1e-3)
