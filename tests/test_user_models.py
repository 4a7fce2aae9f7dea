"""The Flax integrations on model code written the way other people write it.

Explicit `dtype=self.dtype` / `dtype=config.dtype` plumbing with a float32 default (Flax's own
examples), `setup`-style modules, integer dtypes beside floating ones; and the warning that
says when a matmul or conv still runs in float32.
"""

import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from models import dot_operand_types
from user_models import (
    LinenTransformer,
    ResNet18,
    SetupMLP,
    TransformerConfig,
    image_batches,
    token_batches,
)

import jmp_policy as jmp
from jmp_policy._reports.census import compute_dtype, iter_equations

pytestmark = pytest.mark.standard_promotion  # user code: optax's Adam mixes float and int


def _dtypes(jaxpr, primitive):
    return [compute_dtype(e) for e in iter_equations(jaxpr) if e.primitive.name == primitive]


def _half_share(dtypes):
    return sum(d == jnp.float16 for d in dtypes) / len(dtypes)


def _scale(policy):
    half = policy.compute_dtype == jnp.float16
    return jmp.DynamicLossScale(2.0**15) if half else jmp.NoOpLossScale()


def _train_resnet(policy_name, steps=20):
    """Flax's ImageNet recipe: BatchNorm over the 'batch' axis, gradients averaged over it."""
    policy = jmp.get_policy(policy_name)
    model = jmp.linen.mixed_precision(ResNet18(num_classes=4, num_filters=8), policy)
    images, labels = image_batches(jax.random.key(0), steps)
    variables = model.init(jax.random.key(1), images[0], train=False)
    params, stats = variables["params"], variables["batch_stats"]
    tx = jmp.loss_scaling(optax.adam(3e-3), _scale(policy), axis_name="batch")
    opt_state = tx.init(params)
    mesh = jax.make_mesh((len(jax.devices()),), ("batch",))

    def loss_fn(params, stats, x, y):
        logits, new = model.apply(
            {"params": params, "batch_stats": stats}, x, mutable=["batch_stats"]
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, new["batch_stats"]

    def step(params, stats, opt_state, x, y):
        (loss, stats), grads = jmp.value_and_scaled_grad(loss_fn, has_aux=True)(
            opt_state, params, stats, x, y
        )
        grads, loss = jax.lax.pmean((grads, loss), "batch")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state, loss

    put = lambda tree, spec: jax.device_put(tree, NamedSharding(mesh, spec))  # noqa: E731
    images, labels = put(images, P(None, "batch")), put(labels, P(None, "batch"))
    params, stats, opt_state = put(params, P()), put(stats, P()), put(opt_state, P())
    specs = (P(), P(), P(), P("batch"), P("batch"))
    train_step = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=specs, out_specs=(P(), P(), P(), P()))
    )
    jaxpr = jax.make_jaxpr(train_step)(params, stats, opt_state, images[0], labels[0])
    losses = []
    for i in range(steps):
        params, stats, opt_state, loss = train_step(params, stats, opt_state, images[i], labels[i])
        losses.append(float(loss))
    return jaxpr, stats, float(np.mean(losses[-5:])), losses


def test_imagenet_style_resnet18_trains_in_float16_under_shard_map():
    jaxpr, stats, final16, losses = _train_resnet("mixed_float16")
    _, _, final32, _ = _train_resnet("float32")
    convs = _dtypes(jaxpr, "conv_general_dilated")
    print(f"convs in float16: {sum(d == jnp.float16 for d in convs)} of {len(convs)}; "
          f"final loss {final16:.4f} against float32's {final32:.4f}")  # fmt: skip
    # 20 forward, 39 backward: the training step of ResNet18, each conv's weight gradient and
    # every input gradient but the stem's (the images': nothing uses it). Before the engine
    # took the matmuls over from Flax's layers (8ed334e), the stem's conv hook made it too
    # (60), and XLA dropped it.
    assert len(convs) == 59
    assert _half_share(convs) >= 0.9
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(stats))
    assert final16 < losses[0]  # it learns
    assert abs(final16 / final32 - 1) < 0.05


