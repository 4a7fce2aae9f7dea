"""Models written the way other people write them, not the way this library would.

- `ResNet18`: Flax's ImageNet example style: `dtype: Any = jnp.float32` passed to every layer
  through `functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)`, BatchNorm with
  `axis_name="batch"` (trained under a mapped axis), `jnp.asarray(x, self.dtype)` at the end.
- `LinenTransformer`: Flax's lm1b/wmt style: a config dataclass carries `dtype` to every
  `Dense`, attention and embedding, `.astype(config.dtype)` in between, an integer index
  dtype beside it.
- `SetupMLP`: a `setup`-style Linen module whose children read the parent's `dtype`.
- `make_nnx_transformer`: a Gemma-style NNX decoder: RMSNorm, rotary embeddings, grouped-query
  attention, logit soft-capping, a mask written as `-2.3819763e38`, trained in the functional
  pattern (`nnx.split`, `nnx.merge` inside the loss).
- `make_eqx_transformer` (the Equinox example's model), `make_eqx_cnn`: Equinox modules with
  function leaves (activations), an `eqx.nn.State` for BatchNorm, vmapped over the batch inside
  the loss.

Small sizes: they run on 2 CPU cores in seconds.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

# --- Linen: ImageNet-example ResNet -------------------------------------------------


class ResNetBlock(nn.Module):
    filters: int
    conv: Any
    norm: Any
    act: Callable
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        shortcut = x
        y = self.act(self.norm()(self.conv(self.filters, (3, 3), self.strides)(x)))
        y = self.norm(scale_init=nn.initializers.zeros_init())(self.conv(self.filters, (3, 3))(y))
        if shortcut.shape != y.shape:
            shortcut = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(shortcut)
            shortcut = self.norm(name="norm_proj")(shortcut)
        return self.act(shortcut + y)


class ResNet(nn.Module):
    stage_sizes: Sequence[int]
    num_classes: int
    num_filters: int = 64
    dtype: Any = jnp.float32
    act: Callable = nn.relu

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            dtype=self.dtype,
            axis_name="batch",
        )
        x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
        x = nn.relu(norm(name="bn_init")(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, blocks in enumerate(self.stage_sizes):
            for j in range(blocks):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = ResNetBlock(
                    self.num_filters * 2**i, conv=conv, norm=norm, act=self.act, strides=strides
                )(x)
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
        return jnp.asarray(x, self.dtype)


ResNet18 = functools.partial(ResNet, stage_sizes=(2, 2, 2, 2))


def image_batches(key, steps, batch=16, size=32, classes=4):
    """Images whose label is the brightest quadrant: learnable in a few dozen steps."""
    images = jax.random.normal(key, (steps, batch, size, size, 3))
    half = size // 2
    quadrants = images.reshape(steps, batch, 2, half, 2, half, 3).mean(axis=(3, 5, 6))
    labels = quadrants.reshape(steps, batch, 4).argmax(-1) % classes
    return images, labels


# --- Linen: lm1b-style transformer with a config dataclass ----------------------------


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int = 64
    emb_dim: int = 32
    num_heads: int = 4
    num_layers: int = 2
    mlp_dim: int = 64
    max_len: int = 32
    dtype: Any = jnp.float32
    index_dtype: Any = jnp.int32


class MlpBlock(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, x):
        config = self.config
        y = nn.Dense(config.mlp_dim, dtype=config.dtype)(x)
        y = nn.gelu(y)
        return nn.Dense(x.shape[-1], dtype=config.dtype)(y)


class DecoderBlock(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, x, mask):
        config = self.config
        y = nn.LayerNorm(dtype=config.dtype)(x)
        y = nn.SelfAttention(
            num_heads=config.num_heads, dtype=config.dtype, qkv_features=config.emb_dim
        )(y, mask=mask)
        x = x + y
        return x + MlpBlock(config)(nn.LayerNorm(dtype=config.dtype)(x))


class LinenTransformer(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, tokens):
        config = self.config
        embed = nn.Embed(config.vocab_size, config.emb_dim, name="embed")
        x = embed(tokens.astype(config.index_dtype))
        positions = self.param(
            "pos_embedding", nn.initializers.normal(0.02), (1, config.max_len, config.emb_dim)
        )
        x = (x + positions[:, : tokens.shape[1]]).astype(config.dtype)
        mask = nn.make_causal_mask(tokens)
        for i in range(config.num_layers):
            x = DecoderBlock(config, name=f"block_{i}")(x, mask)
        x = nn.LayerNorm(dtype=config.dtype)(x)
        return embed.attend(x.astype(config.dtype))


def token_batches(key, steps, batch=8, length=16, vocab=64):
    """Sequences counting up from a random start (mod vocab): the next token is learnable."""
    starts = jax.random.randint(key, (steps, batch, 1), 0, vocab)
    return (starts + jnp.arange(length)) % vocab


# --- Linen: setup-style module ------------------------------------------------------


class SetupMLP(nn.Module):
    features: Sequence[int]
    dtype: Any = jnp.float32

    def setup(self):
        self.layers = [nn.Dense(f, dtype=self.dtype) for f in self.features]
        self.norm = nn.LayerNorm(dtype=self.dtype)

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = nn.relu(layer(x))
        return self.layers[-1](self.norm(x))


# --- NNX: Gemma-style decoder ----------------------------------------------------------

_MASK = -2.3819763e38  # what Gemma-style code writes where attention may not look


def _rotary(x, positions):
    half = x.shape[-1] // 2
    freq = 1.0 / (10_000 ** (jnp.arange(half) / half))
    angle = positions[:, None] * freq  # (length, half)
    sin = jnp.sin(angle)[:, None].astype(x.dtype)  # broadcast over heads
    cos = jnp.cos(angle)[:, None].astype(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def make_nnx_transformer(seed=0, vocab=64, dim=32, heads=4, kv_heads=2, layers=2, soft_cap=30.0):
    from flax import nnx

    head_dim = dim // heads

    class Attention(nnx.Module):
        def __init__(self, rngs):
            self.q_proj = nnx.Linear(dim, heads * head_dim, use_bias=False, rngs=rngs)
            self.kv_proj = nnx.Linear(dim, 2 * kv_heads * head_dim, use_bias=False, rngs=rngs)
            self.o_proj = nnx.Linear(heads * head_dim, dim, use_bias=False, rngs=rngs)

        def __call__(self, x):
            batch, length, _ = x.shape
            positions = jnp.arange(length)
            q = self.q_proj(x).reshape(batch, length, heads, head_dim)
            k, v = jnp.split(self.kv_proj(x).reshape(batch, length, 2 * kv_heads, head_dim), 2, 2)
            q, k = _rotary(q, positions), _rotary(k, positions)
            k, v = (jnp.repeat(t, heads // kv_heads, axis=2) for t in (k, v))  # grouped query
            logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim).astype(q.dtype)
            logits = jnp.tanh(logits / soft_cap) * soft_cap
            causal = jnp.tril(jnp.ones((length, length), bool))
            logits = jnp.where(causal, logits, _MASK)
            probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(v.dtype)
            out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, length, -1)
            return self.o_proj(out)

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.pre_attention_norm = nnx.RMSNorm(dim, rngs=rngs)
            self.attn = Attention(rngs)
            self.pre_ffw_norm = nnx.RMSNorm(dim, rngs=rngs)
            self.gate = nnx.Linear(dim, 2 * dim, rngs=rngs)
            self.up = nnx.Linear(dim, 2 * dim, rngs=rngs)
            self.down = nnx.Linear(2 * dim, dim, rngs=rngs)

        def __call__(self, x):
            x = x + self.attn(self.pre_attention_norm(x))
            y = self.pre_ffw_norm(x)
            return x + self.down(nnx.gelu(self.gate(y)) * self.up(y))

    class Decoder(nnx.Module):
        def __init__(self, rngs):
            self.embedder = nnx.Embed(vocab, dim, rngs=rngs)
            self.layers = nnx.List([Block(rngs) for _ in range(layers)])
            self.final_norm = nnx.RMSNorm(dim, rngs=rngs)

        def __call__(self, tokens):
            x = self.embedder(tokens) * jnp.sqrt(dim).astype(self.embedder.embedding.dtype)
            for layer in self.layers:
                x = layer(x)
            logits = self.embedder.attend(self.final_norm(x))
            return jnp.tanh(logits / soft_cap) * soft_cap

    return Decoder(nnx.Rngs(seed))


# --- Equinox ------------------------------------------------------------------------


def _equinox():
    import equinox as eqx

    return eqx


def make_eqx_transformer(key, vocab=64, dim=32, heads=4, layers=2, length=16):
    """The example's Equinox transformer (examples/equinox_transformer.py), at test size."""
    name = "_equinox_transformer_example"
    if name not in sys.modules:
        path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "equinox_transformer.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses (Equinox modules) look it up there
        spec.loader.exec_module(module)
    example = sys.modules[name]
    return example.CharLM(key, vocab=vocab, length=length, dim=dim, heads=heads, layers=layers)


