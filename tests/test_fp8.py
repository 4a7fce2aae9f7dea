"""float8 matmuls: the math, checked against float32 and Flax, and delayed-scaling state."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import fp8_ops

import jmp_policy as jmp
from jmp_policy.fp8 import (
    E4M3,
    E5M2,
    DelayedScaling,
    Fp8DotGeneral,
    combine_microbatches,
    compute_scale,
    fp8_dot_general,
    fp8_dot_general_delayed,
    fp8_eligible,
    fp8_max,
    next_state,
    quantize,
)

# Toy models whose last matmul is meant to multiply in float8 or a block-scaled format: the
# warning that names such a head (the logits head, by structure) is asserted in
# tests/test_float8_reports.py and where a test here asks for it.
_HEAD_IN_LOW_PRECISION = pytest.mark.filterwarnings(
    "ignore:jmp_policy. .* is the last matmul before the output:jmp_policy.errors.PrecisionWarning"
)
pytestmark = _HEAD_IN_LOW_PRECISION

MATMUL = (((1,), (0,)), ((), ()))


def _values(key, shape, amax):
    """Random values whose largest magnitude is exactly `amax`."""
    x = jax.random.uniform(jax.random.key(key), shape, minval=-amax, maxval=amax)
    return x.at[(0,) * len(shape)].set(amax).astype(jnp.float32)


def _reference_qdq(x, dtype, scale):
    """x*scale saturated and rounded to `dtype` (NumPy), returned as float32 values."""
    top = np.float32(fp8_max(dtype))
    q = np.clip(np.asarray(x, np.float32) * np.float32(scale), -top, top).astype(dtype)
    return jnp.asarray(q.astype(np.float32))


@jax.jit
def _float32_dot(a, b, scale_a, scale_b):
    """The dequantized float32 matmul: (a @ b) / (scale_a * scale_b), under jit like ours."""
    return jnp.dot(a, b, precision="highest") / (scale_a * scale_b)


def test_scale_rule_matches_flax_and_transformer_engine():
    amax = jnp.array([3.5, 0.0, jnp.inf, jnp.nan, 1e-3, 1e-40], jnp.float32)
    previous = jnp.float32(2.0)
    for dtype in (E4M3, E5M2):
        ours = compute_scale(amax, previous, dtype)
        # Flax (TransformerEngine's rule) stores the reciprocal, the dequantization scale.
        theirs = fp8_ops.compute_scale(amax, 1.0 / previous, fp8_max(dtype))
        np.testing.assert_array_equal(1.0 / ours[:5], theirs[:5])
        # amax 0, inf, NaN: the previous scale is kept.
        np.testing.assert_array_equal(ours[1:4], [2.0, 2.0, 2.0])
        # A denormal amax would give an infinite scale: kept too (Flax returns 0).
        assert float(ours[5]) == 2.0
    np.testing.assert_array_equal(compute_scale(jnp.float32(3.5), 1.0, E4M3), 128.0)
    np.testing.assert_array_equal(compute_scale(jnp.float32(3.5), 1.0, E4M3, margin=1), 64.0)
    pow2 = compute_scale(jnp.float32(3.0), 1.0, E4M3, power_of_two=True)
    assert float(pow2) == 128.0  # 448 / 3 = 149.3, rounded down to a power of two


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_casts_saturate_at_448_and_57344(dtype):
    top = fp8_max(dtype)
    assert top == {E4M3: 448.0, E5M2: 57344.0}[dtype]
    x = jnp.array([top * 4, -top * 4, jnp.inf, -jnp.inf, jnp.nan, 1.0], jnp.float32)
    q = np.asarray(quantize(x, dtype, 1.0).astype(jnp.float32))
    np.testing.assert_array_equal(q[:2], [top, -top])
    # An inf is not saturated away: NaN, as a NaN stays, so the finite check sees it.
    assert np.isnan(q[2:5]).all() and q[5] == 1.0
    # Flax's quantize saturates the finite values the same way.
    np.testing.assert_array_equal(
        fp8_ops.quantize(x[:2], dtype, jnp.float32(1.0), jnp.float32).astype(jnp.float32), q[:2]
    )


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_forward_and_gradients_are_the_float32_reference_of_the_same_math(fmt):
    x, w = _values(0, (16, 32), 3.0), _values(1, (32, 8), 0.7)
    cotangent = _values(2, (16, 8), 5.0)

    def f(x, w):
        return fp8_dot_general(x, w, MATMUL, fmt=fmt)

    out, vjp = jax.vjp(jax.jit(f), x, w)
    dx, dw = vjp(cotangent)
    # The same math on float32 values: scales from each tensor's amax, the
    # operands rounded to float8 and back, a float32 matmul, then unscaled.
    sx, sw = np.float32(448.0) / np.float32(3.0), np.float32(448.0) / np.float32(0.7)
    qx, qw = _reference_qdq(x, E4M3, sx), _reference_qdq(w, E4M3, sw)
    np.testing.assert_array_equal(out, _float32_dot(qx, qw, sx, sw))
    gdtype = E5M2 if fmt == "hybrid" else E4M3
    sg = np.float32(fp8_max(gdtype)) / np.float32(5.0)
    qg = _reference_qdq(cotangent, gdtype, sg)
    np.testing.assert_array_equal(dx, _float32_dot(qg, qw.T, sg, sw))
    np.testing.assert_array_equal(dw, _float32_dot(qx.T, qg, sg, sx))
    # ... and close to the float32 matmul: e4m3 keeps 3 mantissa bits.
    np.testing.assert_allclose(out, x @ w, atol=0.1 * float(jnp.abs(x @ w).max()))


def test_every_matmul_has_float8_operands():
    x, w = _values(0, (4, 8), 1.0), _values(1, (8, 2), 1.0)
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: fp8_dot_general(x, w, MATMUL).sum(), (0, 1)))(x, w)
    dots = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                dots.append(tuple(v.aval.dtype for v in eqn.invars))
        for sub in jax.extend.core.subjaxprs(jaxpr):
            walk(sub)

    walk(jaxpr.jaxpr)
    # The forward dot on two e4m3 operands; both backward dots take the e5m2 gradient.
    assert dots[0] == (E4M3, E4M3)
    assert [sorted(d.name for d in dot) for dot in dots[1:]] == [
        ["float8_e4m3fn", "float8_e5m2"]
    ] * 2, dots
    assert len(dots) == 3


def test_gradients_equal_flax_fp8_direct_dot_general_on_the_same_scales():
    # Amaxes whose scales are powers of two (448/3.5 = 128, 448/1.75 = 256,
    # 57344/0.875 = 65536): Flax divides by the reciprocal scale and we
    # multiply by the scale, which agree exactly only then.
    x, w = _values(0, (8, 16), 3.5), _values(1, (16, 4), 1.75)
    cotangent = _values(2, (8, 4), 0.875)
    op = fp8_ops.Fp8DirectDotGeneralOp()
    variables = op.init(jax.random.key(0), x, w, MATMUL)
    state = dict(variables["_overwrite_with_gradient"])
    # Flax's delayed scaling takes the new scale from the amax history: give it
    # these tensors' amaxes, so its scales are the ones current scaling computes.
    for name, amax in (("input", 3.5), ("kernel", 1.75), ("output_grad", 0.875)):
        state[f"{name}_amax_history"] = state[f"{name}_amax_history"].at[0].set(amax)

    def flax_loss(x, w):
        y = op.apply({"_overwrite_with_gradient": state}, x, w, MATMUL)
        return (y * cotangent).sum()

    def our_loss(x, w):
        return (fp8_dot_general(x, w, MATMUL) * cotangent).sum()

    ours = jax.grad(our_loss, (0, 1))(x, w)
    theirs = jax.grad(flax_loss, (0, 1))(x, w)
    np.testing.assert_array_equal(ours[0], theirs[0])
    np.testing.assert_array_equal(ours[1], theirs[1])
    np.testing.assert_array_equal(
        fp8_dot_general(x, w, MATMUL), op.apply({"_overwrite_with_gradient": state}, x, w, MATMUL)
    )


def test_batched_dimension_numbers_and_dtypes():
    # Attention-style: a batch dimension, contracting the last axis of both.
    q, k = _values(0, (2, 5, 8), 2.0), _values(1, (2, 7, 8), 2.0)
    dn = (((2,), (2,)), ((0,), (0,)))
    out = fp8_dot_general(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), dn)
    assert out.dtype == jnp.bfloat16 and out.shape == (2, 5, 7)
    exact = jnp.einsum("bqd,bkd->bqk", q, k)
    np.testing.assert_allclose(out.astype(jnp.float32), exact, atol=0.15 * float(abs(exact).max()))
    grads = jax.grad(lambda a, b: fp8_dot_general(a, b, dn).astype(jnp.float32).sum(), (0, 1))(
        q.astype(jnp.bfloat16), k.astype(jnp.bfloat16)
    )
    assert [g.dtype for g in grads] == [jnp.bfloat16, jnp.bfloat16]
    assert [g.shape for g in grads] == [q.shape, k.shape]
    assert fp8_dot_general(q, k, dn, out_dtype=jnp.float16).dtype == jnp.float16


def test_bad_format_is_refused():
    with pytest.raises(ValueError, match="`fmt`.*'hybrid'"):
        fp8_dot_general(jnp.ones((2, 2)), jnp.ones((2, 2)), MATMUL, fmt="e5m2")


def test_exported_for_cuda_the_module_keeps_float8_operands():
    # What a GPU compiles: the float8 types must survive lowering, or XLA
    # could never pick an fp8 GEMM.
    step = jax.jit(jax.value_and_grad(lambda x, w: fp8_dot_general(x, w, MATMUL).sum(), (0, 1)))
    exported = jax.export.export(step, platforms=("cuda",))(
        jax.ShapeDtypeStruct((16, 32), jnp.float32), jax.ShapeDtypeStruct((32, 16), jnp.float32)
    )
    module = exported.mlir_module()
    dots = [line for line in module.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 3
    assert all("f8E4M3FN" in line for line in dots)
    assert sum("f8E5M2" in line for line in dots) == 2


def test_mixed_float8_is_a_policy_name():
    policy = jmp.get_policy("mixed_float8")
    assert str(policy) == "params=float32,compute=float8_e4m3fn,output=float32"
    assert jmp.get_policy(str(policy)) == policy
    with pytest.raises(ValueError, match="Did you mean 'mixed_float8'"):
        jmp.get_policy("mixed_fp8")


def _mlp(params, x):
    for w in params[:-1]:
        x = jax.nn.relu(x @ w)
    return x @ params[-1]


def _mlp_params(sizes=(64, 128, 64, 10)):
    keys = jax.random.split(jax.random.key(0), len(sizes) - 1)
    return [
        jax.random.normal(k, (m, n)) / m**0.5
        for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def test_autocast_mixed_float8_runs_the_eligible_matmuls_in_float8():
    params, x = _mlp_params(), _values(3, (32, 64), 2.0)

    def loss(params, x):
        return jax.nn.logsumexp(_mlp(params, x), axis=-1).mean()

    cast = jmp.autocast(loss, "mixed_float8")
    forward = jmp.precision_report(cast, params, x).counts["dot_general"]
    backward = jmp.precision_report(jax.grad(cast), params, x).counts["dot_general"]
    print(f"forward dots: {forward}; with the backward pass: {backward}")
    # 64->128 and 128->64 in float8; the 10-wide head (N not a multiple of 16) in bfloat16.
    assert forward == {"float8_e4m3fn": 2, "bfloat16": 1}
    assert backward["float8_e5m2"] == 4 and backward["float8_e4m3fn"] == 2
    value, grads = jax.jit(jax.value_and_grad(cast))(params, x)
    assert value.dtype == jnp.float32 and [g.dtype for g in grads] == [jnp.float32] * 3
    np.testing.assert_allclose(value, loss(params, x), rtol=0.02)
    assert (
        fp8_eligible((32, 64), (64, 10), MATMUL) == "N (output width) = 10 is not a multiple of 16"
    )


@pytest.mark.standard_promotion
def test_mlp_trains_under_mixed_float8_as_under_mixed_bfloat16():
    import optax

    x = _values(4, (256, 64), 2.0)
    labels = jnp.argmax(x[:, :10], axis=-1)  # learnable from the inputs

    def loss(params, x, labels):
        logits = _mlp(params, x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def train(policy, steps=30):
        fn = jmp.autocast(loss, policy)
        tx = optax.adam(3e-3)
        params = _mlp_params()

        @jax.jit
        def step(params, state):
            value, grads = jax.value_and_grad(fn)(params, x, labels)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, value

        state = tx.init(params)
        for _ in range(steps):
            params, state, value = step(params, state)
        return float(loss(params, x, labels))

    final = {policy: train(policy) for policy in ("float32", "mixed_bfloat16", "mixed_float8")}
    print(f"final training loss: {final}")
    assert final["float32"] < 0.2  # it learned (from 2.3), and is still learning
    # float8 matmuls end within 10% of bfloat16's loss (measured: 0.0686 against 0.0657).
    assert final["mixed_float8"] < 1.10 * final["mixed_bfloat16"]


def test_precision_report_gives_the_float8_share_and_the_matmuls_left_out():
    params = {
        "w1": _values(5, (64, 128), 0.1),
        "w2": _values(6, (128, 64), 0.1),
        "head": _values(7, (64, 10), 0.1),
    }
    x = _values(8, (32, 64), 1.0)

    def loss(params, x):
        h = jax.nn.relu(x @ params["w1"])
        h = jmp.full_precision(lambda h: h @ params["w2"])(h)  # kept in float32 on purpose
        return jax.nn.logsumexp(h @ params["head"], axis=-1).mean()

    report = jmp.precision_report(jmp.autocast(loss, "mixed_float8"), params, x)
    print(report)
    # FLOPs: 2*32*64*128 in float8, as many in float32, 2*32*64*10 in bfloat16.
    assert report.fp8_matmul_flop_share == pytest.approx(524288 / (2 * 524288 + 40960))
    assert [(d, r) for d, r, _ in report.fp8_left_out] == [
        ("float32", "its operands are float32 (the model's own cast, or a layer's dtype)"),
        ("bfloat16", "N (output width) = 10 is not a multiple of 16"),
    ]
    assert "matmul/conv FLOPs in float8: 48.1%" in str(report)
    plain = jmp.precision_report(jmp.autocast(loss, "mixed_bfloat16"), params, x)
    assert plain.fp8_matmul_flop_share == 0.0 and plain.fp8_left_out == ()


def _flax_fp8_step(op, variables, x, w, cotangent):
    """One step of Flax's Fp8DirectDotGeneralOp: output, input grads, and its new fp8 state.

    Flax returns the new state in place of the gradient of its
    `_overwrite_with_gradient` collection.
    """

    def loss(x, w, fp8):
        y = op.apply({"_overwrite_with_gradient": fp8}, x, w, MATMUL)
        return (y * cotangent).sum(), y

    (_, y), (dx, dw, fp8) = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(x, w, variables)
    return y, dx, dw, fp8


def test_delayed_scaling_equals_flax_over_steps():
    # Amaxes whose scales are powers of two, so Flax's division by the
    # reciprocal scale and our multiplication agree exactly. Flax's rule for the gradients
    # has no headroom for a loss scale's growth (grad_margin=0).
    recipe = DelayedScaling(history_length=4, grad_margin=0)
    state = recipe.init()
    w = _values(1, (16, 8), 1.75)
    op = fp8_ops.Fp8DirectDotGeneralOp(amax_history_length=4)
    flax_state = op.init(jax.random.key(0), _values(0, (4, 16), 1.0), w, MATMUL)
    flax_state = flax_state["_overwrite_with_gradient"]

    @jax.jit
    def ours(state, x, w, cotangent):
        (out, new_state), vjp = jax.vjp(
            lambda x, w, s: fp8_dot_general_delayed(x, w, MATMUL, s, recipe), x, w, state
        )
        dx, dw, state_grads = vjp((cotangent, jax.tree.map(jnp.zeros_like, new_state)))
        return out, dx, dw, next_state(new_state, state_grads, recipe)

    for step, (x_amax, g_amax) in enumerate([(3.5, 0.875), (7.0, 0.4375), (3.5, 1.75)]):
        x, cotangent = _values(10 + step, (4, 16), x_amax), _values(20 + step, (4, 8), g_amax)
        out, dx, dw, state = ours(state, x, w, cotangent)
        y, fdx, fdw, flax_state = _flax_fp8_step(op, flax_state, x, w, cotangent)
        for ours_value, theirs in ((out, y), (dx, fdx), (dw, fdw)):
            np.testing.assert_array_equal(ours_value, theirs)
        metas = {"input": state.lhs, "kernel": state.rhs, "output_grad": state.grad}
        for name, ours_meta in metas.items():
            np.testing.assert_array_equal(
                ours_meta.amax_history, flax_state[f"{name}_amax_history"]
            )
            # Flax keeps the reciprocal (the dequantization scale).
            np.testing.assert_array_equal(1.0 / ours_meta.scale, flax_state[f"{name}_scale"][0])
    print("histories after 3 steps:", state.lhs.amax_history, state.grad.amax_history)
    assert float(state.lhs.scale) == 64.0  # 448 / max(3.5, 7.0): the history's max
    np.testing.assert_array_equal(state.grad.amax_history, [1.75, 0.0, 0.875, 0.4375])


@pytest.mark.standard_promotion
def test_delayed_state_threads_through_scan_jit_donation_and_loss_scaling():
    import optax

    layers, recipe = 3, DelayedScaling(history_length=8, amax_from="most_recent")
    params = jnp.stack([_values(30 + i, (32, 32), 0.5 / (i + 1)) for i in range(layers)])
    fp8_state = jax.tree.map(lambda *s: jnp.stack(s), *[recipe.init() for _ in range(layers)])
    x = _values(40, (8, 32), 1.0)
    tx = jmp.loss_scaling(optax.sgd(1e-3), jmp.DynamicLossScale(2.0**4))

    def loss_fn(params, fp8_state, scale):
        def layer(h, p_s):
            p, s = p_s
            h, s = fp8_dot_general_delayed(h, p, MATMUL, s, recipe)
            return jnp.tanh(h), s

        h, fp8_state = jax.lax.scan(layer, x, (params, fp8_state))  # one state per layer
        return scale.scale((h**2).mean()), fp8_state

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def step(params, fp8_state, opt_state):
        scale = jmp.get_loss_scale(opt_state)
        (_, new_state), (grads, state_grads) = jax.value_and_grad(
            loss_fn, argnums=(0, 1), has_aux=True
        )(params, fp8_state, scale)
        fp8_state = next_state(new_state, state_grads, recipe)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), fp8_state, opt_state

    opt_state = tx.init(params)
    for _ in range(3):
        params, fp8_state, opt_state = step(params, fp8_state, opt_state)
    kernel_amax = fp8_state.rhs.amax_history[:, 0]
    print("per-layer kernel amax:", kernel_amax, "grad amax:", fp8_state.grad.amax_history[:, 0])
    # Each layer records its own kernel's amax (0.5, 0.25, 0.1667 before 3 tiny SGD steps) ...
    np.testing.assert_allclose(kernel_amax, [0.5, 0.25, 0.5 / 3], rtol=1e-3)
    # ... three steps of history (Flax's layout: the latest at 0, the one
    # before at the end), and scales from the amax before the latest (most_recent).
    history = fp8_state.rhs.amax_history
    assert ((history > 0).sum(axis=1) == 3).all()
    np.testing.assert_allclose(fp8_state.rhs.scale, 448.0 / history[:, -1], rtol=1e-6)
    # The output gradients' amaxes came back through the backward pass.
    assert ((fp8_state.grad.amax_history > 0).sum(axis=1) == 3).all()
    assert int(opt_state.applied_steps) == 3


def test_delayed_scaling_recipe_is_validated_when_built():
    with pytest.raises(ValueError, match="`history_length`"):
        DelayedScaling(history_length=0)
    with pytest.raises(ValueError, match="`amax_from`.*'most_recent'"):
        DelayedScaling(amax_from="mean")
    with pytest.raises(ValueError, match="`fmt`"):
        DelayedScaling(fmt="e5m2")
    with pytest.raises(ValueError, match="grad_margin"):
        DelayedScaling(grad_margin=-1)
    with pytest.raises(TypeError, match="`recipe`"):
        fp8_dot_general_delayed(jnp.ones((2, 2)), jnp.ones((2, 2)), MATMUL, None, "delayed")  # type: ignore[arg-type]


def test_delayed_state_round_trips_through_an_orbax_checkpoint(tmp_path):
    import orbax.checkpoint as ocp

    recipe = DelayedScaling(history_length=4)
    x, w = _values(0, (4, 16), 3.5), _values(1, (16, 16), 1.75)
    _, state = fp8_dot_general_delayed(x, w, MATMUL, recipe.init(), recipe)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "fp8", state)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(
            tmp_path / "fp8", jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        )
    assert isinstance(restored, type(state))
    jax.tree.map(np.testing.assert_array_equal, restored, state)
    np.testing.assert_array_equal(restored.lhs.amax_history, [3.5, 0.0, 0.0, 0.0])


def _linen_model(fp8_layers):
    """Dense 32->64, LayerNorm, Dense 64->64, a 64-wide head; Fp8DotGeneral given by hand?"""
    from flax import linen as nn

    dot = Fp8DotGeneral() if fp8_layers else None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.LayerNorm()(nn.Dense(64, dot_general=dot)(x)))
            x = nn.Dense(64, dot_general=dot)(x)
            return nn.Dense(64, name="head")(x)

    return Model()


def _dot_dtypes(fn, *args):
    return jmp.precision_report(fn, *args).counts["dot_general"]


def test_linen_mixed_float8_puts_the_dense_layers_in_float8():
    x = _values(60, (16, 32), 3.0)
    mixed = jmp.linen.mixed_precision(_linen_model(False), jmp.get_policy("mixed_float8"))
    variables = mixed.init(jax.random.key(0), x)
    assert {a.dtype for a in jax.tree.leaves(variables)} == {jnp.dtype(jnp.float32)}
    # The same model with Fp8DotGeneral written in by hand, under mixed_bfloat16.
    # (A float8 policy leaves its layers' gradients to float8's dot: no jmp_policy.matmul.)
    by_hand = jmp.linen.mixed_precision(
        _linen_model(True), jmp.get_policy("mixed_bfloat16"), reduce_dtype=None
    )

    def loss(apply, params):
        return jnp.mean(apply({"params": params}, x) ** 2)

    ours = jax.jit(jax.value_and_grad(functools.partial(loss, mixed.apply)))(variables["params"])
    theirs = jax.jit(jax.value_and_grad(functools.partial(loss, by_hand.apply)))(
        variables["params"]
    )
    jax.tree.map(np.testing.assert_array_equal, ours, theirs)  # bit for bit
    assert ours[0].dtype == jnp.float32
    forward = _dot_dtypes(lambda p: mixed.apply({"params": p}, x), variables["params"])
    both = _dot_dtypes(jax.grad(functools.partial(loss, mixed.apply)), variables["params"])
    print(f"forward dots: {forward}; with the backward pass: {both}")
    # Two Dense layers in float8; the head (left out by name) in bfloat16.
    assert forward == {"float8_e4m3fn": 2, "bfloat16": 1}
    assert both["float8_e5m2"] == 4 and both["float8_e4m3fn"] == 2 and both["bfloat16"] == 3
    report = jmp.precision_report(lambda p: mixed.apply({"params": p}, x), variables["params"])
    # FLOPs per row: 32x64 and 64x64 in float8, the 64x64 head in bfloat16.
    assert report.fp8_matmul_flop_share == pytest.approx(
        (32 * 64 + 64 * 64) / (32 * 64 + 2 * 64 * 64)
    )
    assert [r for _, r, _ in report.fp8_left_out] == [
        "module name matches 'head' (jmp_policy.fp8.FP8_EXCLUDE, the default)"
    ]
    # Overrides choose the layers: Dense_1 back in bfloat16.
    fewer = jmp.linen.mixed_precision(
        _linen_model(False),
        jmp.get_policy("mixed_float8"),
        {**jmp.linen.NORMS_IN_FLOAT32, "Dense_1": jmp.get_policy("mixed_bfloat16")},
    )
    assert _dot_dtypes(lambda p: fewer.apply({"params": p}, x), variables["params"]) == {
        "float8_e4m3fn": 1,
        "bfloat16": 2,
    }


def test_linen_mixed_float8_under_nn_scan_and_remat():
    from flax import linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return x + nn.Dense(32)(nn.relu(nn.Dense(64)(nn.LayerNorm()(x)))), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            scanned = nn.scan(
                nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=3
            )
            x, _ = scanned()(x, None)
            return x

    x = _values(61, (8, 32), 2.0)
    mixed = jmp.linen.mixed_precision(Stack(), jmp.get_policy("mixed_float8"))
    variables = mixed.init(jax.random.key(0), x)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(mixed.apply({"params": p}, x) ** 2)))(
        variables["params"]
    )
    assert all(jnp.isfinite(g).all() and g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    counts = _dot_dtypes(lambda p: mixed.apply({"params": p}, x), variables["params"])
    print(counts)
    assert counts == {"float8_e4m3fn": 2 * 3}  # two Dense layers, counted per scanned step


def test_nnx_mixed_float8_puts_the_linear_layers_in_float8():
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, dot_general=jax.lax.dot_general):
            rngs = nnx.Rngs(0)
            self.up = nnx.Linear(32, 64, dot_general=dot_general, rngs=rngs)
            self.norm = nnx.LayerNorm(64, rngs=rngs)
            self.down = nnx.Linear(64, 64, dot_general=dot_general, rngs=rngs)
            self.head = nnx.Linear(64, 64, rngs=rngs)

        def __call__(self, x):
            return self.head(self.down(nnx.relu(self.norm(self.up(x)))))

    x = _values(62, (16, 32), 3.0)
    model = jmp.nnx.mixed_precision(Model(), "mixed_float8")
    by_hand = jmp.nnx.mixed_precision(
        Model(Fp8DotGeneral()), "mixed_bfloat16", reduce_dtype=None
    )  # a float8 policy leaves its layers' gradients to float8's dot
    up = model.model.up
    assert up.kernel[...].dtype == jnp.float32 and up.dtype == jnp.bfloat16
    assert isinstance(up.dot_general, Fp8DotGeneral)
    assert model.model.head.dot_general is jax.lax.dot_general  # left out by name
    assert isinstance(by_hand.model.up.dot_general, Fp8DotGeneral)  # the user's own stays

    @nnx.jit
    def value_and_grad(model):
        return nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)

    ours, theirs = value_and_grad(model), value_and_grad(by_hand)
    jax.tree.map(np.testing.assert_array_equal, ours, theirs)
    assert _dot_dtypes(lambda x: model(x), x) == {"float8_e4m3fn": 2, "bfloat16": 1}
    # Moved back to bfloat16, the layers get lax.dot_general again: no hook of Flax's is
    # filled for a 16-bit matmul (the model's call casts each weight inside its matmul).
    model = jmp.nnx.mixed_precision(model, "mixed_bfloat16")  # the wrapper's model, again
    assert model.model.up.dot_general is jax.lax.dot_general
    assert _dot_dtypes(lambda x: model(x), x) == {"bfloat16": 3}


def test_fp8_dot_general_for_flax_layers():
    x, w = _values(63, (16, 64), 2.0), _values(64, (64, 32), 1.0)
    dot = Fp8DotGeneral()
    np.testing.assert_array_equal(dot(x, w, MATMUL), fp8_dot_general(x, w, MATMUL))
    # Too small for a float8 GEMM (N = 8): lax.dot_general in the operands' dtype.
    small = dot(x, w[:, :8], MATMUL)
    np.testing.assert_array_equal(small, jax.lax.dot_general(x, w[:, :8], MATMUL))
    assert dot(x, w, MATMUL, preferred_element_type=jnp.bfloat16).dtype == jnp.bfloat16
    assert hash(dot) == hash(Fp8DotGeneral())
    with pytest.raises(ValueError, match="`scaling`"):
        Fp8DotGeneral(scaling="blockwise")
    with pytest.raises(ValueError, match="`fmt`"):
        Fp8DotGeneral(fmt="e5m2")
    with pytest.raises(TypeError, match="`power_of_two`"):
        Fp8DotGeneral(power_of_two=1)


def _rowwise_reference(x, dtype, axis):
    """NumPy: one scale per slice (amax over `axis`), quantized values as float32, the scales."""
    top = np.float32(fp8_max(dtype))
    x = np.asarray(x, np.float32)
    scale = top / np.abs(x).max(axis=axis, keepdims=True)
    return _reference_qdq(x, dtype, scale), jnp.asarray(scale)


def test_rowwise_forward_and_gradients_are_the_float32_reference_of_the_same_math():
    x, w, g = _values(50, (16, 32), 2.0), _values(51, (32, 24), 0.5), _values(52, (16, 24), 3.0)
    out, vjp = jax.vjp(jax.jit(lambda x, w: fp8_dot_general(x, w, MATMUL, scaling="rowwise")), x, w)
    dx, dw = vjp(g)
    # Forward: x per row (over K), w per column (over K).
    qx, sx = _rowwise_reference(x, E4M3, 1)
    qw, sw = _rowwise_reference(w, E4M3, 0)
    np.testing.assert_array_equal(out, _float32_dot(qx, qw, sx, sw))
    # dx = g @ w.T contracts N: g per row over N, w per row over N.
    qg, sg = _rowwise_reference(g, E5M2, 1)
    qw, sw = _rowwise_reference(w, E4M3, 1)
    np.testing.assert_array_equal(dx, _float32_dot(qg, qw.T, sg, sw.T))
    # dw = x.T @ g contracts M: x per column over M, g per column over M.
    qx, sx = _rowwise_reference(x, E4M3, 0)
    qg, sg = _rowwise_reference(g, E5M2, 0)
    np.testing.assert_array_equal(dw, _float32_dot(qx.T, qg, sx.T, sg))


def test_rowwise_keeps_the_rows_beside_an_outlier_row():
    x = _values(53, (16, 32), 1.0).at[3].multiply(1e5)  # one row 100,000 times larger
    w = _values(54, (32, 16), 1.0)
    exact = x @ w
    errors = {}
    for scaling in ("tensorwise", "rowwise"):
        out = fp8_dot_general(x, w, MATMUL, scaling=scaling)
        error = np.delete(np.asarray(jnp.abs(out - exact)), 3, axis=0)
        errors[scaling] = float(error.max() / np.abs(np.delete(np.asarray(exact), 3, axis=0)).max())
    print(f"largest error on the other rows, relative to their largest value: {errors}")
    # Tensorwise pushes the other rows into e4m3's subnormals; rowwise scales them alone.
    assert errors["rowwise"] < 0.1 and errors["tensorwise"] > 5 * errors["rowwise"]
    with pytest.raises(ValueError, match="`scaling`.*'rowwise'"):
        fp8_dot_general(x, w, MATMUL, scaling="blockwise")


def test_autocast_fp8_scaling_and_format_options():
    params, x = _mlp_params(), _values(3, (32, 64), 2.0)

    def loss(params, x):
        return jax.nn.logsumexp(_mlp(params, x), axis=-1).mean()

    exact = loss(params, x)
    for scaling in ("tensorwise", "rowwise"):
        for fmt in ("hybrid", "e4m3"):
            cast = jmp.autocast(loss, "mixed_float8", fp8_scaling=scaling, fp8_format=fmt)
            value, grads = jax.jit(jax.value_and_grad(cast))(params, x)
            np.testing.assert_allclose(value, exact, rtol=0.02)
            counts = jmp.precision_report(jax.grad(cast), params, x).counts["dot_general"]
            gradient_dtype = "float8_e5m2" if fmt == "hybrid" else "float8_e4m3fn"
            assert counts.get(gradient_dtype, 0) >= 4, counts
    with pytest.raises(ValueError, match="`fp8_scaling`"):
        jmp.autocast(loss, "mixed_float8", fp8_scaling="sideways")  # "delayed" is a recipe
    with pytest.raises(ValueError, match="`fp8_format`"):
        jmp.autocast(loss, "mixed_float8", fp8_format="e5m2")


def test_the_logits_head_and_embedding_stay_in_bfloat16_by_default():
    from flax import linen as nn

    class Model(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(64, 32)(tokens)
            x = nn.Dense(64)(nn.relu(nn.Dense(64)(x)))
            return nn.Dense(64, name="head")(x)

    model, tokens = Model(), jnp.zeros((4, 16), jnp.int32)
    variables = model.init(jax.random.key(0), tokens)
    report = jmp.precision_report(jmp.autocast(model.apply, "mixed_float8"), variables, tokens)
    print(report.fp8_left_out)
    # 64-wide: every matmul is eligible by size; the head is left out by name.
    assert [(d, r, w.split("/")[-1]) for d, r, w in report.fp8_left_out] == [
        ("bfloat16", "module name matches 'head' (jmp_policy.fp8.FP8_EXCLUDE, the default)", "head")
    ]
    # FLOPs per token: 32x64 and 64x64 in float8, the 64x64 head in bfloat16.
    assert report.fp8_matmul_flop_share == pytest.approx(
        (32 * 64 + 64 * 64) / (32 * 64 + 2 * 64 * 64)
    )
    everything = jmp.autocast(model.apply, "mixed_float8", fp8_exclude=())
    # The head in float8 then, which a warning says (found by structure: the last matmul).
    with pytest.warns(jmp.errors.PrecisionWarning, match="Model/head is the last matmul"):
        assert jmp.precision_report(everything, variables, tokens).fp8_matmul_flop_share == 1.0
    with pytest.raises(ValueError, match="`fp8_exclude`"):
        jmp.autocast(model.apply, "mixed_float8", fp8_exclude=("head(",))
    with pytest.raises(TypeError, match="`fp8_exclude`"):
        jmp.autocast(model.apply, "mixed_float8", fp8_exclude="head")


def test_microbatches_record_the_largest_amax_not_the_last_or_the_mean():
    # Gradient accumulation: three microbatches whose magnitudes differ by 100x each way.
    recipe = DelayedScaling(history_length=4)
    state = recipe.init()
    w = _values(70, (32, 32), 0.5)
    batches = [_values(71 + i, (8, 32), scale) for i, scale in enumerate((1.0, 100.0, 0.01))]

    def loss_fn(state, x):
        y, state = fp8_dot_general_delayed(x, w, MATMUL, state, recipe)
        return jnp.mean(y.astype(jnp.float32) ** 2), state

    step = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    results = [step(state, x) for x in batches]
    states = [s for (_, s), _ in results]
    grads = [g for _, g in results]
    merged = next_state(combine_microbatches(*states), combine_microbatches(*grads), recipe)
    lhs_amaxes = [float(s.lhs.amax_history[0]) for s in states]
    grad_amaxes = [float(g.grad_amax) for g in grads]
    print(f"input amax per microbatch {lhs_amaxes}, output-gradient amax {grad_amaxes}")
    assert max(lhs_amaxes) / min(lhs_amaxes) > 1e3
    # The largest of the three is what the step records, for the input and the gradient.
    assert float(merged.lhs.amax_history[0]) == max(lhs_amaxes)
    assert float(merged.grad.amax_history[0]) == max(grad_amaxes)
    # Not the last microbatch's (100x smaller) nor the mean (what averaging would give).
    assert float(merged.grad.amax_history[0]) > 3 * float(np.mean(grad_amaxes)) / 2
    assert float(merged.lhs.amax_history[0]) > 1e3 * lhs_amaxes[-1]
    # The rest of the history and the scales are the ones every microbatch started from.
    np.testing.assert_array_equal(merged.lhs.amax_history[1:], states[0].lhs.amax_history[1:])
    assert float(merged.rhs.amax_history[0]) == float(states[0].rhs.amax_history[0])
    with pytest.raises(ValueError, match="`states`"):
        combine_microbatches()


def _docs_delayed_model(recipe, seed):
    """docs/fp8.md's model and train step (a scanned stack of float8 delayed-scaling layers,
    Adam under a dynamic loss scale, the fp8 state kept on a skipped step), a regression
    target `y`."""
    import optax

    layers = 2
    keys = jax.random.split(jax.random.key(seed), layers)
    params = jnp.stack([jax.random.normal(k, (32, 32)) / 6 for k in keys])
    fp8_state = jax.tree.map(lambda *s: jnp.stack(s), *[recipe.init() for _ in range(layers)])
    tx = jmp.loss_scaling(optax.adam(1e-3), jmp.DynamicLossScale(2.0**15))

    def loss_fn(params, fp8_state, x, y):
        def layer(h, weights_and_state):
            w, state = weights_and_state
            h, state = fp8_dot_general_delayed(h, w, MATMUL, state, recipe)
            return jnp.tanh(h), state

        h, fp8_state = jax.lax.scan(layer, x, (params, fp8_state))
        return ((h - y) ** 2).mean(), fp8_state

    @jax.jit
    def step(params, fp8_state, opt_state, x, y):
        scale = jmp.get_loss_scale(opt_state)

        def scaled(params, fp8_state):
            value, fp8_state = loss_fn(params, fp8_state, x, y)
            return scale.scale(value), fp8_state

        (_, new_state), (grads, state_grads) = jax.value_and_grad(
            scaled, argnums=(0, 1), has_aux=True
        )(params, fp8_state)
        updates, opt_state = tx.update(grads, opt_state, params)
        new_state = next_state(new_state, state_grads, recipe)
        fp8_state = jmp.unless_skipped(opt_state, new_state, fp8_state)
        return optax.apply_updates(params, updates), fp8_state, opt_state

    return params, fp8_state, tx.init(params), step


def _batch(i):
    x = jax.random.normal(jax.random.key(100 + i), (16, 32))
    return x, jnp.tanh(x[:, ::-1])


def _input_clip_share(fp8_state, x):
    """The share of the first layer's input values beyond e4m3's range at its next scale."""
    scale = (
        DelayedScaling(history_length=8)
        .advance(jax.tree.map(lambda a: a[0], fp8_state.lhs), jnp.zeros(()), E4M3)
        .scale
    )
    return float(jnp.mean(jnp.abs(x * scale) > fp8_max(E4M3)))


@pytest.mark.standard_promotion  # optax's Adam mixes float and int
@pytest.mark.parametrize("bad", ["nan batch", "inf batch", "inf target"])
def test_a_bad_batch_is_skipped_and_leaves_every_amax_history_as_it_was(bad):
    """A NaN batch, an inf batch (an fp8 cast saturating it would hide it) and an inf target:
    `loss_scaling` skips the step, the fp8 state is what it was (`unless_skipped`, and no
    non-finite amax is written in any case), and the next 8 steps clip no more of their inputs
    than the same run without the bad batch."""
    recipe = DelayedScaling(history_length=8)
    params, fp8_state, opt_state, step = _docs_delayed_model(recipe, seed=0)
    for i in range(6):
        params, fp8_state, opt_state = step(params, fp8_state, opt_state, *_batch(i))
    x, y = _batch(6)
    x = x.at[3, 5].set(jnp.nan) if bad == "nan batch" else x
    x = x.at[3, 5].set(jnp.inf) if bad == "inf batch" else x
    y = y.at[2, 1].set(jnp.inf) if bad == "inf target" else y
    before = fp8_state
    after_params, after, after_opt = step(params, fp8_state, opt_state, x, y)
    assert int(after_opt.skipped_steps) == 1
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), after, before))
    assert jax.tree.all(
        jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), after_params, params)
    )

    clean = (params, fp8_state, opt_state)
    run = (after_params, after, after_opt)
    for i in range(7, 15):
        batch = _batch(i)
        assert _input_clip_share(run[1], batch[0]) <= _input_clip_share(clean[1], batch[0])
        run, clean = step(*run, *batch), step(*clean, *batch)
        for tree in (run[1], clean[1]):
            assert all(bool(jnp.isfinite(a).all()) for a in jax.tree.leaves(tree))
    assert int(run[2].skipped_steps) == 1 and int(clean[2].skipped_steps) == 0


def test_a_non_finite_amax_is_never_written_to_a_history():
    recipe = DelayedScaling(history_length=4)
    meta = recipe.init().lhs
    meta = recipe.advance(meta, jnp.float32(3.0), E4M3)
    for amax in (jnp.inf, jnp.nan, -jnp.inf):
        kept = recipe.advance(meta, jnp.float32(amax), E4M3)
        np.testing.assert_array_equal(kept.amax_history, meta.amax_history)
        assert bool(jnp.isfinite(kept.scale))
    np.testing.assert_allclose(recipe.advance(meta, jnp.float32(5.0), E4M3).scale, 448.0 / 3.0)


@pytest.mark.standard_promotion  # optax's Adam mixes float and int
@pytest.mark.parametrize("grad_margin, clips", [(None, False), (0, True)])
def test_the_loss_scales_growth_does_not_clip_the_gradients(grad_margin, clips):
    """A DynamicLossScale doubles after `period` finite steps: on that step every output
    gradient's amax is twice its history's. With the default `grad_margin` (two bits of
    headroom) no step's amax goes beyond e5m2's range at the scale it was quantized with, so
    no value clips; with Flax's rule (0) the growth steps reach twice the range."""
    import optax

    recipe = DelayedScaling(history_length=4, amax_from="most_recent", grad_margin=grad_margin)
    params, fp8_state, _, _ = _docs_delayed_model(recipe, seed=1)
    tx = jmp.loss_scaling(optax.adam(1e-3), jmp.DynamicLossScale(2.0**10, period=3))
    opt_state = tx.init(params)
    x, y = _batch(0)  # one batch: what changes between steps is the loss scale

    @jax.jit  # one program for the twelve steps, not each operation compiled on its own
    def step(params, fp8_state, opt_state):
        scale = jmp.get_loss_scale(opt_state)

        def scaled(params, fp8_state):
            def layer(h, weights_and_state):
                w, state = weights_and_state
                h, state = fp8_dot_general_delayed(h, w, MATMUL, state, recipe)
                return jnp.tanh(h), state

            h, fp8_state = jax.lax.scan(layer, x, (params, fp8_state))
            return scale.scale(((h - y) ** 2).mean()), fp8_state

        (_, new_state), (grads, state_grads) = jax.value_and_grad(
            scaled, argnums=(0, 1), has_aux=True
        )(params, fp8_state)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        fp8_state = next_state(new_state, state_grads, recipe)
        # The amax this step's gradient had, at the scale it was quantized with.
        amax = jnp.max(fp8_state.grad.amax_history[:, 0] * fp8_state.grad.scale)
        return params, fp8_state, opt_state, amax

    worst = []
    for _ in range(12):
        params, fp8_state, opt_state, amax = step(params, fp8_state, opt_state)
        worst.append(float(amax))
    assert float(jmp.get_loss_scale(opt_state).loss_scale) > 2.0**10  # it grew
    assert (max(worst[2:]) > fp8_max(E5M2)) == clips, worst
    if clips:
        assert max(worst) > 1.9 * fp8_max(E5M2), worst


