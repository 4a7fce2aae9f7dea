"""Reports on float8 and block-scaled models, as a user's decoder meets them: a decoder
written the usual way (token embedding, learned positions, pre-norm blocks of attention and a
GELU MLP, and a logits head named like any other layer), in Linen, NNX and Equinox, under
current scaling, delayed scaling and MXFP8, with the debugger called as docs/debugging.md
calls it: `debug_precision(loss_fn, *args)`."""

from __future__ import annotations

import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jmp_policy as jmp
from jmp_policy.errors import PrecisionWarning
from jmp_policy.fp8 import DelayedScaling

VOCAB, WIDTH, LENGTH, BLOCKS = 64, 32, 16, 1
RECIPES = {
    "current": ("mixed_float8", "tensorwise"),
    "delayed": ("mixed_float8", DelayedScaling()),
    "mxfp8": ("mixed_mxfp8", "tensorwise"),
}


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + nn.MultiHeadDotProductAttention(num_heads=4)(h, h, mask=mask)
        h = nn.LayerNorm()(x)
        return x + nn.Dense(WIDTH)(nn.gelu(nn.Dense(4 * WIDTH)(h)))


class LinenDecoder(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, WIDTH)(tokens)
        x = x + self.param("positions", nn.initializers.normal(0.02), (LENGTH, WIDTH))
        for _ in range(BLOCKS):
            x = LinenBlock()(x)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))  # the head: `Dense_0`


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.norm1, self.norm2 = nnx.LayerNorm(WIDTH, rngs=rngs), nnx.LayerNorm(WIDTH, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(4, WIDTH, decode=False, rngs=rngs)
        self.up = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs)
        self.down = nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        h = self.norm1(x)
        x = x + self.attention(h, mask=nnx.make_causal_mask(jnp.ones(x.shape[:2])))
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class NnxDecoder(nnx.Module):
    def __init__(self, rngs):
        self.embedding = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.positions = nnx.Param(0.02 * jax.random.normal(rngs.params(), (LENGTH, WIDTH)))
        self.blocks = nnx.List([NnxBlock(rngs) for _ in range(BLOCKS)])
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.out = nnx.Linear(WIDTH, VOCAB, rngs=rngs)  # the head

    def __call__(self, tokens):
        x = self.embedding(tokens) + self.positions[...].astype(jnp.bfloat16)
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x))


class EqxBlock(eqx.Module):
    norm1: eqx.nn.LayerNorm
    norm2: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(WIDTH), eqx.nn.LayerNorm(WIDTH)
        self.attention = eqx.nn.MultiheadAttention(4, WIDTH, key=k1)
        self.up = eqx.nn.Linear(WIDTH, 4 * WIDTH, key=k2)
        self.down = eqx.nn.Linear(4 * WIDTH, WIDTH, key=k3)

    def __call__(self, x):  # one sequence, (length, width)
        h = jax.vmap(self.norm1)(x)
        mask = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
        x = x + self.attention(h, h, h, mask=mask)
        h = jax.vmap(self.norm2)(x)
        return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(h)))


class EqxDecoder(eqx.Module):
    embedding: eqx.nn.Embedding
    positions: jax.Array
    blocks: list
    norm: eqx.nn.LayerNorm
    out: eqx.nn.Linear  # the head

    def __init__(self, key):
        keys = jax.random.split(key, BLOCKS + 3)
        self.embedding = eqx.nn.Embedding(VOCAB, WIDTH, key=keys[0])
        self.positions = 0.02 * jax.random.normal(keys[1], (LENGTH, WIDTH))
        self.blocks = [EqxBlock(k) for k in keys[2:-1]]
        self.norm = eqx.nn.LayerNorm(WIDTH)
        self.out = eqx.nn.Linear(WIDTH, VOCAB, key=keys[-1])

    def __call__(self, tokens):  # a batch of sequences
        def one(seq):
            x = jax.vmap(self.embedding)(seq) + self.positions
            for block in self.blocks:
                x = block(x)
            return jax.vmap(self.out)(jax.vmap(self.norm)(x))

        return jax.vmap(one)(tokens)


def _batch():
    tokens = jax.random.randint(jax.random.key(0), (8, LENGTH + 1), 0, VOCAB)
    return tokens[:, :-1], tokens[:, 1:]


