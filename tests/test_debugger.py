"""Tests for the precision debugger (`jmp_policy._reports.debugger`): planted faults must be
named, statistics must match NumPy."""

import argparse
import functools
import importlib.util
import math
import pathlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_policy as jmp


class Loud(nn.Module):
    """Its activations reach 1e5 inside (float16's largest is 65504), and come back down."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(8)(x) * 1e5 * 1e-5


class Quiet(nn.Module):
    """Its kernel's gradients are 1e-6 of the others': below float16's range at scale 1."""

    @nn.compact
    def __call__(self, x):
        return x + 1e-6 * nn.Dense(8)(x)


class LogZero(nn.Module):
    """log(0) = -inf, times 0: a NaN made here from finite inputs."""

    @nn.compact
    def __call__(self, x):
        return x + 0.0 * jnp.log(jnp.zeros_like(x))


class Planted(nn.Module):
    fault: str

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8, name="embed")(x)
        if self.fault == "overflow":
            h = Loud(name="loud")(h)
        if self.fault == "underflow":
            h = Quiet(name="quiet")(h)
        if self.fault == "log0":
            h = LogZero(name="logzero")(h)
        return nn.Dense(2, name="head")(nn.relu(h))


X = jax.random.normal(jax.random.key(0), (16, 4))
Y = jnp.arange(16) % 2


def report_for(fault, x=X, **kwargs):
    model = Planted(fault)
    params = model.init(jax.random.key(1), X)["params"]

    def loss(params, x):
        logits = model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, Y).mean()

    report = jmp.debug_precision(loss, params, x, **kwargs)
    print(f"\n{fault}:\n{report}")
    return report


def by_layer(report):
    return {(s.layer, s.direction): s for s in report.layers}


def test_activation_overflow_is_named_and_sent_to_float32():
    report = report_for("overflow")
    stats = by_layer(report)
    assert stats[("Planted/loud", "forward")].overflow > 0
    assert stats[("Planted/loud", "forward")].headroom < 0
    others = [s for (layer, d), s in stats.items() if d == "forward" and layer != "Planted/loud"]
    assert others and all(s.overflow == 0 for s in others)
    assert report.advice()["overrides"] == {"loud": "float32"}
    assert report.origin is None and not report.nonfinite_inputs


def test_gradient_underflow_at_scale_one_is_named_and_a_scale_proposed():
    report = report_for("underflow")
    quiet = by_layer(report)[("Planted/quiet", "backward")]
    head = by_layer(report)[("Planted/head", "backward")]
    assert quiet.underflow > 0.3 and head.underflow < 0.1
    advice = report.advice()["loss_scale"]
    assert advice["initial"] >= 2.0**10
    # At the proposed scale the quiet layer's gradients are back in range.
    rescaled = report_for("underflow", loss_scale=advice["initial"])
    assert by_layer(rescaled)[("Planted/quiet", "backward")].underflow < quiet.underflow / 2
    assert all(s.overflow == 0 for s in rescaled.layers if s.direction == "backward")
    assert rescaled.advice()["loss_scale"] == advice  # judged on the same gradients


def test_nan_from_log_of_zero_is_traced_to_its_module_and_line():
    report = report_for("log0")
    origin = report.origin
    assert origin is not None
    assert (origin.primitive, origin.layer, origin.direction) == (
        "log",
        "Planted/logzero",
        "forward",
    )
    line = next(
        i
        for i, text in enumerate(open(__file__).read().splitlines(), 1)
        if "jnp.log(jnp.zeros_like(x))" in text
    )
    assert origin.source.endswith(f"test_debugger.py:{line}")
    assert origin.passed_on > 0
    assert "first inf/NaN: log in Planted/logzero" in str(report)


