"""NVFP4's training recipe as a policy (issue 74): `mixed_nvfp4` with `fp8_scaling=nvfp4.Recipe()`
under autocast and the Linen, NNX and Equinox policies: every linear layer's three GEMMs in
NVFP4 (as the recipe's own op computes them), the key of each layer's draws carried as state,
advanced by each applied step and kept by a skipped one, saved and restored by orbax, and
NVFP4 GEMMs for all three products in the CUDA program."""

from __future__ import annotations

import functools
import re

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import export

import jmp_policy as jmp
from jmp_policy import block_scaled, nvfp4

RECIPE = nvfp4.Recipe()


class Block(nn.Module):
    dim: int = 32

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2)(h, h)
        h = nn.LayerNorm()(x)
        return x + nn.Dense(self.dim)(nn.gelu(nn.Dense(2 * self.dim)(h)))


class LinenLM(nn.Module):
    vocab: int = 24

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, 32)(tokens)
        return nn.Dense(self.vocab, name="head")(Block()(x))


class NnxLM(nnx.Module):
    """A pre-norm transformer block as Flax's NNX examples write one."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(24, 32, rngs=rngs)
        self.norm1 = nnx.LayerNorm(32, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            num_heads=2, in_features=32, decode=False, rngs=rngs
        )
        self.norm2 = nnx.LayerNorm(32, rngs=rngs)
        self.up = nnx.Linear(32, 64, rngs=rngs)
        self.down = nnx.Linear(64, 32, rngs=rngs)
        self.head = nnx.Linear(32, 24, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = x + self.attention(self.norm1(x))
        x = x + self.down(nnx.gelu(self.up(self.norm2(x))))
        return self.head(x)


class EqxLM(eqx.Module):
    """Equinox's way: one sequence per call (`jax.vmap` over the batch outside), each layer
    `jax.vmap`ped over the tokens: the program multiplies `weight @ x`."""

    embed: eqx.nn.Embedding
    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 5)
        self.embed = eqx.nn.Embedding(24, 32, key=k[0])
        self.norm1, self.norm2 = eqx.nn.LayerNorm(32), eqx.nn.LayerNorm(32)
        self.attention = eqx.nn.MultiheadAttention(2, 32, key=k[1])
        self.up = eqx.nn.Linear(32, 64, key=k[2])
        self.down = eqx.nn.Linear(64, 32, key=k[3])
        self.head = eqx.nn.Linear(32, 24, key=k[4])

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        h = jax.vmap(self.norm1)(x)
        x = x + self.attention(h, h, h)
        h = jax.vmap(self.norm2)(x)
        x = x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(h)))
        return jax.vmap(self.head)(x)


class OverTokens(eqx.Module):
    layer: eqx.nn.Linear

    def __call__(self, x):
        return jax.vmap(self.layer)(x)


def _tokens(seed=0):
    tokens = jax.random.randint(jax.random.key(seed), (2, 17), 0, 24)
    return tokens[:, :-1], tokens[:, 1:]  # 2 x 16 tokens: 32, two blocks of 16


def _xent(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


def _integration(name):
    """`(trainable, loss(trainable, x, y), states(trainable))` of a small model under the recipe,
    the NVFP4 layers' states a flat list."""
    x, _ = _tokens()
    if name in ("autocast", "linen"):
        if name == "autocast":
            model = LinenLM()
            params = model.init(jax.random.key(0), x)["params"]
            f = jmp.autocast(model.apply, "mixed_nvfp4", fp8_scaling=RECIPE)
            tree = {"params": params, "fp8_state": f.init_fp8_state({"params": params}, x)}

            def loss(tree, x, y):
                logits = f({"params": tree["params"]}, x, fp8_state=tree["fp8_state"])
                return _xent(logits, y)
        else:
            model = jmp.linen.mixed_precision(LinenLM(), "mixed_nvfp4", fp8_scaling=RECIPE)
            tree = model.init(jax.random.key(0), x)

            def loss(tree, x, y):
                return _xent(model.apply(tree, x), y)

        return tree, loss, lambda t: jax.tree.leaves(t["fp8_state"], is_leaf=_is_state)
    if name == "nnx":
        model = jmp.nnx.mixed_precision(NnxLM(nnx.Rngs(0)), "mixed_nvfp4", fp8_scaling=RECIPE)
        graphdef, state = nnx.split(model)

        def loss(state, x, y):
            return _xent(nnx.merge(graphdef, state)(x), y)

        return state, loss, lambda s: [v for v in jax.tree.leaves(s, is_leaf=_is_state)
                                       if _is_state(v)]  # fmt: skip
    model = jmp.eqx.mixed_precision(EqxLM(jax.random.key(0)), "mixed_nvfp4", fp8_scaling=RECIPE)
    model = model.init_fp8_state(x[0])
    arrays, static = eqx.partition(model, eqx.is_array)

    def loss(arrays, x, y):
        return _xent(jax.vmap(eqx.combine(arrays, static))(x), y)

    return arrays, loss, lambda a: list(a.fp8_state)


