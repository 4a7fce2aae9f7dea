"""Models written the way Flax's own examples write theirs, at test size.

Written here, not copied (the workplace does not take in others' files): each reproduces
what its example does that a mixed-precision rewrite must meet.

- `resnet`: examples/imagenet: `functools.partial` layers with `dtype=`, BatchNorm over the
  "batch" axis (`user_models.ResNet`), trained data-parallel under `shard_map`.
- `lm1b`: examples/lm1b: a config dataclass carrying `dtype`, causal self-attention, logits
  from the embedding (`user_models.LinenTransformer`).
- `wmt`: examples/wmt: an encoder-decoder with a shared embedding, padding masks built with
  `nn.make_attention_mask`, cross-attention, dropout, a loss weighted by the padding.
- `sst2`: examples/sst2: embedding dropout, a bidirectional `nn.RNN` of `OptimizedLSTMCell`s
  over padded sequences (`seq_lengths`), MLP attention with its own masked softmax, a binary
  classifier.
- `seq2seq`: examples/seq2seq: an LSTM encoder whose final carry starts an LSTM decoder
  (`nn.RNN(..., return_carry=True)`), teacher forcing.
- `vae`: examples/vae: Dense encoder and decoder, the reparameterisation from
  `self.make_rng`, a per-pixel binary cross-entropy summed, and the KL term.
- `gemma` (NNX): examples/gemma's decoder (`user_models.make_nnx_transformer`).
- `nnx_toy` (NNX): the NNX basics/toy examples: a `Linear` that multiplies its own
  `nnx.Param`s (`x @ self.w + self.b`), BatchNorm, Dropout and a counter `nnx.Variable`.

Each task comes with synthetic data of its kind: `LINEN_TASKS` and `NNX_TASKS`.
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
from user_models import LinenTransformer, ResNet, TransformerConfig, make_nnx_transformer


@dataclasses.dataclass(frozen=True)
class LinenTask:
    """`module.init(rngs, *example(batch))`; `loss(apply, variables, batch, rng)` returns
    `(loss, the mutable collections as the call left them)`."""

    module: nn.Module
    batches: Callable[[Any, int], Any]
    example: Callable[[Any], tuple]
    loss: Callable[..., tuple[Any, dict]]
    learning_rate: float = 3e-3
    # Trained data-parallel under `shard_map` over "batch" (the ImageNet example's BatchNorm
    # averages over that axis). Not the others: Flax's `nn.RNN` starts its carry from zeros
    # that do not vary over the mesh axis, which `shard_map` refuses (float32 too).
    mapped: bool = False
    steps: int = 150  # of the parity runs (the slow lane)


@dataclasses.dataclass(frozen=True)
class NnxTask:
    make: Callable[[int], nnx.Module]
    batches: Callable[[Any, int], Any]
    loss: Callable[[nnx.Module, Any], Any]
    learning_rate: float = 3e-3
    steps: int = 150  # of the parity runs (the slow lane)
    initial_scale: float = 2.0**15  # float16's dynamic loss scale


def _cross_entropy(logits, labels, weights=None):
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    if weights is None:
        return losses.mean()
    return (losses * weights).sum() / weights.sum()


# --- resnet ------------------------------------------------------------------------------


def _images(key, steps, batch=8, size=16):
    images = jax.random.normal(key, (steps, batch, size, size, 3))
    half = size // 2
    quadrants = images.reshape(steps, batch, 2, half, 2, half, 3).mean(axis=(3, 5, 6))
    return {"image": images, "label": quadrants.reshape(steps, batch, 4).argmax(-1)}


def _resnet_loss(apply, variables, batch, rng):
    logits, new = apply(variables, batch["image"], train=True, mutable=["batch_stats"])
    return _cross_entropy(logits, batch["label"]), {"batch_stats": new["batch_stats"]}


# --- lm1b ------------------------------------------------------------------------------


def _counting(key, steps, batch=8, length=16, vocab=64, noise=0.2):
    """Sequences counting up from a random start (mod vocab), a `noise` share of the tokens
    random: a loss that levels off well above 0, as language's does."""
    k1, k2, k3 = jax.random.split(key, 3)
    starts = jax.random.randint(k1, (steps, batch, 1), 0, vocab)
    tokens = (starts + jnp.arange(length)) % vocab
    random = jax.random.randint(k2, tokens.shape, 0, vocab)
    return {"tokens": jnp.where(jax.random.bernoulli(k3, noise, tokens.shape), random, tokens)}