def test_nan_from_the_input_is_told_apart():
    report = report_for("none", x=X.at[3, 1].set(jnp.nan))
    assert report.origin is None
    assert report.nonfinite_inputs == ("args[1]",)
    assert math.isnan(report.loss)
    assert "passed through from the input: args[1]" in str(report)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_statistics_match_numpy(dtype):
    x = jnp.asarray(np.geomspace(1e-9, 1e6, 40) * np.resize([1, -1], 40), jnp.float32)
    w = jnp.float32(3.0)
    report = jmp.debug_precision(lambda w, x: jnp.sum(x * w), w, x, dtype=dtype, loss_scale=4.0)
    forward = by_layer(report)[("(top level)", "forward")]
    values = np.abs(np.concatenate([np.asarray(x * w), [np.asarray(jnp.sum(x * w))]]))
    finfo = jnp.finfo(dtype)
    nonzero = values[values > 0]
    assert forward.count == values.size
    assert forward.amax == pytest.approx(values.max())
    assert forward.min_nonzero == pytest.approx(nonzero.min())
    assert forward.dynamic_range == pytest.approx(np.log2(values.max() / nonzero.min()))
    assert forward.underflow == pytest.approx(np.mean(nonzero < float(finfo.smallest_normal)))
    assert forward.overflow == pytest.approx(np.mean(values > float(finfo.max)))
    # Gradients (d/dw = sum(x), d/dx = w) are judged after the loss scale of 4.
    backward = by_layer(report)[("(top level)", "backward")]
    assert backward.headroom == math.floor(math.log2(float(finfo.max) / (backward.amax * 4.0)))


def test_plot_and_bad_arguments(tmp_path):
    report = report_for("overflow")
    path = report.plot(tmp_path / "heat.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(TypeError, match="`dtype`"):
        jmp.debug_precision(lambda x: x.sum(), jnp.ones(2), dtype="int8")
    with pytest.raises(ValueError, match="`loss_scale`"):
        jmp.debug_precision(lambda x: x.sum(), jnp.ones(2), loss_scale=0.0)


def _count(jaxpr, primitive):
    from jmp_policy._reports.census import iter_equations

    return sum(e.primitive.name == primitive for e in iter_equations(jaxpr))


@pytest.mark.standard_promotion  # optax's adam mixes int32 and float
def test_statistics_during_training_every_n_steps_without_a_host_sync():
    params = {"a": jnp.ones(3), "b": {"c": jnp.ones((2, 2))}}
    grads = {"a": jnp.array([1e-9, 1.0, 0.0]), "b": {"c": jnp.full((2, 2), 2.0)}}
    scale = 2.0**10
    scaled = jax.tree.map(lambda g: g * scale, grads)
    off = jmp.loss_scaling(optax.adam(1e-3), jmp.StaticLossScale(scale))
    on = jmp.loss_scaling(optax.adam(1e-3), jmp.StaticLossScale(scale), stats_every=3)
    # Off: nothing changes; the state holds no statistics and the step's program is the same.
    off_state = off.init(params)
    assert off_state.gradient_stats is None
    jmp.get_loss_scale(off_state)  # the gradients' scale read, as scaling them reads it
    off_jaxpr = jax.make_jaxpr(off.update)(scaled, off_state, params)
    default = jmp.loss_scaling(optax.adam(1e-3), jmp.StaticLossScale(scale), stats_every=None)
    assert str(jax.make_jaxpr(default.update)(scaled, default.init(params), params)) == str(
        off_jaxpr
    )
    # On: one more cond (the collection), run every 3rd step inside the jitted step.
    state = on.init(params)
    jmp.get_loss_scale(state)
    assert _count(jax.make_jaxpr(on.update)(scaled, state, params), "cond") == (
        _count(off_jaxpr, "cond") + 1
    )
    step = jax.jit(on.update, donate_argnums=1)
    seen = []
    for _ in range(7):
        _, state = step(scaled, state, params)
        seen.append(int(state.gradient_stats.step))
    assert seen == [0, 0, 0, 3, 3, 3, 6]
    stats = state.gradient_stats
    tiny = float(jnp.finfo(jnp.float16).smallest_normal)
    expected_amax = [float(np.abs(np.asarray(g)).max()) for g in jax.tree.leaves(scaled)]
    np.testing.assert_allclose(stats.amax, expected_amax)
    a = np.abs(np.asarray(scaled["a"]))
    assert float(stats.underflow[0]) == np.mean(a[a > 0] < tiny)  # 1e-9 * 2^10 underflows
    report = jmp.loss_scaling_report(state)
    print(f"\n{report}")
    assert report.stats_step == 6
    assert report.gradient_stats["['b']['c']"]["headroom"] == math.floor(math.log2(65504 / 2048))
    assert "underflow 50.0% (most at ['a'])" in str(report)
    with pytest.raises(ValueError, match="`stats_every`"):
        jmp.loss_scaling(optax.sgd(1.0), jmp.NoOpLossScale(), stats_every=0)
    with pytest.raises(TypeError, match="`stats_dtype`"):
        jmp.loss_scaling(optax.sgd(1.0), jmp.NoOpLossScale(), stats_every=1, stats_dtype="int8")


def test_activation_statistics_inside_a_jitted_step_every_n_steps():
    model = Planted("overflow")
    params = model.init(jax.random.key(1), X)["params"]
    tx = optax.sgd(1e-2, momentum=0.9)

    def loss(params, x):
        logits = model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, Y).mean()

    with_stats = jmp.reports.value_and_grad_with_stats(loss, dtype="float16")

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, i):
        value, grads, stats = with_stats(params, X, collect=i % 3 == 0)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, stats

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def plain_step(params, opt_state):
        value, grads = jax.value_and_grad(loss)(params, X)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    ours = (jax.tree.map(jnp.copy, params), tx.init(params))
    theirs = (jax.tree.map(jnp.copy, params), tx.init(params))
    collected = []
    for i in range(4):
        *ours, value, stats = step(*ours, i)
        *theirs, plain_value = plain_step(*theirs)
        # Collecting changes nothing the step computes (XLA may fuse the branches of the
        # cond differently from the plain step: equal up to float32 rounding).
        np.testing.assert_allclose(value, plain_value, rtol=1e-6)
        collected.append(bool(stats.collected))
        if i == 3:
            last = stats
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5), ours[0], theirs[0])
    assert collected == [True, False, False, True]
    report = last.report(loss=float(value))
    print(f"\n{report}")
    stats = by_layer(report)
    assert {layer for layer, _ in stats} == {
        "Planted", "Planted/embed", "Planted/loud", "Planted/loud/Dense_0", "Planted/head",
        "(top level)",
    }  # fmt: skip
    assert stats[("Planted/loud", "forward")].overflow > 0
    assert report.advice()["overrides"] == {"loud": "float32"}
    with pytest.raises(ValueError, match="not collected"):
        step(*ours, 1)[3].report()
    # Without collect, the statistics are left out of the program.
    plain = jax.make_jaxpr(lambda p: with_stats(p, X, collect=False)[:2])(params)
    collecting = jax.make_jaxpr(lambda p: with_stats(p, X)[:2])(params)
    # The statistics: one variadic `reduce` per value.
    assert _count(plain, "cond") == 0 and _count(plain, "reduce") == 0 < _count(
        collecting, "reduce"
    )