def _train_transformer(policy_name, steps=40):
    policy = jmp.get_policy(policy_name)
    model = jmp.linen.mixed_precision(LinenTransformer(TransformerConfig()), policy)
    tokens = token_batches(jax.random.key(0), steps)
    params = model.init(jax.random.key(1), tokens[0])["params"]
    tx = jmp.loss_scaling(optax.adam(3e-3), _scale(policy))
    opt_state = tx.init(params)

    def loss_fn(params, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @jax.jit
    def train_step(params, opt_state, tokens):
        loss, grads = jmp.value_and_scaled_grad(loss_fn)(opt_state, params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    with warnings.catch_warnings():
        warnings.simplefilter("error", jmp.errors.PrecisionWarning)  # nothing slipped through
        jaxpr = jax.make_jaxpr(train_step)(params, opt_state, tokens[0])
    losses = []
    for i in range(steps):
        params, opt_state, loss = train_step(params, opt_state, tokens[i])
        losses.append(float(loss))
    return jaxpr, float(np.mean(losses[-5:])), losses


def test_config_dataclass_transformer_trains_in_float16():
    jaxpr, final16, losses = _train_transformer("mixed_float16")
    _, final32, _ = _train_transformer("float32")
    dots = _dtypes(jaxpr, "dot_general")
    print(f"dot_generals in float16: {sum(d == jnp.float16 for d in dots)} of {len(dots)}; "
          f"final loss {final16:.4f} against float32's {final32:.4f}")  # fmt: skip
    assert _half_share(dots) >= 0.9
    assert final16 < 0.5 * losses[0]
    assert abs(final16 / final32 - 1) < 0.05


def test_setup_style_children_follow_the_policy():
    model = jmp.linen.mixed_precision(SetupMLP((16, 16, 4)), jmp.get_policy("mixed_bfloat16"))
    x = jnp.ones((2, 8))
    variables = model.init(jax.random.key(0), x)
    report = jmp.precision_report(model.apply, variables, x)
    assert report.counts["dot_general"] == {"bfloat16": 3}
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(variables))


class TwoLines(nn.Module):  # the repro
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.Dense(16, dtype=self.dtype)(x))


def test_explicit_float32_dtype_no_longer_wins_over_the_policy():
    model = jmp.linen.mixed_precision(TwoLines(), jmp.get_policy("mixed_float16"))
    x = jnp.ones((2, 8))
    variables = model.init(jax.random.key(0), x)
    report = jmp.precision_report(model.apply, variables, x)
    assert report.counts["dot_general"] == {"float16": 2}
    assert report.half_matmul_flop_share == 1.0
    assert report.float32_matmuls == ()


class CastsUp(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8)(x)
        w = self.param("w", nn.initializers.ones, (8, 4))
        # The model's own code widens a half-precision activation: this matmul is float32.
        return h.astype(jnp.float32) @ w.astype(jnp.float32) + nn.Dense(4, name="head")(h)