def _lm1b_loss(apply, variables, batch, rng):
    tokens = batch["tokens"]
    return _cross_entropy(apply(variables, tokens[:, :-1]), tokens[:, 1:]), {}


# --- wmt ------------------------------------------------------------------------------


class _Mlp(nn.Module):
    dim: int
    hidden: int
    dropout: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, deterministic):
        y = nn.relu(nn.Dense(self.hidden, dtype=self.dtype)(x))
        y = nn.Dropout(self.dropout)(y, deterministic=deterministic)
        return nn.Dense(self.dim, dtype=self.dtype)(y)


class _EncoderBlock(nn.Module):
    dim: int
    heads: int
    dropout: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, mask, deterministic):
        y = nn.LayerNorm(dtype=self.dtype)(x)
        y = nn.MultiHeadDotProductAttention(
            num_heads=self.heads, dtype=self.dtype, dropout_rate=self.dropout
        )(y, y, mask=mask, deterministic=deterministic)
        x = x + nn.Dropout(self.dropout)(y, deterministic=deterministic)
        y = nn.LayerNorm(dtype=self.dtype)(x)
        return x + _Mlp(self.dim, 2 * self.dim, self.dropout, self.dtype)(y, deterministic)


class _DecoderBlock(nn.Module):
    dim: int
    heads: int
    dropout: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, y, encoded, self_mask, cross_mask, deterministic):
        z = nn.LayerNorm(dtype=self.dtype)(y)
        z = nn.MultiHeadDotProductAttention(num_heads=self.heads, dtype=self.dtype)(
            z, z, mask=self_mask, deterministic=deterministic
        )
        y = y + nn.Dropout(self.dropout)(z, deterministic=deterministic)
        z = nn.LayerNorm(dtype=self.dtype)(y)
        z = nn.MultiHeadDotProductAttention(num_heads=self.heads, dtype=self.dtype)(
            z, encoded, mask=cross_mask, deterministic=deterministic
        )
        y = y + nn.Dropout(self.dropout)(z, deterministic=deterministic)
        z = nn.LayerNorm(dtype=self.dtype)(y)
        return y + _Mlp(self.dim, 2 * self.dim, self.dropout, self.dtype)(z, deterministic)


class Translator(nn.Module):
    """examples/wmt's `Transformer` in small: token 0 pads (and starts the decoder)."""

    vocab: int = 32
    dim: int = 32
    heads: int = 4
    layers: int = 1
    max_len: int = 16
    dropout: float = 0.1
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, inputs, targets, train=True):
        embed = nn.Embed(self.vocab, self.dim, embedding_init=nn.initializers.normal(1.0))
        positions = self.param(
            "pos_embedding", nn.initializers.normal(0.02), (1, self.max_len, self.dim)
        )

        def embedded(tokens):
            x = embed(tokens) + positions[:, : tokens.shape[1]]
            return nn.Dropout(self.dropout)(x.astype(self.dtype), deterministic=not train)

        encoder_mask = nn.make_attention_mask(inputs > 0, inputs > 0, dtype=self.dtype)
        x = embedded(inputs)
        for i in range(self.layers):
            x = _EncoderBlock(self.dim, self.heads, self.dropout, self.dtype, name=f"encoder_{i}")(
                x, encoder_mask, not train
            )
        encoded = nn.LayerNorm(dtype=self.dtype, name="encoder_norm")(x)
        decoder_in = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]  # shifted right
        self_mask = nn.combine_masks(
            nn.make_attention_mask(targets > 0, targets > 0, dtype=self.dtype),
            nn.make_causal_mask(decoder_in, dtype=self.dtype),
        )
        cross_mask = nn.make_attention_mask(targets > 0, inputs > 0, dtype=self.dtype)
        y = embedded(decoder_in)
        for i in range(self.layers):
            y = _DecoderBlock(self.dim, self.heads, self.dropout, self.dtype, name=f"decoder_{i}")(
                y, encoded, self_mask, cross_mask, not train
            )
        y = nn.LayerNorm(dtype=self.dtype, name="decoder_norm")(y)
        return embed.attend(y.astype(self.dtype)) / jnp.sqrt(self.dim).astype(self.dtype)