def test_in_program_statistics_equal_the_eager_ones():
    model = Planted("underflow")
    params = model.init(jax.random.key(1), X)["params"]

    def loss(params, x):
        logits = model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, Y).mean()

    _, _, stats = jax.jit(jmp.reports.value_and_grad_with_stats(loss, dtype="bfloat16"))(params, X)
    eager_report = jmp.debug_precision(loss, params, X, dtype="bfloat16")
    assert stats.matmul_layers == eager_report.matmul_layers
    ours, eager = by_layer(stats.report()), by_layer(eager_report)
    assert set(ours) == set(eager)
    for key, s in eager.items():
        o = ours[key]
        assert o.count == s.count and o.headroom == s.headroom, key
        np.testing.assert_allclose(
            [o.amax, o.min_nonzero, o.underflow, o.overflow],
            [s.amax, s.min_nonzero, s.underflow, s.overflow],
            rtol=1e-6,
        )
    with pytest.raises(TypeError, match="`dtype`"):
        jmp.reports.value_and_grad_with_stats(loss, dtype="int8")


def test_a_masking_constant_is_not_an_overflow():
    # Flax's attention writes float32's lowest value where the mask is False: it is a
    # stand-in for -inf, not data, and masking in float16 uses float16's own.
    attention = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)
    x = jax.random.normal(jax.random.key(2), (2, 6, 8))
    mask = nn.make_causal_mask(jnp.ones((2, 6)))
    params = attention.init(jax.random.key(3), x, x, mask=mask)["params"]

    def loss(params, x):
        return jnp.mean(attention.apply({"params": params}, x, x, mask=mask) ** 2)

    report = jmp.debug_precision(loss, params, x, dtype="float16")
    print(f"\n{report}")
    own = by_layer(report)[("MultiHeadDotProductAttention", "forward")]
    assert own.overflow == 0 and own.amax < 100 and own.dynamic_range < 60
    assert report.advice()["overrides"] == {}