def _is_state(x):
    return isinstance(x, nvfp4.State)


def _step(loss, tx):
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(tree, opt_state, x, y, poison):
        s = jmp.get_loss_scale(opt_state)
        value, grads = jax.value_and_grad(lambda t: s.scale(loss(t, x, y) * poison))(tree)
        updates, opt_state = tx.update(grads, opt_state, tree)
        return optax.apply_updates(tree, updates), opt_state, s.unscale(value)

    return step


# Quantized layers: each block's query, key, value, output and two MLP layers.
LAYERS = {"autocast": 6, "linen": 6, "nnx": 6, "eqx": 6}


@pytest.mark.standard_promotion  # optax's adam mixes int32 and float
@pytest.mark.parametrize("name", ["autocast", "linen", "nnx", "eqx"])
def test_the_recipe_trains_and_advances_each_layers_key_by_the_steps_it_applies(name):
    tree, loss, states = _integration(name)
    x, y = _tokens()
    assert len(states(tree)) == LAYERS[name]
    keys = {tuple(np.asarray(s.key)) for s in states(tree)}
    assert len(keys) == LAYERS[name]  # no two layers draw alike
    # Every linear layer but the head multiplies in NVFP4, its three GEMMs each.
    counts = jmp.precision_report(lambda t: jax.grad(loss)(t, x, y), tree).counts["dot_general"]
    assert counts["nvfp4"] == 3 * LAYERS[name]
    assert set(counts) <= {"nvfp4", "bfloat16"}  # the head, attention: bfloat16
    tx = jmp.loss_scaling(optax.adam(1e-2), jmp.DynamicLossScale(2.0**10))
    step = _step(loss, tx)
    opt_state = tx.init(tree)
    evaluate = jax.jit(loss)  # one program, not the recipe's operations compiled one by one
    first = float(evaluate(tree, x, y))
    expected = [nvfp4.advanced(s) for s in states(tree)]
    for i in range(12):
        tree, opt_state, value = step(tree, opt_state, x, y, jnp.float32(1.0))
        if i == 0:  # each layer's key is the one after its own
            for got, want in zip(states(tree), expected, strict=True):
                np.testing.assert_array_equal(got.key, want.key)
                assert float(got.uses) == 0.0
    assert float(evaluate(tree, x, y)) < 0.8 * first, name


@pytest.mark.standard_promotion  # optax's adam mixes int32 and float
@pytest.mark.parametrize("name", ["autocast", "nnx"])
def test_a_skipped_step_keeps_every_key_and_the_next_applied_one_advances_it(name):
    tree, loss, states = _integration(name)
    x, y = _tokens()
    tx = jmp.loss_scaling(optax.adam(1e-2), jmp.DynamicLossScale(2.0**10))
    step = _step(loss, tx)
    opt_state = tx.init(tree)
    tree, opt_state, _ = step(tree, opt_state, x, y, jnp.float32(1.0))
    inner = lambda o: jmp.scaling.find_loss_scaling_state(o).inner_state  # noqa: E731
    before = jax.tree.map(np.asarray, (tree, inner(opt_state)))
    tree, opt_state, _ = step(tree, opt_state, x, y, jnp.float32(jnp.inf))  # planted overflow
    assert bool(jmp.scaling.find_loss_scaling_state(opt_state).last_step_skipped)
    # Parameters, keys and the optimizer's own state, bit for bit.
    jax.tree.map(np.testing.assert_array_equal, (tree, inner(opt_state)), before)
    kept = jax.tree.map(np.asarray, states(tree))  # the step donates the tree's buffers
    tree, opt_state, _ = step(tree, opt_state, x, y, jnp.float32(1.0))
    for got, old in zip(states(tree), kept, strict=True):
        np.testing.assert_array_equal(got.key, nvfp4.advanced(old).key)