def _xent(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


def _setup(framework, recipe):
    """`(loss_fn, args)` of the decoder under `recipe`, as docs/fp8.md writes them."""
    policy, scaling = RECIPES[recipe]
    x, y = _batch()
    if framework == "linen":
        model = jmp.linen.mixed_precision(LinenDecoder(), policy, fp8_scaling=scaling)
        variables = model.init(jax.random.key(1), x)

        def linen_loss(variables, x, y):
            return _xent(model.apply(variables, x), y)

        return linen_loss, (variables, x, y)
    if framework == "nnx":
        model = jmp.nnx.mixed_precision(NnxDecoder(nnx.Rngs(1)), policy, fp8_scaling=scaling)

        def nnx_loss(model, x, y):
            return _xent(model(x), y)

        return nnx_loss, (model, x, y)
    model = jmp.eqx.mixed_precision(EqxDecoder(jax.random.key(1)), policy, fp8_scaling=scaling)
    if isinstance(scaling, DelayedScaling):
        model = model.init_fp8_state(x)

    def eqx_loss(model, x, y):
        return _xent(model(x), y)

    return eqx_loss, (model, x, y)


HEADS = {"linen": "Dense_0", "nnx": "out", "eqx": "the matmul on out.weight"}


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("framework", ["linen", "nnx", "eqx"])
def test_debugger_on_a_users_float8_decoder(framework, recipe):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss_fn, args = _setup(framework, recipe)
        jit = {"linen": jax.jit, "nnx": nnx.jit, "eqx": eqx.filter_jit}[framework]
        loss = float(jit(loss_fn)(*args))
    # The head, named like any other layer, runs in the low-precision format: a warning says so.
    said = [str(w.message) for w in caught if issubclass(w.category, PrecisionWarning)]
    assert any(f"{HEADS[framework]} is the last matmul before the output" in m for m in said), said
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionWarning)  # the head's warning, asserted above
        report = jmp.debug_precision(loss_fn, *args)
    text = str(report)
    # The real step is finite, and so is the debugger's verdict (a scale of an empty amax
    # history, inf, that a `where` discards, is not an inf of the program).
    assert report.origin is None and "no inf/NaN" in text, text
    assert report.loss == pytest.approx(loss, rel=1e-6)  # the loss `jit` computes
    assert report.judged == "target" and "float8_e4m3fn" in report.held_dtypes
    if recipe == "delayed":
        assert report.warmed_states > 0  # judged with the scales a step gives, not scale 1
    # Every float8 layer holds: the advice moves no layer that multiplies in float8.
    low = {s.layer for s in report.target_layers if s.dtype.startswith("float8")}
    assert low, text
    moved = set(report.advice()["overrides"])
    for layer in low:
        path = layer.split("/", 1)[-1]
        assert path not in moved, (path, moved)
    # Under scaling, float8 operands use their range: underflow well under 1%.
    worst = max(s.underflow for s in report.target_layers if s.dtype == "float8_e4m3fn")
    assert worst < 0.01, text


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_every_reason_for_a_matmul_left_out_names_a_cause(recipe):
    x, _ = _batch()
    model = jmp.linen.mixed_precision(LinenDecoder(), RECIPES[recipe][0])
    variables = model.init(jax.random.key(1), x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionWarning)  # the unnamed head's, asserted above
        report = jmp.precision_report(model.apply, variables, x)
    assert report.fp8_left_out  # attention's scores and weighted sum
    for dtype, reason, _ in report.fp8_left_out:
        assert reason != f"left in {dtype}" and dtype not in reason.split(":")[0], reason
        assert any(cause in reason for cause in ("Dense", "FP8_EXCLUDE", "multiple", "blocks"))


class _Regression(nn.Module):
    """Sums (not means) its squared errors over the batch: gradients of a few hundred, which
    float16 holds unscaled but not at the default initial scale 2^15."""

    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            x = nn.relu(nn.Dense(128)(x))
        return nn.Dense(1)(x)[:, 0]


def test_advised_scale_trains_without_the_skips_the_default_scale_makes():
    model = jmp.linen.mixed_precision(_Regression(), "mixed_float16")
    x = jax.random.normal(jax.random.key(0), (64, 32))
    y = 30.0 + x[:, 0]
    params = model.init(jax.random.key(1), x)["params"]

    def loss_fn(params, x, y):
        return jnp.sum((model.apply({"params": params}, x) - y) ** 2)

    # At 2^15 the float16 backward pass overflows: the debugger finds it.
    report = jmp.debug_precision(loss_fn, params, x, y, loss_scale=2.0**15)
    assert report.origin is not None and report.origin.direction == "backward", str(report)
    advised = report.advice()["loss_scale"]["initial"]
    assert advised < 2.0**15

    def skips(initial):
        tx = jmp.loss_scaling(optax.sgd(1e-6), jmp.DynamicLossScale(initial))
        opt_state = tx.init(params)

        @jax.jit
        def step(params, opt_state):
            _, grads = jmp.value_and_scaled_grad(loss_fn)(opt_state, params, x, y)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        p, s = params, opt_state
        for _ in range(10):
            p, s = step(p, s)
        return int(s.skipped_steps), float(s.loss_scale.loss_scale)

    skipped, settled = skips(2.0**15)
    assert skipped >= 1  # the default scale skips at the start, as the debugger said
    assert skips(advised) == (0, advised)  # its advice does not
    # Not needlessly small: within two doublings of where backing off from 2^15 settled (one
    # doubling of headroom is the advice's rule).
    assert settled / 4 <= advised < settled
    # And at the advised scale the debugger's verdict agrees: nothing overflows.
    assert jmp.debug_precision(loss_fn, params, x, y, loss_scale=advised).origin is None


def test_a_head_in_no_module_on_no_named_input_is_told_to_take_a_name_scope():
    """A matmul outside any module, on positional arguments (`lambda w, x: x @ w`), has no path
    for `fp8_exclude` to match: the warning says to give it one, and that name keeps it in
    bfloat16."""

    def head(w, x):
        return x @ w

    def named(w, x):
        with jax.named_scope("head"):
            return x @ w

    w, x = jnp.ones((32, 32)), jnp.ones((16, 32))
    with pytest.warns(PrecisionWarning, match=r"\(top level\).*jax.named_scope\('head'\)"):
        jmp.autocast(head, "mixed_float8")(w, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionWarning)
        counts = jmp.precision_report(jmp.autocast(named, "mixed_float8"), w, x).counts
    assert counts["dot_general"] == {"bfloat16": 1}