def test_advice_on_a_transformer_keeps_every_matmul_in_half_precision():
    # The demo's transformer (2 pre-norm blocks, Flax's attention) and its --advice path.
    spec = importlib.util.spec_from_file_location(
        "_demo", pathlib.Path(__file__).parents[1] / "examples" / "demo.py"
    )
    demo = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # for its dataclass
    spec.loader.exec_module(demo)
    train_ids, _, vocab = demo.load_text()
    args = argparse.Namespace(length=16)
    report = demo.precision_advice(train_ids, vocab, args, "float16")
    advice = report.advice()
    print(f"\n{advice}\n{report.op_errors[:8]}")
    # The normalisation layers, all of them and nothing else: their sums lose more than one
    # rounding in float16, and they hold no matmul, so float32 costs no half-precision FLOPs.
    norms = {"Block_0/LayerNorm_0", "Block_0/LayerNorm_1", "Block_1/LayerNorm_0",
             "Block_1/LayerNorm_1", "LayerNorm_0"}  # fmt: skip
    assert advice["overrides"] == dict.fromkeys(norms, "float32")
    assert {e.layer for e in report.op_errors if e.error > 1} >= {
        f"LanguageModel/{n}" for n in norms
    }
    # Every matmul ran in float16 within about one rounding, and stays there.
    matmuls = [e for e in report.op_errors if e.primitive == "dot_general"]
    assert matmuls and max(e.error for e in matmuls) < 1.0
    assert not any(path in advice["overrides"] for path in ("Block_0", "head", "Embed_0"))
    assert all(e.error <= 1 or e.layer.split("/")[-1].startswith(("LayerNorm", "Block"))
               for e in report.op_errors)  # fmt: skip
    model = demo.LanguageModel(vocab, length=args.length)
    mixed = jmp.linen.mixed_precision(model, "mixed_float16", advice["overrides"])  # as it is
    x = jnp.zeros((2, args.length), jnp.int32)
    params = model.init(jax.random.key(0), x)["params"]
    share = jmp.precision_report(
        lambda p: mixed.apply({"params": p}, x), params
    ).half_matmul_flop_share
    assert share == 1.0


@pytest.mark.parametrize(
    "fill, how, dtype",
    [
        (-2.38e38, "where", jnp.float32),
        (-1e30, "where", jnp.float32),
        (-math.inf, "where", jnp.float32),
        (-1e30, "added", jnp.float32),
        (float(jnp.finfo(jnp.float32).min), "added", jnp.float32),
        (float(jnp.finfo(jnp.float16).min), "where", jnp.float16),  # a float16 model's own
        (float(jnp.finfo(jnp.float16).min), "added", jnp.float16),
    ],
)
def test_a_mask_of_any_large_constant_is_left_out(fill, how, dtype):
    # Models choose their own masking constant (an NNX transformer wrote -2.38e38, not
    # float32's lowest value); every one of 1e30 or more is a mask, and the dtype's lowest, and
    # so are the values the softmax derives from it (x - max, beyond 1e30 or float16's edge),
    # whether the model selects it (`where`) or adds it to the logits.
    def loss(w, x):
        h = (x @ w).astype(dtype)
        logits = h @ h.T
        causal = jnp.tril(jnp.ones(logits.shape, bool))
        if how == "where":
            masked = jnp.where(causal, logits, jnp.asarray(fill, dtype))
        else:
            masked = logits + jnp.where(causal, 0.0, fill).astype(dtype)
        return jnp.mean(jax.nn.softmax(masked.astype(jnp.float32), axis=-1) ** 2)

    w = jax.random.normal(jax.random.key(0), (8, 8)) * 0.1
    x = jax.random.normal(jax.random.key(1), (6, 8))
    report = jmp.debug_precision(loss, w, x, dtype="float16")
    print(f"\n{report}")
    forward = [s for s in report.layers if s.direction == "forward"]
    assert forward and all(s.overflow == 0 for s in forward)
    assert all(math.isfinite(e.error) for e in report.op_errors), report.op_errors
    assert report.origin is None  # a mask (even -inf) is not an inf the model made
    # The ops that carry the mask are not sent to float32 for it (a sum may be, on its own merits).
    advised = {p for ps in report.advice()["islands"].values() for p in ps}
    assert not advised & {"select_n", "sub", "mul", "div", "broadcast_in_dim"}, advised