def _forward_and_gradients(fn, weight, x, *state):
    """`fn`'s output and its gradients in the weight and the input (a cotangent of ones), as
    one jitted program: eagerly, each of the recipe's operations compiled on its own (640
    compiles took half of this test's 15 s)."""

    @jax.jit
    def run(weight, x, state):
        out, pull = jax.vjp(fn, weight, x, *state)
        return out, pull(jnp.ones_like(out))[:2]

    return run(weight, x, state)


# A model of one layer (its last matmul is in NVFP4, which the policies warn of).
@pytest.mark.filterwarnings("ignore:jmp_policy.*last matmul before the output")
def test_every_integration_multiplies_as_the_recipes_own_op():
    """One layer, forward and gradients: autocast's and the Linen policy's Dense (`x @ kernel`),
    and the Equinox policy's Linear (`weight @ x`, per example), each equal to
    `nvfp4.linear_dot_general` with the layer's state, bit for bit."""
    x = jax.random.normal(jax.random.key(1), (2, 16, 32))
    dense = nn.Dense(64, use_bias=False)
    params = dense.init(jax.random.key(0), x)["params"]
    f = jmp.autocast(dense.apply, "mixed_nvfp4", fp8_scaling=RECIPE, fp8_exclude=())
    (state,) = f.init_fp8_state({"params": params}, x)
    dims = (((2,), (0,)), ((), ()))

    def direct(kernel, x, state):
        return nvfp4.linear_dot_general(x, kernel, dims, state, RECIPE, out_dtype=jnp.bfloat16)

    def through(kernel, x, state):
        return f({"params": {"kernel": kernel}}, x, fp8_state=(state,))

    def outputs(fn):
        return _forward_and_gradients(fn, params["kernel"], x, state)

    # autocast quantizes the float32 input as it is; Flax's Dense casts it to bfloat16 first.
    jax.tree.map(np.testing.assert_array_equal, outputs(through), outputs(direct))

    def direct(kernel, x, state):  # noqa: F811
        # Flax's Dense casts both to its dtype first (`promote_dtype`).
        # The policy's output dtype: float32.
        half = x.astype(jnp.bfloat16), kernel.astype(jnp.bfloat16)
        out = nvfp4.linear_dot_general(*half, dims, state, RECIPE, out_dtype=jnp.bfloat16)
        return out.astype(jnp.float32)

    linen = jmp.linen.mixed_precision(dense, "mixed_nvfp4", fp8_scaling=RECIPE)
    variables = linen.init(jax.random.key(0), x)
    layer_state = variables["fp8_state"]["matmul"]

    def through_linen(kernel, x, state):
        return linen.apply({"params": {"kernel": kernel}, "fp8_state": {"matmul": state}}, x)

    jax.tree.map(
        np.testing.assert_array_equal,
        _forward_and_gradients(through_linen, params["kernel"], x, layer_state),
        _forward_and_gradients(direct, params["kernel"], x, layer_state),
    )

    linear = eqx.nn.Linear(32, 64, use_bias=False, key=jax.random.key(0))
    model = jmp.eqx.mixed_precision(OverTokens(linear), "mixed_nvfp4", fp8_scaling=RECIPE)
    model = model.init_fp8_state(x[0])
    (eqx_state,) = model.fp8_state

    def through_eqx(weight, x):
        wrapped = eqx.tree_at(lambda m: m.model.layer.weight, model, weight)  # pyright: ignore
        return wrapped(x)

    def direct_eqx(weight, x):  # per example: `weight @ x[i].T`, the tokens after the weight
        return nvfp4.linear_dot_general(weight, x, (((1,), (1,)), ((), ())),
                                        eqx_state, RECIPE, weight="lhs",
                                        out_dtype=jnp.bfloat16).T.astype(jnp.float32)  # fmt: skip

    for i in range(2):
        jax.tree.map(
            np.testing.assert_array_equal,
            _forward_and_gradients(through_eqx, linear.weight, x[i]),
            _forward_and_gradients(direct_eqx, linear.weight, x[i]),
        )