def test_float32_matmuls_outside_overrides_warn_once_and_are_reported():
    overrides = {**jmp.linen.NORMS_IN_FLOAT32, "head": jmp.get_policy("float32")}
    model = jmp.linen.mixed_precision(CastsUp(), jmp.get_policy("mixed_float16"), overrides)
    x = jnp.ones((2, 8))
    variables = model.init(jax.random.key(0), x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = jax.jit(model.apply)
        step(variables, x)
        step(variables, x + 1)
        model.apply(variables, x)
    messages = [
        str(w.message) for w in caught if issubclass(w.category, jmp.errors.PrecisionWarning)
    ]
    assert len(messages) == 1, messages
    assert "1 matmuls/convs still run in float32" in messages[0]
    assert "CastsUp: an operand is cast from float16 to float32" in messages[0]
    report = jmp.precision_report(model.apply, variables, x)
    by_override = [m for m in report.float32_matmuls if m[3]]
    slipped = [m for m in report.float32_matmuls if not m[3]]
    assert [m[1] for m in by_override] == ["CastsUp/head"]
    assert [m[1] for m in slipped] == ["CastsUp"] and "cast from float16" in slipped[0][2]
    assert "1 by override or float32 region, 1 not" in str(report)


def test_a_float32_policy_never_warns():
    model = jmp.linen.mixed_precision(CastsUp(), jmp.get_policy("float32"))
    x = jnp.ones((2, 8))
    variables = model.init(jax.random.key(0), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jmp.errors.PrecisionWarning)
        model.apply(variables, x)


class IndexDtype(nn.Module):
    dtype: Any = jnp.int32  # an index dtype, not a compute dtype

    @nn.compact
    def __call__(self, x):
        idx = jnp.arange(x.shape[-1], dtype=self.dtype)
        return nn.Dense(4)(x[:, idx])


def test_integer_dtypes_are_never_touched_in_linen():
    model = jmp.linen.mixed_precision(IndexDtype(), jmp.get_policy("mixed_float16"))
    x = jnp.ones((2, 8))
    variables = model.init(jax.random.key(0), x)
    assert model.apply(variables, x).dtype == jnp.float32
    config = TransformerConfig(num_layers=1)
    mixed = jmp.linen.mixed_precision(LinenTransformer(config), jmp.get_policy("mixed_float16"))
    tokens = token_batches(jax.random.key(0), 1)[0]
    logits = mixed.apply(mixed.init(jax.random.key(1), tokens), tokens)
    assert logits.shape == (8, 16, 64) and config.index_dtype == jnp.int32


class NNXIndexed(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(8, 8, rngs=rngs)
        self.head = nnx.Linear(8, 8, rngs=rngs)
        self.dtype = jnp.int32  # for indices
        self.w = nnx.Param(jnp.ones((8, 8)))

    def __call__(self, x):
        idx = jnp.arange(8, dtype=self.dtype)
        h = self.linear(x)[:, idx]
        return self.head(h) + h.astype(jnp.float32) @ self.w[...]


class NNXModel(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([NNXIndexed(rngs), NNXIndexed(rngs)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_nnx_keeps_integer_dtypes_names_paths_and_warns_once():
    overrides = {**jmp.nnx.NORMS_IN_FLOAT32, "*/head": jmp.get_policy("float32")}
    model = jmp.nnx.mixed_precision(
        NNXModel(nnx.Rngs(0)), jmp.get_policy("mixed_float16"), overrides
    )
    layer = model.model.layers[0]
    assert layer.dtype == jnp.int32 and layer.linear.dtype == jnp.float16
    x = jnp.ones((2, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = nnx.jit(lambda m, x: m(x))
        step(model, x)
        step(model, x)
        model(x)
    messages = [
        str(w.message) for w in caught if issubclass(w.category, jmp.errors.PrecisionWarning)
    ]
    assert len(messages) == 1, messages
    # It points at the line that called the model (a lambda of this file's).
    assert [w.filename for w in caught if issubclass(w.category, jmp.errors.PrecisionWarning)] == [
        __file__
    ]
    assert "layers/0: an operand is cast from float16" in messages[0]
    assert "layers/1: an operand is cast from float16" in messages[0]
    # The report names layers as the precision debugger prints them (the root's class first;
    # `overrides` take either form).
    report = jmp.precision_report(lambda x: model(x), x)
    assert sorted(m[1] for m in report.float32_matmuls if m[3]) == [
        "NNXModel/layers/0/head",
        "NNXModel/layers/1/head",
    ]
    assert report.counts["dot_general"] == {"float16": 2, "float32": 4}


class OwnParamsLinen(nn.Module):
    @nn.compact
    def __call__(self, x):
        w1 = self.param("w1", nn.initializers.lecun_normal(), (x.shape[-1], 32))
        b1 = self.param("b1", nn.initializers.zeros, (32,))
        w2 = self.param("w2", nn.initializers.lecun_normal(), (32, 4))
        return nn.relu(x @ w1 + b1) @ w2


class OwnParamsLinear(nnx.Module):  # as NNX's basics write a layer
    def __init__(self, din, dout, rngs):
        self.w1 = nnx.Param(jax.random.normal(rngs.params(), (din, dout)) / din**0.5)
        self.b1 = nnx.Param(jnp.zeros((dout,)))

    def __call__(self, x):
        return x @ self.w1 + self.b1


class OwnParamsNNX(nnx.Module):
    def __init__(self, rngs):
        self.hidden = OwnParamsLinear(8, 32, rngs)
        self.out = OwnParamsLinear(32, 4, rngs)
        self.scale = nnx.Param(jnp.ones((4, 4)))  # the root's own weight, used directly

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x))) @ self.scale


def _own_params_loss(integration, policy):
    """`(loss, grad_fn, weights, x)`."""
    x = jax.random.normal(jax.random.key(0), (16, 8))
    if integration == "linen":
        model = jmp.linen.mixed_precision(OwnParamsLinen(), policy)
        params = model.init(jax.random.key(1), x)["params"]
        loss = lambda p, x: jnp.mean(model.apply({"params": p}, x) ** 2)  # noqa: E731
        return loss, jax.value_and_grad, params, x
    model = jmp.nnx.mixed_precision(OwnParamsNNX(nnx.Rngs(1)), policy)
    return lambda m, x: jnp.mean(m(x) ** 2), nnx.value_and_grad, model, x


@pytest.mark.parametrize("integration", ["linen", "nnx"])
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_a_models_own_weights_are_cast_at_their_use(integration, policy):
    """`x @ self.w + self.b` on the model's own weights (a Linen `self.param`, an NNX
    module's `nnx.Param`s) runs in the compute dtype, with no PrecisionWarning; the weights
    stay float32, their gradients are made in float32, and the values are float32's."""
    loss_fn, grad_fn, weights, x = _own_params_loss(integration, policy)
    step = grad_fn(loss_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jmp.errors.PrecisionWarning)
        loss, grads = jax.jit(step)(weights, x)
        # XLA:CPU has no bfloat16 matmul with a float32 result: on this machine a weight
        # gradient's operands are widened (`jmp_policy.matmul`), so bfloat16's forward pass.
        report = jmp.precision_report(step if policy == "mixed_float16" else loss_fn, weights, x)
    assert report.half_matmul_flop_share >= 0.99, report.counts
    if policy == "mixed_bfloat16" and jax.default_backend() == "cpu":
        # The weight gradients' matmuls are float32 on this CPU, and the report says why.
        widened = jmp.precision_report(step, weights, x).float32_matmuls
        assert widened and all("XLA:CPU has no bfloat16" in m[2] for m in widened), widened
    n_matmuls = (2 if integration == "linen" else 3) * (3 if policy == "mixed_float16" else 1)
    assert report.counts["dot_general"] == {policy[6:]: n_matmuls}
    ref_loss, _, ref_weights, _ = _own_params_loss(integration, jmp.get_policy("float32"))
    reference = ref_loss(ref_weights, x)  # the same initial weights
    np.testing.assert_allclose(float(loss), float(reference), rtol=2e-2)
    leaves = jax.tree.leaves(nnx.state(grads, nnx.Param) if integration == "nnx" else grads)
    assert leaves and all(g.dtype == jnp.float32 for g in leaves)
    if integration == "nnx":  # the stored weights are float32 after the call
        assert all(w.dtype == jnp.float32 for w in jax.tree.leaves(nnx.state(weights, nnx.Param)))


def test_bfloat16_weight_gradients_are_widened_for_cpu_only():
    """XLA:CPU cannot run a bfloat16 x bfloat16 -> float32 matmul, so `jmp_policy.matmul`
    widens a weight gradient's operands, but only in the program lowered for CPU: the same
    step lowered for a GPU or a TPU runs every matmul in bfloat16."""
    loss_fn, _, params, x = _own_params_loss("linen", "mixed_bfloat16")
    step = jax.value_and_grad(loss_fn)
    on_cpu = dot_operand_types(step, params, x, platform="cpu")
    assert ("f32", "f32") in on_cpu and ("bf16", "bf16") in on_cpu, on_cpu
    for platform in ("cuda", "tpu"):
        types = dot_operand_types(step, params, x, platform=platform)
        assert len(types) == len(on_cpu) and set(types) == {("bf16", "bf16")}, (platform, types)