def test_a_mask_below_1e30_is_taken_for_an_overflow():
    # The limit of the magnitude rule (`_masks`'s docstring): -1e9 is not a mask to it, so a
    # float32 model masked with -1e9 and judged against float16 overflows where the mask is,
    # and the select and the softmax's subtraction that carry it are advised into float32.
    def loss(w, x, fill):
        h = x @ w
        logits = h @ h.T
        causal = jnp.tril(jnp.ones(logits.shape, bool))
        masked = jnp.where(causal, logits, jnp.asarray(fill, jnp.float32))
        return jnp.mean(jax.nn.softmax(masked, axis=-1) ** 2)

    w = jax.random.normal(jax.random.key(0), (8, 8)) * 0.1
    x = jax.random.normal(jax.random.key(1), (6, 8))
    overflow, advised = {}, {}
    for fill in (-1e30, -1e9):
        report = jmp.debug_precision(
            lambda w, x, fill=fill: loss(w, x, fill), w, x, dtype="float16"
        )
        overflow[fill] = sum(s.overflow for s in report.layers if s.direction == "forward")
        advised[fill] = {p for ps in report.advice()["islands"].values() for p in ps}
    print(overflow, advised)
    assert overflow[-1e30] == 0 and not advised[-1e30] & {"select_n", "sub"}
    assert overflow[-1e9] > 0 and {"select_n", "sub"} <= advised[-1e9]


def _nnx_model():
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm = nnx.LayerNorm(16, rngs=rngs)
            self.mlp = nnx.Linear(16, 16, rngs=rngs)

        def __call__(self, x):
            return x + self.mlp(self.norm(x))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([Block(rngs) for _ in range(2)])
            self.head = nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    return Model(nnx.Rngs(0))


NNX_LAYERS = {"Model/layers/0/norm", "Model/layers/0/mlp", "Model/layers/1/norm",
              "Model/layers/1/mlp", "Model/head"}  # fmt: skip


@pytest.mark.parametrize("pattern", ["module", "split-merge", "mixed_precision", "in-program"])
def test_nnx_layers_are_named_by_attribute_path(pattern):
    from flax import nnx

    model = _nnx_model()
    x = jax.random.normal(jax.random.key(1), (8, 16))
    if pattern == "module":  # nnx.value_and_grad style: the module is the argument
        report = jmp.debug_precision(lambda m, x: jnp.mean(m(x) ** 2), model, x)
    elif pattern == "in-program":
        f = jmp.reports.value_and_grad_with_stats(lambda m, x: jnp.mean(m(x) ** 2))
        report = jax.jit(f)(model, x)[2].report()
    else:
        if pattern == "mixed_precision":
            model = jmp.nnx.mixed_precision(model, "mixed_float16")
        graphdef, state = nnx.split(model)

        def loss(state, x):
            return jnp.mean(nnx.merge(graphdef, state)(x) ** 2)  # the usual functional pattern

        report = jmp.debug_precision(loss, state, x, dtype="float16")
    layers = {s.layer for s in report.layers}
    print(sorted(layers))
    assert NNX_LAYERS <= layers
    assert all(s.layer in NNX_LAYERS | {"Model", "Model/layers/0", "Model/layers/1", "(top level)"}
               for s in report.layers)  # fmt: skip
    if pattern == "mixed_precision":
        # The norms run in float32 (NORMS_IN_FLOAT32): not judged in float16, kept by the
        # advice, as paths `nnx.mixed_precision` takes.
        assert report.judged == "target"
        assert report.float32_layers == ("Model/layers/0/norm", "Model/layers/1/norm")
        overrides = report.advice()["overrides"]
        assert overrides == {"layers/0/norm": "float32", "layers/1/norm": "float32"}
        jmp.nnx.mixed_precision(_nnx_model(), "mixed_float16", overrides)  # every path matches
        assert not {e.layer for e in report.op_errors} & set(report.float32_layers)
        # Statistics computed inside a jitted step judge the same way and advise the same.
        f = jmp.reports.value_and_grad_with_stats(loss)
        in_program = jax.jit(f)(state, x)[2].report()
        assert in_program.judged == "target"
        assert in_program.float32_layers == report.float32_layers
        assert in_program.advice()["overrides"] == overrides
        assert in_program.advice()["loss_scale"] == report.advice()["loss_scale"]