def make_eqx_cnn(key, classes=4):
    """Returns `(model, state)`: a conv net with `eqx.nn.BatchNorm` statistics in a State."""
    eqx = _equinox()

    class EqxCNN(eqx.Module):
        conv1: eqx.nn.Conv2d
        bn1: eqx.nn.BatchNorm
        conv2: eqx.nn.Conv2d
        bn2: eqx.nn.BatchNorm
        head: eqx.nn.Linear
        activation: Callable

        def __init__(self, key):
            k1, k2, k3 = jax.random.split(key, 3)
            self.conv1 = eqx.nn.Conv2d(3, 16, 3, padding=1, key=k1)
            self.bn1 = eqx.nn.BatchNorm(16, axis_name="batch", mode="batch")
            self.conv2 = eqx.nn.Conv2d(16, 32, 3, stride=2, padding=1, key=k2)
            self.bn2 = eqx.nn.BatchNorm(32, axis_name="batch", mode="batch")
            self.head = eqx.nn.Linear(32 * 4, classes, key=k3)
            self.activation = jax.nn.relu

        def __call__(self, x, state):
            x, state = self.bn1(self.conv1(x), state)
            x = self.activation(x)
            x, state = self.bn2(self.conv2(x), state)
            x = self.activation(x)  # (32, h, w): pooled to 2 x 2, so the head sees quadrants
            c, h, w = x.shape
            pooled = x.reshape(c, 2, h // 2, 2, w // 2).mean(axis=(2, 4))
            return self.head(pooled.reshape(-1)), state

    return eqx.nn.make_with_state(EqxCNN)(key)