@pytest.mark.standard_promotion  # optax's adam mixes int32 and float
def test_the_recipes_state_round_trips_through_orbax(tmp_path):
    """Parameters, NVFP4 keys and optimizer state saved after 2 steps, restored, and trained 2
    more: the same as training on without a restore."""
    import orbax.checkpoint as ocp

    tree, loss, states = _integration("autocast")
    x, y = _tokens()
    tx = jmp.loss_scaling(optax.adam(1e-2), jmp.DynamicLossScale(2.0**10))
    step = _step(loss, tx)
    opt_state = tx.init(tree)
    for _ in range(2):
        tree, opt_state, _ = step(tree, opt_state, x, y, jnp.float32(1.0))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "run", {"tree": tree, "opt_state": opt_state})
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"tree": tree, "opt_state": opt_state})
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(tmp_path / "run", target)
    assert all(isinstance(s, nvfp4.State) for s in states(restored["tree"]))
    resumed = (restored["tree"], restored["opt_state"])
    for _ in range(2):
        tree, opt_state, _ = step(tree, opt_state, x, y, jnp.float32(1.0))
        resumed = step(*resumed, x, y, jnp.float32(1.0))[:2]
    jax.tree.map(np.testing.assert_array_equal, resumed[0], tree)


@pytest.mark.parametrize("name", ["autocast", "linen", "nnx", "eqx"])
def test_the_cuda_train_step_holds_nvfp4_gemms_for_all_three_products(monkeypatch, name):
    """Where JAX's op runs on the device (Blackwell: `hardware_path`), each quantized layer's
    forward, data-gradient and weight-gradient GEMMs are `__op$block_scaled_dot` calls on
    float4_e2m1fn values with float8_e4m3fn scales: 3 x 6 in each block (Equinox's per example,
    under `vmap`, folded into one GEMM each)."""
    tree, loss, _ = _integration(name)
    x, y = _tokens()
    monkeypatch.setattr(nvfp4, "hardware_path", lambda: True)  # from here on: traced only
    module = export.export(
        jax.jit(jax.grad(loss)),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__op$block_scaled_dot")],
    )(tree, x, y).mlir_module()
    calls = [line for line in module.splitlines() if "custom_call @__op$block_scaled_dot" in line]
    # JAX's op is one function per shape in the module, called once per GEMM of that shape.
    assert calls and all(c.count("xf4E2M1FN>") == 2 and c.count("xf8E4M3FN>") == 2 for c in calls)
    report = jmp.precision_report(jax.grad(loss), tree, x, y)
    assert report.counts["dot_general"]["nvfp4"] == 3 * LAYERS[name]
    assert _called_gemms(module) == 3 * LAYERS[name]
    assert block_scaled.hardware_path() is False  # only the recipe's module was told otherwise


def _called_gemms(module: str) -> int:
    """The block-scaled GEMMs a StableHLO module runs: each function's own custom calls, times
    the calls of it from the public entry point on."""
    bodies = dict(
        re.findall(r"func\.func (?:public |private )?@([\w$.-]+)(.*?)\n  }", module, re.S)
    )

    def count(name: str) -> int:
        body = bodies[name]
        own = body.count("custom_call @__op$block_scaled_dot")
        return own + sum(count(callee) for callee in re.findall(r"\bcall @([\w$.-]+)\(", body))

    return count("main")


