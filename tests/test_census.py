"""Tests for jmp_policy._reports.census: `precision_report`, one report with one counting rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from models import PARAMS, RNN_PARAMS, XS, X, Y, loss_fn, rnn

import jmp_policy as jmp
from jmp_policy._reports.census import report_of_jaxpr


def test_flops_casts_and_misaligned_matmuls():
    report = jmp.precision_report(jmp.autocast(loss_fn), PARAMS, X, Y, original=loss_fn)
    print(f"\n{report}")
    assert report.half_matmul_flop_share == 1.0
    assert report.casts_inserted > 0 and report.casts >= report.casts_inserted
    by_class = {(p, d): (c, f) for p, d, c, f in report.rows}
    assert by_class[("conv_general_dilated", "float16")][0] == 1
    # conv: 12 positions x 32 features x 3 taps x 6 channels x 2, per example.
    assert by_class[("conv_general_dilated", "float16")][1] == 2 * 8 * 12 * 32 * 3 * 6
    flagged = {(p, c, o) for p, _, c, o, _ in report.misaligned}
    assert ("conv_general_dilated", (6,), (32,)) in flagged  # 6 input channels
    assert ("dot_general", (32,), (8, 5)) in flagged  # the 5-class head: N = 5
    assert not any(p == "dot_general" and c == (32,) and o[1] == 32 for p, c, o in flagged)
    # Where: the module path of the misaligned head.
    assert any("head" in where for p, _, c, o, where in report.misaligned if o == (8, 5))
    baseline = jmp.precision_report(loss_fn, PARAMS, X, Y)
    assert baseline.half_matmul_flop_share == 0.0 and baseline.casts_inserted is None
    assert baseline.total("float16") == 0 and baseline.total("float32") > 0


def test_one_counting_rule_scan_bodies_per_step():
    """A scan body counts `length` times in every figure: rows, counts and totals."""
    report = jmp.precision_report(jmp.autocast(rnn), RNN_PARAMS, XS)
    print(f"\n{report}")
    dots = {(p, d): (c, f) for p, d, c, f in report.rows}[("dot_general", "float16")]
    assert dots == (2 * 7, 7 * (2 * 2 * 4 * 4 + 2 * 2 * 3 * 4))
    assert report.counts["dot_general"] == {"float16": 14}
    assert report.counts["exp"] == {"float32": 7}  # exp is on the float32 list
    assert report.total("float16", ["dot_general"]) == 14
    assert report.total("float16") == sum(c for _, d, c, _ in report.rows if d == "float16")
    # The same program unrolled by hand gives the same counts.
    unrolled = jmp.precision_report(jmp.autocast(_unrolled), RNN_PARAMS, XS)
    assert unrolled.counts["dot_general"] == report.counts["dot_general"]
    assert unrolled.counts["exp"] == report.counts["exp"]


def _unrolled(params, xs):
    h = jnp.zeros((xs.shape[1], params["w"].shape[0]))
    total = 0.0
    for x in xs:
        h = jnp.tanh(h @ params["w"] + x @ params["u"])
        total = total + jnp.exp(h).sum()
    return h.sum() + total


def test_counts_agree_with_rows_and_nested_programs_count_once():
    """jit, cond and while bodies count once (a while's trip count is unknown when tracing)."""

    def f(w, x):
        y = jax.jit(lambda a: a @ w)(x)
        y = lax.cond(y.sum() > 0, lambda a: a @ w, lambda a: a, y)
        return lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] @ w, c[1] + 1), (y, 0))[0]

    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    report = jmp.precision_report(jmp.autocast(f), w, x)
    assert report.counts["dot_general"] == {"float16": 3}
    for primitive, by_dtype in report.counts.items():
        for dtype, count in by_dtype.items():
            assert (primitive, dtype, count) in {(p, d, c) for p, d, c, _ in report.rows}
    # The jaxpr entry point gives the same report.
    assert report_of_jaxpr(jax.make_jaxpr(jmp.autocast(f))(w, x)) == report


def test_shape_dtype_structs_and_printing():
    spec = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    report = jmp.precision_report(jmp.autocast(lambda a, b: (a @ b.T).sum()), spec, spec)
    text = str(report)
    assert "matmul/conv FLOPs in half precision: 100.0%" in text
    assert "ops in half precision: " in text and "dot_general" in text
    assert report.rows[0][:2] == ("dot_general", "float16")
    assert report.rows[0][3] == 2 * 8 * 8 * 16


def _host(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_an_nnx_model_that_writes_variables_is_reported_as_it_is(mode):
    """BatchNorm's statistics and Dropout's RNG counts, written when the model is called:
    `precision_report(model, x)` and `debug_precision(loss, model, x)` take the model as it
    is (it is traced as a pure function of its state), and it is left unchanged."""
    from flax import nnx
    from models import NNXBatchNormNet

    x = jnp.ones((4, 4))
    plain = NNXBatchNormNet(nnx.Rngs(0))
    for model in (plain, jmp.nnx.mixed_precision(NNXBatchNormNet(nnx.Rngs(0)), "mixed_float16")):
        getattr(model, mode)()
        before = jax.tree.map(_host, nnx.state(model))
        report = jmp.precision_report(model, x)
        assert sum(report.counts["dot_general"].values()) == 2
        debug = jmp.debug_precision(lambda m, x: jnp.mean(m(x) ** 2), model, x)
        layers = {s.layer for s in debug.layers}
        assert {f"NNXBatchNormNet/{n}" for n in ("up", "norm", "head")} <= layers, layers
        after = jax.tree.map(_host, nnx.state(model))
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
            np.testing.assert_array_equal(a, b)  # nothing in the model changed
    assert report.counts["dot_general"] == {"float16": 2}  # the mixed model's