def test_equinox_and_named_scope_layers_are_named_by_path():
    eqx = pytest.importorskip("equinox")

    class Block(eqx.Module):
        norm: eqx.nn.LayerNorm
        mlp: eqx.nn.MLP
        activation: object = jax.nn.gelu  # a function leaf

        def __call__(self, x):
            return x + self.mlp(self.activation(self.norm(x)))

    class Model(eqx.Module):
        blocks: list
        head: eqx.nn.Linear

        def __call__(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    keys = jax.random.split(jax.random.key(0), 3)
    model = Model(
        [Block(eqx.nn.LayerNorm(8), eqx.nn.MLP(8, 8, 16, 1, key=k)) for k in keys[:2]],
        eqx.nn.Linear(8, 2, key=keys[2]),
    )
    x = jax.random.normal(jax.random.key(1), (4, 8))
    expected = {"Model/blocks/0/norm", "Model/blocks/0/mlp/layers/0", "Model/blocks/1/mlp",
                "Model/head"}  # fmt: skip

    for wrapped in (model, jmp.eqx.mixed_precision(model, "mixed_float16")):
        report = jmp.debug_precision(lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2), wrapped, x)
        layers = {s.layer for s in report.layers}
        print(sorted(layers))
        assert expected <= layers
        assert not any("eqx." in layer or "Wrapper" in layer for layer in layers)
    assert report.judged == "target"  # under autocast: only what runs in float16 is judged

    def plain(w, x):  # plain functions: their named scopes are the layers
        with jax.named_scope("encoder"):
            h = jnp.tanh(x @ w)
        with jax.named_scope("head"):
            return jnp.mean(h**2)

    report = jmp.debug_precision(plain, jnp.ones((8, 8)), x)
    assert {s.layer for s in report.layers} == {"encoder", "head"}


# --- Advice that holds: Linen, NNX and Equinox transformers, each under its policy -----------

STEPS = 100


def _linen_transformer(overrides=None):
    from user_models import LinenTransformer, TransformerConfig

    kwargs = {} if overrides is None else {"overrides": overrides}
    model = LinenTransformer(TransformerConfig(num_layers=1))
    model = jmp.linen.mixed_precision(model, "mixed_float16", **kwargs)
    params = model.init(jax.random.key(1), jnp.zeros((2, 15), jnp.int32))["params"]
    return params, lambda params, tokens: model.apply({"params": params}, tokens)


def _nnx_transformer(overrides=None):
    from flax import nnx
    from user_models import make_nnx_transformer

    kwargs = {} if overrides is None else {"overrides": overrides}
    model = jmp.nnx.mixed_precision(make_nnx_transformer(layers=1), "mixed_float16", **kwargs)
    graphdef, state = nnx.split(model)
    return state, lambda state, tokens: nnx.merge(graphdef, state)(tokens)  # functional pattern


def _eqx_transformer(overrides=None):
    eqx = pytest.importorskip("equinox")
    from user_models import make_eqx_transformer

    assert not overrides  # autocast keeps norms' statistics in float32 op by op
    model = make_eqx_transformer(jax.random.key(1), layers=1)
    params, static = eqx.partition(jmp.eqx.mixed_precision(model, "mixed_float16"), eqx.is_array)
    return params, lambda params, tokens: jax.vmap(eqx.combine(params, static))(tokens)


