"""Unmodified models, one copy for the tests and the benchmarks (no mixed-precision code here).

The benchmarks (`benchmarks/shapes.py`, `benchmarks/bench_autocast.py`) import this file too; the
examples stay self-contained and define their own.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax


def widened_on_cpu(eqn: Any, half: Any) -> bool:
    """A weight-gradient matmul whose bfloat16 operands `jmp_policy.matmul` widened to float32:
    it accumulates in float32, and XLA:CPU cannot run bfloat16 x bfloat16 -> float32."""
    return (
        jnp.dtype(half) == jnp.bfloat16
        and jax.default_backend() == "cpu"
        and eqn.params.get("preferred_element_type") == jnp.float32
        and {v.aval.dtype for v in eqn.invars} == {jnp.dtype(jnp.float32)}
    )


def block_layers(x: jax.Array, heads: int, causal: bool = False, dtype: Any = None) -> jax.Array:
    """A pre-norm transformer block (LayerNorm, self-attention, LayerNorm, MLP 4x).

    Called inside a compact `__call__`, so its layers belong to the caller:
    `LayerNorm_0`, `MultiHeadDotProductAttention_0`, `LayerNorm_1`, `Dense_0`, `Dense_1`.
    """
    mask = nn.make_causal_mask(x[..., 0]) if causal else None
    h = nn.LayerNorm(dtype=dtype)(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=heads, dtype=dtype)(h, h, mask=mask)
    h = nn.LayerNorm(dtype=dtype)(x)
    up = nn.Dense(4 * x.shape[-1], dtype=dtype)(h)
    return x + nn.Dense(x.shape[-1], dtype=dtype)(nn.gelu(up))


class Block(nn.Module):
    """`block_layers` as a module: one GPT block."""

    heads: int = 4
    causal: bool = True
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        return block_layers(x, self.heads, self.causal, self.dtype)


class ScannedBlock(nn.Module):
    """`Block` in the (carry, output) form `nn.scan` wants."""

    heads: int = 4

    @nn.compact
    def __call__(self, x, _):
        return Block(self.heads)(x), None


class GPT(nn.Module):
    """Token and position embeddings, `layers` causal blocks, a final LayerNorm and a head.

    Written as a Python loop of blocks (16 parameter leaves a block), or with `scan=True` as
    `nn.scan` over `nn.remat` (the leaves stacked per layer). `dtype` is passed to every layer
    of the loop, the way Flax's examples write it (None: float32): with `dtype=jnp.bfloat16` it
    is the hand-written half-precision baseline the memory benchmark and tests hold the
    integrations to.
    """

    vocab: int = 64
    dim: int = 32
    length: int = 16
    layers: int = 12
    scan: bool = False
    dtype: Any = None

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.dim, dtype=self.dtype)(tokens)
        position = self.param("position", nn.initializers.normal(0.02), (self.length, self.dim))
        x = x + position.astype(x.dtype)
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
                x = Block(dtype=self.dtype)(x)
        x = nn.LayerNorm(dtype=self.dtype)(x)
        return nn.Dense(self.vocab, use_bias=False, dtype=self.dtype, name="head")(x)


def residual_bytes(fun: Any, *args: Any) -> dict[str, int]:
    """Bytes `jax.grad(fun)` keeps from the forward pass for the backward pass, by dtype
    (the arguments left out): what activation memory follows on any platform."""
    from jax._src.ad_checkpoint import saved_residuals  # what print_saved_residuals reads

    found: dict[str, int] = {}
    for aval, why in saved_residuals(fun, *args):
        if "argument" not in why:
            found[aval.dtype.name] = found.get(aval.dtype.name, 0) + aval.size * aval.dtype.itemsize
    return found


class Classifier(nn.Module):
    """An optional conv stem, one transformer block, a classifier head on the mean token.

    `dtype` set: every layer computes in it (the hand-cast baseline of the autocast benchmark);
    None: plain float32 Flax.
    """

    dim: int = 16
    heads: int = 2
    classes: int = 4
    stem: bool = False
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        if self.stem:
            x = nn.Conv(self.dim, (3,), dtype=self.dtype)(x)
        x = block_layers(x, self.heads, dtype=self.dtype)
        return nn.Dense(self.classes, dtype=self.dtype, name="head")(x.mean(axis=1))


class CNN(nn.Module):
    """Conv -> BatchNorm -> relu blocks, then a Dense classifier."""

    features: tuple[int, ...] = (8, 16)
    classes: int = 4

    @nn.compact
    def __call__(self, x, train: bool = True):
        for features in self.features:
            x = nn.Conv(features, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.relu(x)
        return nn.Dense(self.classes, name="head")(x.mean(axis=(1, 2)))


class NNXBlock(nnx.Module):
    """The pre-norm transformer block in NNX."""

    def __init__(self, dim: int = 16, heads: int = 2, *, rngs: nnx.Rngs):
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


class NNXClassifier(NNXBlock):
    """`NNXBlock` with a classifier head on the mean token (its layers stay at the top level)."""

    def __init__(self, dim: int = 16, heads: int = 2, classes: int = 4, *, rngs: nnx.Rngs):
        super().__init__(dim, heads, rngs=rngs)
        self.head = nnx.Linear(dim, classes, rngs=rngs)

    def __call__(self, x):
        return self.head(jnp.mean(super().__call__(x), axis=1))


class NNXGPT(nnx.Module):
    """`GPT` in NNX: embeddings, a list of blocks, a final LayerNorm and a head."""

    def __init__(self, vocab: int, dim: int, layers: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.blocks = nnx.List([NNXBlock(dim, 4, rngs=rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def rnn(params, xs):
    """A plain JAX recurrence under `lax.scan` (7 steps with `XS`): two dots and an exp a step."""

    def cell(h, x):
        h = jnp.tanh(h @ params["w"] + x @ params["u"])
        return h, jnp.exp(h).sum()

    h, outs = lax.scan(cell, jnp.zeros((xs.shape[1], params["w"].shape[0])), xs)
    return h.sum() + outs.sum()


RNN_PARAMS = {"w": jnp.eye(4) * 0.5, "u": jnp.ones((3, 4)) * 0.1}
XS = jax.random.normal(jax.random.key(3), (7, 2, 3))


# A conv stem, a block and a 5-class head on (8, 12, 6) inputs: the autocast and census tests'.
MODEL = Classifier(dim=32, heads=4, classes=5, stem=True)
X = jax.random.normal(jax.random.key(0), (8, 12, 6))
Y = jax.random.randint(jax.random.key(1), (8,), 0, 5)
# Jitted: one compilation instead of op-by-op dispatch (about 2 s against 8 s at import).
PARAMS = jax.jit(MODEL.init)(jax.random.key(2), X)["params"]


def loss_fn(params, x, y):
    """`MODEL`'s mean cross-entropy: plain float32 Flax, no mixed-precision code."""
    logits = MODEL.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
