"""Unmodified Flax models used by the Flax and autocast tests (no mixed-precision code here)."""

import flax.linen as nn
import jax.numpy as jnp
from flax import nnx


class LinenCNN(nn.Module):
    """Conv -> BatchNorm -> relu, twice, then a Dense classifier."""

    classes: int = 4

    @nn.compact
    def __call__(self, x, train: bool = True):
        for features in (8, 16):
            x = nn.Conv(features, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.relu(x)
        x = x.mean(axis=(1, 2))
        return nn.Dense(self.classes, name="head")(x)


class LinenBlock(nn.Module):
    """A pre-norm transformer block with a classifier head on the mean token."""

    dim: int = 16
    heads: int = 2
    classes: int = 4

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h)
        h = nn.LayerNorm()(x)
        h = nn.Dense(4 * self.dim)(h)
        x = x + nn.Dense(self.dim)(nn.gelu(h))
        return nn.Dense(self.classes, name="head")(x.mean(axis=1))


class NNXBlock(nnx.Module):
    """The same block in NNX."""

    def __init__(self, dim=16, heads=2, classes=4, *, rngs):
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=heads, in_features=dim, decode=False, rngs=rngs
        )
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)
        self.head = nnx.Linear(dim, classes, rngs=rngs)

    def __call__(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h)
        h = self.norm2(x)
        x = x + self.down(nnx.gelu(self.up(h)))
        return self.head(jnp.mean(x, axis=1))
