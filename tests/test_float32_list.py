"""The float32 list holds in a model's own code under every integration: `log_softmax`,
`softmax`, `logsumexp`, a sum over thousands of values and segment sums written between
layers (inside `vmap` and `scan` too) compute in float32, read from the traced program of the
training step (forward and backward), while the matmuls stay in half precision."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_policy as jmp
from jmp_policy._reports.census import compute_dtype, iter_equations, report_of_jaxpr
from jmp_policy.autocast import cast_at_use

eqx = pytest.importorskip("equinox")

INTEGRATIONS = ("linen.mixed_precision", "nnx.mixed_precision", "eqx.mixed_precision", "autocast")
FLOAT32_LIST = ("exp", "log", "reduce_sum", "scatter-add", "reduce_max")


def _head(h, segments):
    """What a model writes after its last layer: a policy head's log-probabilities and
    probabilities, a normaliser, a sum over 4,096 values, per-segment sums (inside `vmap`), a
    running sum over steps (`scan`)."""
    logp = jax.nn.log_softmax(h, axis=-1) + jax.nn.softmax(h, axis=-1)
    normaliser = jax.nn.logsumexp(h, axis=-1)
    total = jnp.sum(h * h) / h.size
    per_row = jax.vmap(lambda row: jax.ops.segment_sum(row, segments, 8))(h)

    def running(carry, row):
        return carry + jax.ops.segment_sum(row, segments, 8), None

    scanned, _ = jax.lax.scan(running, jnp.zeros(8, h.dtype), h)
    return jnp.mean(logp) + jnp.mean(normaliser) + total + jnp.mean(per_row) + jnp.mean(scanned)


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x, segments):
        return _head(nn.Dense(4096)(x), segments)


class NnxModel(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(16, 4096, rngs=rngs)

    def __call__(self, x, segments):
        return _head(self.dense(x), segments)


def _eqx_model():
    class EqxModel(eqx.Module):
        dense: eqx.nn.Linear

        def __call__(self, x, segments):
            return _head(jax.vmap(self.dense)(x), segments)

    return EqxModel(eqx.nn.Linear(16, 4096, key=jax.random.key(0)))


def _loss(integration, policy):
    """`(loss(weights, x, segments), weights)` under `integration`."""
    if integration in ("linen.mixed_precision", "autocast"):
        module = LinenModel()
        x, segments = jnp.ones((4, 16)), jnp.arange(4096) % 8
        params = module.init(jax.random.key(0), x, segments)["params"]
        if integration == "autocast":
            return jmp.autocast(lambda p, x, s: module.apply({"params": p}, x, s), policy), params
        mixed = jmp.linen.mixed_precision(module, policy)
        return (lambda p, x, s: mixed.apply({"params": p}, x, s)), params
    if integration == "nnx.mixed_precision":
        model = jmp.nnx.mixed_precision(NnxModel(nnx.Rngs(0)), policy)
        graphdef, state = nnx.split(model)
        return (lambda st, x, s: nnx.merge(graphdef, st)(x, s)), state
    model = jmp.eqx.mixed_precision(_eqx_model(), policy)
    weights, static = eqx.partition(model, eqx.is_inexact_array)
    return (lambda w, x, s: eqx.combine(w, static)(x, s)), weights


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("integration", INTEGRATIONS)
def test_the_models_own_log_softmax_sums_and_segment_sums_run_in_float32(integration, policy):
    loss, weights = _loss(integration, jmp.get_policy(policy))
    x, segments = jnp.ones((4, 16)), jnp.arange(4096) % 8
    program = jax.make_jaxpr(jax.value_and_grad(loss))(weights, x, segments)
    by_op: dict[str, set] = {}
    for eqn in iter_equations(program):
        dtype = compute_dtype(eqn)
        if dtype is not None:
            by_op.setdefault(eqn.primitive.name, set()).add(np.dtype(dtype).name)
    for op in FLOAT32_LIST:
        assert by_op.get(op) == {"float32"}, (op, by_op.get(op))
    # (the forward pass's: XLA:CPU widens a bfloat16 weight gradient's matmul, `matmul.py`)
    assert report_of_jaxpr(jax.make_jaxpr(loss)(weights, x, segments)).half_matmul_flop_share == 1


def _feeding(program, consumer: str) -> list:
    """The equation that makes the first operand of each `consumer` equation, read through
    casts (None where a program's input does), in `program` and its sub-programs."""
    from jmp_policy._core import jaxpr as _jaxpr

    found = []

    def visit(jaxpr):
        jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
        made = _jaxpr.producers(jaxpr)
        for eqn in jaxpr.eqns:
            for sub in _jaxpr.sub_programs(eqn):
                visit(sub)
            if eqn.primitive.name != consumer:
                continue
            source = made.get(eqn.invars[0])
            while source is not None and source.primitive.name == "convert_element_type":
                source = made.get(source.invars[0])
            found.append(source)

    visit(program)
    return found


def _shifts_before_exp(program) -> list[str]:
    """The dtype of each `x - max(x)` that an `exp` takes (softmax's and log-softmax's shift)."""
    return [
        np.dtype(compute_dtype(source)).name
        for source in _feeding(program, "exp")
        if source is not None and source.primitive.name == "sub"
    ]


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("integration", INTEGRATIONS)
def test_softmaxs_shift_by_its_maximum_computes_in_float32(integration, policy):
    """The shift `x - max(x)` before softmax's and log-softmax's `exp` computes in float32 in
    every integration, the maximum too (a half-precision shift rounds every logit it moves);
    the routes agree on it where the program holds no float32 request of the model's."""
    loss, weights = _loss(integration, jmp.get_policy(policy))
    x, segments = jnp.ones((4, 16)), jnp.arange(4096) % 8
    program = jax.make_jaxpr(jax.value_and_grad(loss))(weights, x, segments)
    shifts = _shifts_before_exp(program)
    assert len(shifts) >= 3 and set(shifts) == {"float32"}, shifts  # log_softmax, softmax, lse


def test_a_float32_list_result_cast_to_integers_is_integers():
    """Under `cast_at_use` a float32-list result is held in float32 past a cast down to 16
    bits; a cast to integers (an index the model computes) is a cast all the same."""
    from jmp_policy.autocast import cast_at_use

    def f(w, x, table):
        h = x.astype(jnp.float16) @ w.astype(jnp.float16)
        index = jnp.exp(h).astype(jnp.int32)  # exp: the float32 list
        return jnp.take(table, index * 2 + 1, axis=0, mode="clip")

    w, x = jnp.full((4, 3), 0.25), jnp.arange(8.0).reshape(2, 4) / 8
    table = jnp.arange(10.0)
    got = jax.jit(cast_at_use(f))(w, x, table)
    np.testing.assert_array_equal(got, f(w, x, table))
    assert got.dtype == jnp.float32


@pytest.mark.parametrize("route", ["autocast", "cast_at_use"])
def test_a_maximums_derivative_sums_its_ties_in_float32(route):
    """`jnp.max` of half-precision values in a loss: JAX's derivative sums the tangents of the
    entries that tie for the maximum, and counts them, in the operand's dtype; here in float32,
    the gradient split over the ties as float32's is."""
    w = jnp.tile(jnp.linspace(-1.0, 1.0, 8)[:, None], (1, 4))  # 4 equal columns: ties
    x = jax.random.normal(jax.random.key(0), (16, 8))

    def loss(w, x):
        h = x.astype(jnp.float16) @ w.astype(jnp.float16)
        return jnp.sum(jnp.max(h, axis=-1).astype(jnp.float32))

    run = jmp.autocast(loss) if route == "autocast" else cast_at_use(loss)
    program = jax.make_jaxpr(jax.grad(run))(w, x)
    sums = [
        np.dtype(compute_dtype(e)).name
        for e in iter_equations(program)
        if e.primitive.name == "reduce_sum"
    ]
    assert sums and set(sums) == {"float32"}, sums
    got = jax.grad(run)(w, x)
    want = jax.grad(lambda w, x: jnp.sum(jnp.max(x @ w, axis=-1)))(w, x)  # float32, same ties
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)