def _reversals(key, steps, batch=8, length=12, vocab=32):
    """Targets: the input's tokens in reverse order; sequences padded with 0 after a
    random length."""
    k1, k2 = jax.random.split(key)
    tokens = jax.random.randint(k1, (steps, batch, length), 1, vocab)
    lengths = jax.random.randint(k2, (steps, batch, 1), length // 2, length + 1)
    valid = jnp.arange(length) < lengths
    inputs = jnp.where(valid, tokens, 0)
    # reverse the valid part: position i takes token (length_b - 1 - i)
    index = jnp.clip(lengths - 1 - jnp.arange(length), 0, length - 1)
    targets = jnp.where(valid, jnp.take_along_axis(tokens, index, axis=-1), 0)
    return {"inputs": inputs, "targets": targets}


def _wmt_loss(apply, variables, batch, rng):
    logits = apply(variables, batch["inputs"], batch["targets"], rngs={"dropout": rng})
    weights = (batch["targets"] > 0).astype(jnp.float32)
    return _cross_entropy(logits, batch["targets"], weights), {}


# --- sst2 ------------------------------------------------------------------------------


class SentimentClassifier(nn.Module):
    """examples/sst2's `TextClassifier` in small."""

    vocab: int = 40
    dim: int = 16
    hidden: int = 16
    dropout: float = 0.1

    @nn.compact
    def __call__(self, tokens, lengths, train=True):
        x = nn.Embed(self.vocab, self.dim)(tokens)
        x = nn.Dropout(self.dropout)(x, deterministic=not train)
        encoded = nn.Bidirectional(
            nn.RNN(nn.OptimizedLSTMCell(self.hidden)), nn.RNN(nn.OptimizedLSTMCell(self.hidden))
        )(x, seq_lengths=lengths)
        # MLP attention over the valid positions, its softmax written out as the example does
        keys = nn.Dense(self.hidden, name="keys")(encoded)
        scores = nn.Dense(1, use_bias=False, name="energy")(jnp.tanh(keys)).squeeze(-1)
        valid = jnp.arange(tokens.shape[1]) < lengths[:, None]
        scores = jnp.where(valid, scores, -1e9)
        weights = jax.nn.softmax(scores, axis=-1)
        pooled = jnp.einsum("bt,bth->bh", weights, encoded)
        hidden = jnp.tanh(nn.Dense(self.hidden, name="classifier_hidden")(pooled))
        return nn.Dense(1, name="classifier_out")(hidden).squeeze(-1)


def _sentences(key, steps, batch=8, length=12, vocab=40):
    """Tokens 1-19 are 'positive', 20-39 'negative': is the sentence mostly positive?"""
    k1, k2 = jax.random.split(key)
    tokens = jax.random.randint(k1, (steps, batch, length), 1, vocab)
    lengths = jax.random.randint(k2, (steps, batch), 3, length + 1)
    valid = jnp.arange(length) < lengths[..., None]
    tokens = jnp.where(valid, tokens, 0)
    positive = jnp.sum(valid & (tokens < vocab // 2), -1) * 2 > lengths
    return {"tokens": tokens, "lengths": lengths, "label": positive.astype(jnp.float32)}


def _sst2_loss(apply, variables, batch, rng):
    logits = apply(variables, batch["tokens"], batch["lengths"], rngs={"dropout": rng})
    return optax.sigmoid_binary_cross_entropy(logits, batch["label"]).mean(), {}


# --- seq2seq ------------------------------------------------------------------------------


class Seq2seq(nn.Module):
    """examples/seq2seq's LSTM encoder-decoder in small, with teacher forcing."""

    vocab: int = 12
    hidden: int = 32

    @nn.compact
    def __call__(self, encoder_tokens, decoder_tokens):
        embed = nn.Embed(self.vocab, self.hidden)
        carry, _ = nn.RNN(nn.LSTMCell(self.hidden), return_carry=True, name="encoder")(
            embed(encoder_tokens)
        )
        decoded = nn.RNN(nn.LSTMCell(self.hidden), name="decoder")(
            embed(decoder_tokens), initial_carry=carry
        )
        return nn.Dense(self.vocab, name="logits")(decoded)


def _digit_reversals(key, steps, batch=8, length=6):
    """Digits (2-11; 0 starts the decoder) and the same digits reversed."""
    digits = jax.random.randint(key, (steps, batch, length), 2, 12)
    return {"question": digits, "answer": digits[..., ::-1]}


def _seq2seq_loss(apply, variables, batch, rng):
    answer = batch["answer"]
    decoder_in = jnp.pad(answer, ((0, 0), (1, 0)))[:, :-1]
    return _cross_entropy(apply(variables, batch["question"], decoder_in), answer), {}


# --- vae ------------------------------------------------------------------------------


class VAE(nn.Module):
    """examples/vae's model in small (8x8 images)."""

    latents: int = 8
    hidden: int = 64
    pixels: int = 64

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(self.hidden, name="encoder_fc1")(x))
        mean = nn.Dense(self.latents, name="encoder_mean")(h)
        logvar = nn.Dense(self.latents, name="encoder_logvar")(h)
        eps = jax.random.normal(self.make_rng("noise"), logvar.shape)
        z = mean + eps * jnp.exp(0.5 * logvar)
        h = nn.relu(nn.Dense(self.hidden, name="decoder_fc1")(z))
        return nn.Dense(self.pixels, name="decoder_fc2")(h), mean, logvar


def _binary_images(key, steps, batch=16, prototypes=4, pixels=64):
    """Noisy copies of a few binary patterns."""
    k1, k2, k3 = jax.random.split(key, 3)
    patterns = jax.random.bernoulli(k1, 0.4, (prototypes, pixels))
    which = jax.random.randint(k2, (steps, batch), 0, prototypes)
    flips = jax.random.bernoulli(k3, 0.05, (steps, batch, pixels))
    return {"image": (patterns[which] ^ flips).astype(jnp.float32)}


def _vae_loss(apply, variables, batch, rng):
    x = batch["image"]
    logits, mean, logvar = apply(variables, x, rngs={"noise": rng})
    bce = optax.sigmoid_binary_cross_entropy(logits, x).sum(-1)
    kl = -0.5 * jnp.sum(1 + logvar - mean**2 - jnp.exp(logvar), axis=-1)
    return (bce + kl).mean(), {}


LINEN_TASKS: dict[str, LinenTask] = {
    "resnet": LinenTask(
        ResNet(stage_sizes=(1, 1), num_classes=4, num_filters=8),
        _images,
        lambda b: (b["image"],),
        _resnet_loss,
        mapped=True,
    ),
    "lm1b": LinenTask(
        LinenTransformer(TransformerConfig(num_layers=1)),
        _counting,
        lambda b: (b["tokens"][:, :-1],),
        _lm1b_loss,
    ),
    "wmt": LinenTask(
        Translator(), _reversals, lambda b: (b["inputs"], b["targets"], False), _wmt_loss
    ),
    "sst2": LinenTask(
        SentimentClassifier(),
        _sentences,
        lambda b: (b["tokens"], b["lengths"], False),
        _sst2_loss,
    ),
    "seq2seq": LinenTask(
        Seq2seq(), _digit_reversals, lambda b: (b["question"], b["answer"]), _seq2seq_loss
    ),
    "vae": LinenTask(VAE(), _binary_images, lambda b: (b["image"],), _vae_loss, 1e-3),
}


# --- NNX: the basics' toy model ----------------------------------------------------------


class Count(nnx.Variable):
    pass


class Linear(nnx.Module):
    def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
        self.w = nnx.Param(jax.random.uniform(rngs.params(), (din, dout)) / din**0.5)
        self.b = nnx.Param(jnp.zeros((dout,)))

    def __call__(self, x):
        return x @ self.w + self.b


class ToyMLP(nnx.Module):
    def __init__(self, din: int, hidden: int, dout: int, *, rngs: nnx.Rngs):
        self.count = Count(jnp.array(0))
        self.linear1 = Linear(din, hidden, rngs=rngs)
        self.bn = nnx.BatchNorm(hidden, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.linear2 = Linear(hidden, dout, rngs=rngs)

    def __call__(self, x):
        self.count[...] += 1
        x = nnx.relu(self.dropout(self.bn(self.linear1(x))))
        return self.linear2(x)


def _regression(key, steps, batch=32):
    k1, k2 = jax.random.split(key)
    x = jax.random.uniform(k1, (steps, batch, 1))
    noise = 0.05 * jax.random.normal(k2, (steps, batch, 1))
    return {"x": x, "y": 0.8 * x**2 + 0.1 + noise}


def _toy_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _gemma_loss(model, batch):
    tokens = batch["tokens"]
    return _cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])


NNX_TASKS: dict[str, NnxTask] = {
    "gemma": NnxTask(lambda seed: make_nnx_transformer(seed, layers=1), _counting, _gemma_loss),
    # Its BatchNorm's gradients overflow float16 at a loss scale of 2^15: the first steps are
    # skipped while the scale backs off, and a skipped step keeps the dropout RNG count, so
    # every later step draws another mask than float32's run does (a different run, 3-5% apart
    # at 150-1000 steps, whatever the precision). Started at 2^10, no step is skipped.
    "nnx_toy": NnxTask(
        lambda seed: ToyMLP(1, 32, 1, rngs=nnx.Rngs(seed)),
        _regression,
        _toy_loss,
        1e-2,
        initial_scale=2.0**10,
    ),
}