def _lm_loss(apply):
    def loss(params, tokens):
        logits = apply(params, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return loss


def _train(params, loss, loss_scale, batches):
    tx = jmp.loss_scaling(optax.adam(3e-3), loss_scale)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, tokens):
        value, grads = jmp.value_and_scaled_grad(loss)(opt_state, params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    scales, losses = [], []
    for tokens in batches:
        scales.append(float(opt_state.loss_scale.loss_scale))
        params, opt_state, value = step(params, opt_state, tokens)
        losses.append(float(value))
    return np.log2(scales), np.asarray(losses)


@pytest.mark.standard_promotion  # optax's Adam
@pytest.mark.parametrize(
    "make, norms",
    [
        (_linen_transformer, {"block_0/LayerNorm_0", "block_0/LayerNorm_1", "LayerNorm_0"}),
        (_nnx_transformer, {"layers/0/pre_attention_norm", "layers/0/pre_ffw_norm", "final_norm"}),
        (_eqx_transformer, set()),
    ],
    ids=["linen", "nnx", "equinox"],
)
def test_advice_holds_for_dynamic_loss_scaling_under_the_policy(make, norms):
    from user_models import token_batches

    batches = token_batches(jax.random.key(0), STEPS)
    params, apply = make()
    report = jmp.debug_precision(_lm_loss(apply), params, batches[0], dtype="float16")
    advice = report.advice()
    print(f"\n{report}")
    # Judged as the policy runs it: float16 values and operations only. The norms the policy
    # keeps in float32 stay there (and are not judged in float16); no matmul layer moves out.
    assert report.judged == "target"
    # NNX's -2.3819763e38 mask becomes -inf in float16: a mask, not an overflow or a first inf.
    assert report.origin is None and not any(s.overflow for s in report.layers)
    assert advice["overrides"] == dict.fromkeys(norms, "float32")
    assert advice["islands"] == {}
    # Dynamic scaling from 2**15, growing every 10 finite steps (every step until the first
    # overflow): where it settles over the first 50 steps, before the gradients shrink as the
    # loss falls, against the advised initial scale.
    dynamic_scales, dynamic_losses = _train(
        params, _lm_loss(apply), jmp.DynamicLossScale(2.0**15, period=10, warmup=True), batches
    )
    settled = float(np.median(dynamic_scales[:50]))
    initial = math.log2(advice["loss_scale"]["initial"])
    # The advice applied: its overrides (Flax) and its initial scale.
    params, apply = make(advice["overrides"] or None)
    scale = jmp.DynamicLossScale(
        advice["loss_scale"]["initial"], period=10, hysteresis=advice["loss_scale"]["hysteresis"]
    )
    advised_scales, advised_losses = _train(params, _lm_loss(apply), scale, batches)
    backoffs = [int(np.sum(np.diff(s) < 0)) for s in (dynamic_scales, advised_scales)]
    print(f"advised 2^{initial:g}; dynamic settles at 2^{settled:g}; back-offs {backoffs}; "
          f"final loss {advised_losses[-5:].mean():.4f} (advised) against "
          f"{dynamic_losses[-5:].mean():.4f} (dynamic), from {dynamic_losses[0]:.4f}")  # fmt: skip
    assert abs(initial - settled) <= 2
    assert backoffs[1] <= backoffs[0]  # no step more skipped for following the advice
    assert np.isfinite(advised_losses).all()
    assert advised_losses[-5:].mean() < 0.2 * advised_losses[0]  # it learns
    assert abs(advised_losses[-5:].mean() / dynamic_losses[-5:].mean() - 1) < 0.1


def test_other_threads_call_modules_as_they_are_while_the_debugger_names_them():
    import threading

    from flax import nnx

    from jmp_policy._core import naming as _naming

    layer, errors = nnx.Linear(4, 4, rngs=nnx.Rngs(0)), []

    def other():
        try:
            assert layer(jnp.ones((2, 4))).shape == (2, 4)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    with _naming.module_names():  # this thread's calls are named while it traces
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert errors == []


class Rescaled(nn.Module):
    """Scaled down 1e12 and back: its values span more binades than float16 holds (it has no
    matmul: the advice sends it to float32), and its gradient is 1e12 times the others'
    inside (as an RMSNorm's backward values are at a small variance)."""

    @nn.compact
    def __call__(self, x):
        return (x * 1e-12) * 1e12


class WithRescaled(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = Rescaled(name="rescaled")(nn.Dense(8, name="embed")(x))
        return nn.Dense(2, name="head")(h)


def test_the_loss_scale_is_judged_on_the_gradients_the_advice_leaves_in_half_precision():
    """A layer the advice moves to float32 (its activations do not fit float16) does not set
    the loss scale, however large its backward values: the scale is the one the gradients left
    in float16 allow (advice that moved a layer to float32 and still sized the scale by it
    would contradict itself)."""
    model = WithRescaled()
    params = model.init(jax.random.key(1), X)["params"]

    def loss(params, x):
        logits = model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, Y).mean()

    report = jmp.debug_precision(loss, params, X)
    advice = report.advice()
    assert advice["overrides"] == {"rescaled": "float32"}
    backward = [s for s in report.layers if s.direction == "backward" and s.amax > 0]
    inside = max(s.amax for s in backward if s.layer == "WithRescaled/rescaled")
    rest = max(s.amax for s in backward if s.layer != "WithRescaled/rescaled")
    assert inside > 1000 * rest  # judged with it, the scale would be 2^10 lower
    largest = float(jnp.finfo(jnp.float16).max)
    assert advice["loss_scale"]["initial"] == 2.0 ** math.floor(math.log2(largest / 2 / rest))