def _rms_norm(x, scale):
    """A user's RMSNorm, written without casts: `jnp.mean` sums in float32 and hands back the
    operand's dtype, and the epsilon is added to what it returns."""
    variance = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(variance + 1e-6) * (1 + scale)


class LinenLookup(nn.Module):
    """Rows of the model's own table (a raw parameter, no `nn.Embed`), normalised, then a layer."""

    @nn.compact
    def __call__(self, ids):
        table = self.param("table", nn.initializers.normal(0.02), (32, 16))
        scale = self.param("scale", nn.initializers.zeros, (16,))
        return nn.Dense(8)(_rms_norm(jnp.take(table, ids, axis=0), scale))


class NnxLookup(nnx.Module):
    def __init__(self, rngs):
        self.table = nnx.Param(jax.random.normal(rngs.params(), (32, 16)) * 0.02)
        self.scale = nnx.Param(jnp.zeros(16))
        self.dense = nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, ids):
        return self.dense(_rms_norm(jnp.take(self.table[...], ids, axis=0), self.scale[...]))


def _epsilon_sums(program) -> list:
    """The dtype of what each `rsqrt` takes (a norm's variance plus its epsilon)."""
    return [
        None if source is None else np.dtype(compute_dtype(source)).name
        for source in _feeding(program, "rsqrt")
    ]


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("integration", INTEGRATIONS[:2] + ("autocast",))
def test_a_norm_of_a_tables_rows_adds_its_epsilon_in_float32(integration, policy):
    """A statistic of weights alone (an RMSNorm of rows the model takes from its own table,
    before any activation) is computed on the float32 weights, and the float32 arithmetic on
    it (the epsilon added to the variance) stays in float32, forward and backward, in every
    route: the Linen policy added it in 16 bits while autocast added it in float32."""
    ids = jnp.arange(6).reshape(2, 3)
    if integration == "nnx.mixed_precision":
        model = jmp.nnx.mixed_precision(NnxLookup(nnx.Rngs(0)), policy)
        graphdef, weights = nnx.split(model)
        loss = lambda w: jnp.sum(nnx.merge(graphdef, w)(ids).astype(jnp.float32))  # noqa: E731
    else:
        module = LinenLookup()
        weights = module.init(jax.random.key(0), ids)
        apply = (
            jmp.autocast(module.apply, policy)
            if integration == "autocast"
            else jmp.linen.mixed_precision(module, policy).apply
        )
        loss = lambda w: jnp.sum(apply(w, ids).astype(jnp.float32))  # noqa: E731
    sums = _epsilon_sums(jax.make_jaxpr(jax.grad(loss))(weights))
    assert sums and set(sums) == {"float32"}, sums