@pytest.mark.standard_promotion  # optax's MultiSteps mixes float and int
@pytest.mark.parametrize("amax_from", ["max", "most_recent"])
def test_microbatches_under_multisteps_record_the_largest_amax(amax_from):
    """`optax.MultiSteps` over 4 microbatches, one 50x larger, each a call of the train step:
    `merge_microbatch` records one history entry per optimizer step, the largest amax, and
    the next step's scale comes from it, whichever `amax_from` (without it "most_recent"
    follows the last microbatch: marin#7659)."""
    import optax

    from jmp_policy.fp8 import merge_microbatch

    recipe = DelayedScaling(history_length=4, amax_from=amax_from)
    w = _values(80, (32, 32), 0.5)
    tx = optax.MultiSteps(optax.sgd(1e-4), every_k_schedule=4)
    opt_state, state = tx.init(w), recipe.init()

    def loss_fn(w, state, x):
        y, state = fp8_dot_general_delayed(x, w, MATMUL, state, recipe)
        return jnp.mean(y.astype(jnp.float32) ** 2), state

    @jax.jit
    def call(w, state, opt_state, x):
        (_, new), (grads, state_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
            w, state, x
        )
        merged = merge_microbatch(opt_state, next_state(new, state_grads, recipe), state)
        updates, opt_state = tx.update(grads, opt_state, w)
        return optax.apply_updates(w, updates), merged, opt_state, new.lhs.amax_history[0]

    amaxes = []
    for step in range(2):
        for i, size in enumerate((1.0, 1.0, 50.0, 1.0)):
            x = _values(90 + 4 * step + i, (8, 32), size)
            w, state, opt_state, amax = call(w, state, opt_state, x)
            amaxes.append(float(amax))
        # One entry per step: the largest of its four microbatches, the scale from it.
        np.testing.assert_array_equal(state.lhs.amax_history[0], max(amaxes[-4:]))
        assert int((state.lhs.amax_history > 0).sum()) == step + 1
    np.testing.assert_allclose(state.lhs.scale, 448.0 / max(amaxes[:4]), rtol=1e-6)
    assert float(state.grad.amax_history[0]) > 0
    with pytest.raises(ValueError, match="MultiStepsState"):
        merge_microbatch(optax.sgd(0.1).init(w), state, state)
