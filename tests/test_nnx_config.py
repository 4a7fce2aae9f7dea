"""An NNX model whose config holds a list (issue 71, point 1): users write
`TransformerConfig(attention_types=[...])` where Flax's presets write a tuple. The model runs
under `nnx.jit`, so it must run and train under `nnx.mixed_precision` and `autocast` too: the
programs they keep are found by equality, not by hashing the model's static attributes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_policy as jmp

pytestmark = pytest.mark.standard_promotion  # optax.adam mixes float and int32


@dataclasses.dataclass  # not frozen, and holding a list: unhashable
class Config:
    kinds: list
    width: int = 16


class Block(nnx.Module):
    def __init__(self, config: Config, rngs: nnx.Rngs):
        self.config = config
        self.layers = nnx.List(
            [nnx.Linear(config.width, config.width, rngs=rngs) for _ in config.kinds]
        )
        self.norm = nnx.LayerNorm(config.width, rngs=rngs)
        self.head = nnx.Linear(config.width, 1, rngs=rngs)

    def __call__(self, x):
        for kind, layer in zip(self.config.kinds, self.layers, strict=True):
            x = layer(x)
            x = nnx.relu(x) if kind == "relu" else jnp.tanh(x)
        return self.head(self.norm(x))[:, 0]


def _data():
    x = jax.random.normal(jax.random.key(1), (64, 16))
    return x, jnp.sin(x.sum(axis=1))


@pytest.mark.parametrize("route", ["nnx.mixed_precision", "autocast"])
def test_a_list_in_the_config_trains(route):
    x, y = _data()
    model = Block(Config(["relu", "tanh", "relu"]), nnx.Rngs(0))
    with pytest.raises(TypeError, match="unhashable"):
        hash(model.config)
    reference = nnx.jit(lambda m, x: m(x))(model, x)
    if route == "nnx.mixed_precision":
        model = jmp.nnx.mixed_precision(model, "mixed_float16")
        forward = lambda m, x: m(x)  # noqa: E731
    else:
        forward = jmp.autocast(lambda m, x: m(x), policy="mixed_float16")
    out = nnx.jit(forward)(model, x)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, reference, atol=2e-2)

    tx = jmp.loss_scaling(optax.adam(1e-2), jmp.DynamicLossScale(2.0**15))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    def loss_fn(m, x, y):
        return jnp.mean((forward(m, x) - y) ** 2)

    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = jmp.value_and_scaled_grad(loss_fn, grad_fn=nnx.value_and_grad)(
            optimizer, model, x, y
        )
        optimizer.update(model, grads, value=loss)
        return loss

    losses = [float(step(model, optimizer, x, y)) for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0], losses