@pytest.mark.filterwarnings("ignore:jmp_policy.*last matmul before the output")
def test_the_recipe_is_checked_where_it_is_given():
    with pytest.raises(ValueError, match="mixed_nvfp4"):
        jmp.autocast(lambda a: a, "mixed_bfloat16", fp8_scaling=RECIPE)
    with pytest.raises(ValueError, match="mixed_nvfp4"):
        jmp.linen.mixed_precision(nn.Dense(4), "mixed_float8", fp8_scaling=RECIPE)
    with pytest.raises(TypeError, match="Recipe.seed"):
        nvfp4.Recipe(seed=-1)
    with pytest.raises(TypeError, match="Recipe.seed"):
        nvfp4.Recipe(seed=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`weight`"):
        nvfp4.linear_ineligible((16, 16), (16, 16), (((1,), (0,)), ((), ())), RECIPE, "middle")
    f = jmp.autocast(lambda w, x: x @ w, "mixed_nvfp4", fp8_scaling=RECIPE)
    with pytest.raises(ValueError, match="fp8_state"):
        f(jnp.ones((16, 16)), jnp.ones((16, 16)))
    # The next key is written as `next - params`: `update` needs the parameters.
    tree = {
        "w": jnp.ones((16, 16)),
        "fp8_state": f.init_fp8_state(jnp.ones((16, 16)), jnp.ones((16, 16))),
    }
    grads = jax.grad(lambda t: jnp.sum(f(t["w"], jnp.ones((16, 16)), fp8_state=t["fp8_state"])))(
        tree
    )
    tx = jmp.loss_scaling(optax.sgd(0.1), jmp.NoOpLossScale())
    with pytest.raises(ValueError, match="nvfp4.Recipe.*`tx.update\\(grads, opt_state, params\\)`"):
        tx.update(grads, tx.init(tree))


@pytest.mark.filterwarnings("ignore:jmp_policy.*last matmul before the output")
def test_a_scans_layers_each_get_their_own_key_and_each_advances():
    """Stacked weights under `lax.scan`: the state is stacked too, one key per layer."""

    def f(params, x):
        def body(h, w):
            return jax.nn.gelu(h @ w), None

        return jax.lax.scan(body, x, params["ws"])[0]

    params = {"ws": jax.random.normal(jax.random.key(0), (3, 32, 32)) * 0.2}
    x = jax.random.normal(jax.random.key(1), (16, 32))
    g = jmp.autocast(f, "mixed_nvfp4", fp8_scaling=RECIPE, fp8_exclude=())
    ((stacked,),) = g.init_fp8_state(params, x)
    assert stacked.key.shape == (3, 4) and len({tuple(k) for k in np.asarray(stacked.key)}) == 3
    tree = {"params": params, "fp8_state": ((stacked,),)}

    def loss(t):
        return jnp.sum(g(t["params"], x, fp8_state=t["fp8_state"]).astype(jnp.float32) ** 2)

    assert jmp.precision_report(jax.grad(loss), tree).counts["dot_general"] == {"nvfp4": 9}
    tx = jmp.loss_scaling(optax.sgd(1e-3), jmp.NoOpLossScale())
    updates, _ = tx.update(jax.jit(jax.grad(loss))(tree), tx.init(tree), tree)
    written = optax.apply_updates(tree, updates)["fp8_state"][0][0]
    for i in range(3):
        layer = jax.tree.map(lambda a: a[i], stacked)  # noqa: B023
        np.testing.assert_array_equal(written.key[i], nvfp4.advanced(layer).key)


def test_the_last_block_stays_in_bfloat16_by_an_override():
    """The recipe's bfloat16 layers as the Linen policy's overrides: the last block's matmuls in
    bfloat16, with no state; the first block's six in NVFP4."""

    class TwoBlocks(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(24, 32)(tokens)
            x = Block(name="Block_1")(Block(name="Block_0")(x))
            return nn.Dense(24, name="head")(x)

    x, y = _tokens()
    overrides = {**jmp.linen.NORMS_IN_FLOAT32, "Block_1": "mixed_bfloat16"}
    model = jmp.linen.mixed_precision(TwoBlocks(), "mixed_nvfp4", overrides, fp8_scaling=RECIPE)
    variables = model.init(jax.random.key(0), x)
    assert list(variables["fp8_state"]) == ["Block_0"]
    report = jmp.precision_report(jax.grad(lambda v: _xent(model.apply(v, x), y)), variables)
    assert report.counts["dot_general"]["nvfp4"] == 3 * 6  # 3 * 12 without the override


def test_linen_nn_scan_layers_each_draw_from_their_own_key():
    """Under `nn.scan` (`variable_axes={"params": 0, "fp8_state": 0}`, the `"params"` RNG split):
    each scanned layer's key comes from its own split of the init RNG, so no two draw alike;
    the parameters are the ones the model makes without the policy."""

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return x + nn.Dense(32)(jax.nn.relu(nn.Dense(64)(x))), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            scanned = nn.scan(
                Layer,
                variable_axes={"params": 0, "fp8_state": 0},
                split_rngs={"params": True},
                length=3,
            )
            return nn.Dense(16, name="head")(scanned()(x, None)[0])

    x = jax.random.normal(jax.random.key(1), (16, 32))
    model = jmp.linen.mixed_precision(Stack(), "mixed_nvfp4", fp8_scaling=RECIPE)
    variables = model.init(jax.random.key(0), x)
    states = jax.tree.leaves(variables["fp8_state"], is_leaf=_is_state)
    keys = {tuple(k) for s in states for k in np.asarray(s.key)}
    assert len(states) == 2 and len(keys) == 6  # 2 layers x 3 steps of the scan
    own = Stack().init(jax.random.key(0), x)["params"]
    jax.tree.map(np.testing.assert_array_equal, variables["params"], own)


class _NnxMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(32, 64, rngs=rngs)
        self.down = nnx.Linear(64, 32, rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.relu(self.up(x)))


class _NnxStack(nnx.Module):
    """Layers made under `nnx.vmap` and run under `nnx.scan`, as Flax's NNX guides stack them."""

    def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return _NnxMLP(rngs)

        self.layers = make(rngs)
        self.head = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, layer):
            return layer(x)

        return self.head(body(x, self.layers))


@pytest.mark.parametrize("policy", ["mixed_nvfp4", "mixed_float8"])
def test_nnx_layers_stacked_by_vmap_and_run_by_scan_take_a_state_per_layer(policy):
    """Before, the state was one per module whatever its kernel's leading axes, and `nnx.scan`
    failed to slice it (IndexError), for float8's delayed scaling too."""
    scaling = RECIPE if policy == "mixed_nvfp4" else "delayed"
    model = jmp.nnx.mixed_precision(_NnxStack(nnx.Rngs(0)), policy, fp8_scaling=scaling)
    x = jax.random.normal(jax.random.key(1), (16, 32))
    state = nnx.state(model.model.layers.up.dot_general)
    leading = {leaf.shape[0] for leaf in jax.tree.leaves(state)}
    assert leading == {3}  # each leaf stacked over the 3 layers
    graphdef, params = nnx.split(model)

    def loss(params):
        return jnp.sum(nnx.merge(graphdef, params)(x).astype(jnp.float32) ** 2)

    tx = jmp.loss_scaling(optax.sgd(1e-3), jmp.NoOpLossScale())
    updates, _ = tx.update(jax.jit(jax.grad(loss))(params), tx.init(params), params)
    written = nnx.merge(graphdef, optax.apply_updates(params, updates))
    stacked = written.model.layers.up.dot_general.state.get_value()
    if policy == "mixed_nvfp4":
        old = model.model.layers.up.dot_general.state.get_value()
        assert len({tuple(k) for k in np.asarray(old.key)}) == 3  # no two layers draw alike
        for i in range(3):
            layer = jax.tree.map(lambda a: a[i], old)  # noqa: B023
            np.testing.assert_array_equal(stacked.key[i], nvfp4.advanced(layer).key)
    else:  # each layer's input amax, its own
        amaxes = np.asarray(stacked.lhs.amax_history[:, 0])
        assert np.all(amaxes > 0) and len(set(amaxes.tolist())) == 3
