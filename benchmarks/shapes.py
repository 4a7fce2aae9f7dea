"""The model shapes users train, as functional train-step ingredients.

Each shape is a `Shape`: parameters, non-parameter state (`extra`: BatchNorm
statistics, or `{}`), a batch, and `loss(params, extra, batch) -> (loss,
new_extra)` computed under `mixed_float16` (float32 master weights, float16
compute, float32 norms). They differ in what matters to a loss-scaled step:

- `mlp`: few large leaves (8);
- `gpt`: a GPT-style Linen transformer written as a Python loop of blocks
  (16 leaves a block: ~200 at 12 layers, ~400 at 24);
- `gpt_scan`: the same blocks under `nn.scan` over `nn.remat` (leaves stacked
  per layer: 16 leaves whatever the depth);
- `cnn`: convolutions with BatchNorm (batch statistics as `extra`);
- `nnx`: an NNX transformer, split into a graph and a parameter state.

Shared by the benchmarks and the tests (the test suite runs the benchmark in
its fast mode), so there is one copy of each model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jmp_policy as jmp

POLICY = "mixed_float16"


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    params: Any
    extra: Any
    batch: Any
    loss: Callable[[Any, Any, Any], tuple[jax.Array, Any]]

    @property
    def leaves(self) -> int:
        return len(jax.tree.leaves(self.params))


class Block(nn.Module):
    """A pre-norm GPT block: LayerNorm, causal self-attention, LayerNorm, MLP 4x."""

    heads: int = 4

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.SelfAttention(num_heads=self.heads)(h, mask=nn.make_causal_mask(x[..., 0]))
        h = nn.LayerNorm()(x)
        return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(4 * x.shape[-1])(h)))


class ScannedBlock(nn.Module):
    """`Block` in the (carry, output) form `nn.scan` wants."""

    heads: int = 4

    @nn.compact
    def __call__(self, x, _):
        return Block(self.heads)(x), None


class GPT(nn.Module):
    """Token and position embeddings, `layers` blocks, a final LayerNorm and a head."""

    vocab: int = 64
    dim: int = 32
    length: int = 16
    layers: int = 12
    scan: bool = False

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.dim)(tokens)
        x = x + self.param("position", nn.initializers.normal(0.02), (self.length, self.dim))
        if self.scan:
            stack = nn.scan(
                nn.remat(ScannedBlock),
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=self.layers,
            )
            x, _ = stack(name="blocks")(x, None)
        else:
            for _ in range(self.layers):
                x = Block()(x)
        return nn.Dense(self.vocab, use_bias=False, name="head")(nn.LayerNorm()(x))


class CNN(nn.Module):
    """Conv -> BatchNorm -> relu blocks, then a Dense classifier."""

    features: tuple[int, ...] = (16, 32, 32)
    classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool = True):
        for f in self.features:
            x = nn.Conv(f, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.relu(x)
        return nn.Dense(self.classes)(x.mean(axis=(1, 2)))


class NNXBlock(nnx.Module):
    def __init__(self, dim, heads, *, rngs):
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=heads, in_features=dim, decode=False, rngs=rngs
        )
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h)
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class NNXGPT(nnx.Module):
    def __init__(self, vocab, dim, layers, *, rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.blocks = nnx.List([NNXBlock(dim, 4, rngs=rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels
    ).mean()


def _tokens(vocab, length, batch):
    tokens = jax.random.randint(jax.random.key(1), (batch, length + 1), 0, vocab)
    return tokens[:, :-1], tokens[:, 1:]


def mlp(width=1024, batch=256) -> Shape:
    sizes = [512, width, width, width, 10]
    keys = jax.random.split(jax.random.key(0), len(sizes) - 1)
    params = [
        {"w": jax.random.normal(k, (m, n)) / m**0.5, "b": jnp.zeros(n)}
        for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]
    x = jax.random.normal(jax.random.key(1), (batch, sizes[0]))
    y = jax.random.randint(jax.random.key(2), (batch,), 0, sizes[-1])
    policy = jmp.get_policy(POLICY)

    def loss(params, extra, batch):
        x, y = policy.cast_to_compute(batch[0]), batch[1]
        for layer in policy.cast_to_compute(params[:-1]):
            x = jax.nn.relu(x @ layer["w"] + layer["b"])
        head = policy.cast_to_compute(params[-1])
        return _cross_entropy(x @ head["w"] + head["b"], y), extra

    return Shape(f"MLP ({len(sizes) - 1} layers)", params, {}, (x, y), loss)


def gpt(layers=12, dim=32, length=16, batch=8, vocab=64, scan=False) -> Shape:
    model = jmp.linen.mixed_precision(GPT(vocab, dim, length, layers, scan), jmp.get_policy(POLICY))
    x, y = _tokens(vocab, length, batch)
    params = model.init(jax.random.key(0), x)["params"]

    def loss(params, extra, batch):
        return _cross_entropy(model.apply({"params": params}, batch[0]), batch[1]), extra

    kind = "nn.scan" if scan else "loop"
    return Shape(f"GPT {layers} layers ({kind})", params, {}, (x, y), loss)


def cnn(batch=16, size=16) -> Shape:
    model = jmp.linen.mixed_precision(CNN(), jmp.get_policy(POLICY))
    x = jax.random.normal(jax.random.key(1), (batch, size, size, 3))
    y = jax.random.randint(jax.random.key(2), (batch,), 0, 10)
    variables = model.init(jax.random.key(0), x)

    def loss(params, extra, batch):
        logits, updated = model.apply(
            {"params": params, **extra}, batch[0], mutable=["batch_stats"]
        )
        return _cross_entropy(logits, batch[1]), updated

    return Shape(
        "CNN + BatchNorm", variables["params"], {"batch_stats": variables["batch_stats"]},
        (x, y), loss,
    )  # fmt: skip


def nnx_gpt(layers=4, dim=32, length=16, batch=8, vocab=64) -> Shape:
    model = NNXGPT(vocab, dim, layers, rngs=nnx.Rngs(0))
    model = jmp.nnx.mixed_precision(model, jmp.get_policy(POLICY))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    x, y = _tokens(vocab, length, batch)

    def loss(params, extra, batch):
        logits = nnx.merge(graphdef, params, extra)(batch[0])
        return _cross_entropy(logits, batch[1]), extra

    return Shape(f"NNX GPT {layers} layers", params, rest, (x, y), loss)


def all_shapes(quick: bool = False) -> list[Shape]:
    """The suite: every shape above, at benchmark size or (quick) test size."""
    if quick:
        return [
            mlp(width=32, batch=8),
            gpt(layers=2, dim=16, length=8, batch=2),
            gpt(layers=2, dim=16, length=8, batch=2, scan=True),
            cnn(batch=2, size=8),
            nnx_gpt(layers=1, dim=16, length=8, batch=2),
        ]
    return [
        mlp(),
        gpt(layers=12),
        gpt(layers=24),
        gpt(layers=12, scan=True),
        cnn(),
        nnx_gpt(layers=12),
    ]
