"""Activations stay in the compute dtype between float32 islands (`jmp_policy.activations`)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend import core as jcore
from models import GPT, residual_bytes

import jmp_policy as jmp
from jmp_policy.activations import ACTIVATION, ISLAND, STATISTIC, WEIGHT, meet

TOKENS = jax.random.randint(jax.random.key(0), (2, 32), 0, 64)
MODEL = GPT(dim=64, length=32, layers=1)
PARAMS = jax.jit(MODEL.init)(jax.random.key(1), TOKENS)["params"]


def _loss(model):
    def loss(params):
        logits = model.apply({"params": params}, TOKENS)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), TOKENS
        ).mean()

    return loss


def test_the_rule():
    f16, f32 = np.dtype(np.float16), np.dtype(np.float32)
    assert meet([f16, f32], [ACTIVATION, WEIGHT]) == (f16, ACTIVATION)  # a bias add
    assert meet([f16, f32], [ACTIVATION, ISLAND]) == (f16, ACTIVATION)  # an island handed back
    assert meet([f16, f32], [ACTIVATION, STATISTIC]) == (f32, ISLAND)  # x - mean
    assert meet([f32, f32], [ISLAND, STATISTIC]) == (f32, ISLAND)  # softmax's quotient
    assert meet([f32, f32], [STATISTIC, WEIGHT]) == (f32, STATISTIC)  # var + eps
    assert meet([f32, f32], [WEIGHT, WEIGHT]) == (f32, WEIGHT)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_autocast_keeps_at_most_what_flax_own_dtype_keeps(policy):
    half = jmp.get_policy(policy).compute_dtype
    full = sum(residual_bytes(_loss(MODEL), PARAMS).values())
    with jax.numpy_dtype_promotion("standard"):  # Flax's own model mixes dtypes as written
        own = residual_bytes(_loss(GPT(dim=64, length=32, layers=1, dtype=half)), PARAMS)
    own = sum(own.values())
    ours = residual_bytes(jmp.autocast(_loss(MODEL), policy), PARAMS)
    assert sum(ours.values()) <= min(own, 0.6 * full), (ours, own, full)


def test_no_float32_activation_is_kept_in_the_blocks():
    # Activation-sized residuals (a token's features, attention weights, MLP activations) are
    # half precision in every block: the float32 ones belong to the model's float32 input (the
    # embedding sum and the first LayerNorm on it, as traced), so a deeper model adds none.
    from jax._src.ad_checkpoint import saved_residuals

    def kept(layers):
        model = GPT(dim=64, length=32, layers=layers)
        params = jax.jit(model.init)(jax.random.key(1), TOKENS)["params"]
        found = saved_residuals(jmp.autocast(_loss(model), "mixed_float16"), params)
        big = [a for a, why in found if "argument" not in why and a.size >= TOKENS.size * 64]
        return [a for a in big if a.dtype == jnp.float32], [
            a for a in big if a.dtype != jnp.float32
        ]

    (wide_1, half_1), (wide_3, half_3) = kept(1), kept(3)
    assert len(wide_3) == len(wide_1)
    assert len(half_3) > len(half_1)


def test_no_widen_op_narrow_pair_in_a_block():
    # A bias add runs in half precision: no value is widened, added to and narrowed back.
    block = GPT(dim=64, length=32, layers=1)
    jaxpr = jax.make_jaxpr(jmp.autocast(lambda p: block.apply({"params": p}, TOKENS)))(PARAMS)
    program = jaxpr.eqns[0].params["jaxpr"].jaxpr
    widened = {
        e.outvars[0]
        for e in program.eqns
        if e.primitive.name == "convert_element_type"
        and e.invars[0].aval.dtype == jnp.float16
        and e.outvars[0].aval.dtype == jnp.float32
    }
    narrowing = [
        e
        for e in program.eqns
        if e.primitive.name == "convert_element_type" and e.outvars[0].aval.dtype == jnp.float16
    ]
    producers = {v: e for e in program.eqns for v in e.outvars}
    for e in narrowing:
        made = producers.get(e.invars[0])
        if made is not None and made.primitive.name in ("add", "sub", "mul"):
            assert not any(v in widened for v in made.invars), made
    # ...and every add that takes a matmul's output (the bias adds, the residual adds) stays
    # in half precision (torch's "promote" made them float32).
    adds = [
        e
        for e in program.eqns
        if e.primitive.name == "add"
        and any(
            not isinstance(v, jcore.Literal)
            and producers.get(v) is not None
            and producers[v].primitive.name in ("dot_general", "custom_vjp_call")
            and v.aval.dtype == jnp.float16  # a matmul's output, not an island op's
            for v in e.invars
        )
    ]
    assert len(adds) >= 4
    assert {e.outvars[0].aval.dtype for e in adds} == {jnp.dtype(jnp.float16)}


def test_a_fully_masked_row_stays_finite():
    # finfo(float32).min cast to a half format would be -inf: the cast saturates instead.
    def attend(w, x, mask):
        logits = jnp.where(mask, x @ w, jnp.finfo(jnp.float32).min)
        return jax.nn.softmax(logits, axis=-1)

    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    mask = jnp.array([[1, 1, 0, 0], [0, 0, 0, 0]], bool)
    for policy in ("mixed_float16", "mixed_bfloat16"):
        mixed = jmp.autocast(attend, policy)
        out = jax.jit(mixed)(w, x, mask)
        np.testing.assert_allclose(out, [[0.5, 0.5, 0, 0], [0.25] * 4])
        grad = jax.jit(jax.grad(lambda w, mixed=mixed: mixed(w, x, mask).sum()))(w)
        assert np.isfinite(grad).all()


@pytest.mark.parametrize("policy,rtol", [("mixed_float16", 2e-2), ("mixed_bfloat16", 1e-1)])
def test_gradients_match_float32(policy, rtol):
    loss = _loss(MODEL)
    want = jax.jit(jax.grad(loss))(PARAMS)
    got = jax.jit(jax.grad(jmp.autocast(loss, policy)))(PARAMS)
    # Against the gradient's global scale: some leaves' true gradient is zero (a key bias:
    # softmax does not see a shift shared by every key).
    scale = max(float(jnp.abs(w).max()) for w in jax.tree.leaves(want))
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        assert g.dtype == jnp.float32
        assert float(jnp.abs(g - w).max()) <= rtol * scale
    np.testing.assert_allclose(
        jax.jit(jmp.autocast(loss, policy))(PARAMS), jax.jit(loss)(PARAMS), rtol=rtol / 4
    )


def test_equinox_keeps_no_more_than_mpx_would():
    # MPX casts the whole model to half precision; eqx.mixed_precision keeps the float32 list
    # in float32 and must still keep at most the bytes of a model cast whole.
    model = eqx.nn.MLP(16, 4, 64, 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (32, 16))

    def bytes_of(model):
        arrays, static = eqx.partition(model, eqx.is_array)

        def loss(arrays):
            out = jax.vmap(eqx.combine(arrays, static))(x)
            return jax.nn.logsumexp(out.astype(jnp.float32), axis=-1).mean()

        return sum(residual_bytes(loss, arrays).values())

    whole = jax.tree.map(lambda a: a.astype(jnp.float16) if eqx.is_inexact_array(a) else a, model)
    with jax.numpy_dtype_promotion("standard"):  # a model cast whole mixes dtypes
        assert bytes_of(jmp.eqx.mixed_precision(model, "mixed_float16")) <= bytes_of(whole)
