"""Four models issue 71 found broken or numerically apart under the policies, each written in
the style of its public original (small sizes, for this CPU):

- `Gemma`: an NNX transformer as Flax's `examples/gemma` writes one: a `TransformerConfig`-like
  dataclass whose `attention_types` is a list (users write lists where Flax's presets write a
  tuple), RMSNorm with `1 + scale`, rotary embeddings, grouped-query attention with a sliding
  window on local layers, a GeGLU MLP, the embedding's `attend` as the head (tied weights),
  logits cast to float32 and soft-capped;
- `MoE`: a Linen decoder with Gemma-4-style mixture-of-experts blocks: RMSNorm, RoPE, GQA, a
  router whose logits are cast to float32 before `top_k` (the model's own cast), a softmax over
  the chosen experts, and a load-balancing loss (Switch Transformer's `n * sum(f * P)`);
- `DotProductAttention`: a Linen decoder calling `jax.nn.dot_product_attention` (whose scores
  JAX accumulates in float32, preferred_element_type);
- `NeuralODE`: an Equinox vector field integrated by diffrax's `diffeqsolve` (Tsit5, an adaptive
  PID step size, the default adjoint: backpropagation through the solver), as diffrax's
  neural ODE example trains it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

VOCAB, LENGTH = 32, 16


def rope(x: Any, positions: Any, base: float = 10_000.0) -> Any:
    """Rotary embeddings over the last axis of `x` [batch, time, heads, dim]."""
    half = x.shape[-1] // 2
    frequencies = base ** (-2 * jnp.arange(half) / x.shape[-1])
    angles = positions[:, None] * frequencies[None, :]
    sin, cos = jnp.sin(angles)[:, None, :], jnp.cos(angles)[:, None, :]
    first, second = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)


def tokens(key: Any, steps: int, batch: int = 8) -> tuple[Any, Any]:
    """Counting sequences with a random start and stride: `inputs`, `targets` [steps, batch,
    LENGTH], the next token of each."""
    start_key, stride_key = jax.random.split(key)
    start = jax.random.randint(start_key, (steps, batch, 1), 0, VOCAB)
    stride = jax.random.randint(stride_key, (steps, batch, 1), 1, 4)
    sequence = (start + stride * jnp.arange(LENGTH + 1)) % VOCAB
    return sequence[..., :-1], sequence[..., 1:]


def cross_entropy(logits: Any, targets: Any) -> Any:
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


# --- Gemma (NNX) ---------------------------------------------------------------------------


@dataclasses.dataclass
class GemmaConfig:
    num_embed: int = VOCAB
    embed_dim: int = 32
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8
    hidden_dim: int = 64
    attention_types: list = dataclasses.field(default_factory=lambda: ["local", "global"])
    sliding_window_size: int = 4
    final_logit_softcap: float = 30.0


class RMSNorm(nnx.Module):
    def __init__(self, dim: int):
        self.scale = nnx.Param(jnp.zeros((dim,)))

    def __call__(self, x):
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        normed = x * jax.lax.rsqrt(var + 1e-6)
        return normed * (1 + self.scale[...])


class GemmaAttention(nnx.Module):
    def __init__(self, config: GemmaConfig, kind: str, rngs: nnx.Rngs):
        self.config, self.kind = config, kind
        width, heads = config.embed_dim, config.num_heads * config.head_dim
        kv = 2 * config.num_kv_heads * config.head_dim
        self.q_proj = nnx.Linear(width, heads, use_bias=False, rngs=rngs)
        self.kv_proj = nnx.Linear(width, kv, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(heads, width, use_bias=False, rngs=rngs)

    def __call__(self, x):
        c = self.config
        batch, time, _ = x.shape
        q = self.q_proj(x).reshape(batch, time, c.num_heads, c.head_dim)
        kv = self.kv_proj(x).reshape(batch, time, 2 * c.num_kv_heads, c.head_dim)
        k, v = jnp.split(kv, 2, axis=2)
        positions = jnp.arange(time)
        q, k = rope(q, positions), rope(k, positions)
        groups = c.num_heads // c.num_kv_heads
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        logits = jnp.einsum("bthd,bshd->bhts", q, k) * c.head_dim**-0.5
        mask = positions[:, None] >= positions[None, :]
        if self.kind == "local":
            mask &= positions[:, None] - positions[None, :] < c.sliding_window_size
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
        probs = jax.nn.softmax(logits, axis=-1)
        encoded = jnp.einsum("bhts,bshd->bthd", probs, v).reshape(batch, time, -1)
        return self.o_proj(encoded)


class GemmaMLP(nnx.Module):
    def __init__(self, config: GemmaConfig, rngs: nnx.Rngs):
        width, hidden = config.embed_dim, config.hidden_dim
        self.gate = nnx.Linear(width, hidden, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(width, hidden, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(hidden, width, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.gate(x)) * self.up(x))


class GemmaBlock(nnx.Module):
    def __init__(self, config: GemmaConfig, kind: str, rngs: nnx.Rngs):
        self.pre_attention_norm = RMSNorm(config.embed_dim)
        self.attn = GemmaAttention(config, kind, rngs)
        self.pre_ffw_norm = RMSNorm(config.embed_dim)
        self.mlp = GemmaMLP(config, rngs)

    def __call__(self, x):
        x = x + self.attn(self.pre_attention_norm(x))
        return x + self.mlp(self.pre_ffw_norm(x))


class Gemma(nnx.Module):
    def __init__(self, config: GemmaConfig, rngs: nnx.Rngs):
        self.config = config
        self.embedder = nnx.Embed(config.num_embed, config.embed_dim, rngs=rngs)
        self.layers = nnx.List([GemmaBlock(config, kind, rngs) for kind in config.attention_types])
        self.final_norm = RMSNorm(config.embed_dim)

    def __call__(self, tokens):
        x = self.embedder(tokens) * jnp.sqrt(self.config.embed_dim).astype(jnp.float32)
        for layer in self.layers:
            x = layer(x)
        logits = self.embedder.attend(self.final_norm(x)).astype(jnp.float32)
        cap = self.config.final_logit_softcap
        return jnp.tanh(logits / cap) * cap


def gemma_loss(model: Gemma, inputs: Any, targets: Any) -> Any:
    return cross_entropy(model(inputs), targets)


# --- a mixture of experts (Linen) ----------------------------------------------------------


class LinenRMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.zeros_init(), (x.shape[-1],))
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(var + 1e-6) * (1 + scale)


class GroupedAttention(nn.Module):
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8

    @nn.compact
    def __call__(self, x):
        batch, time, width = x.shape
        q = nn.DenseGeneral((self.heads, self.head_dim), use_bias=False, name="q")(x)
        k = nn.DenseGeneral((self.kv_heads, self.head_dim), use_bias=False, name="k")(x)
        v = nn.DenseGeneral((self.kv_heads, self.head_dim), use_bias=False, name="v")(x)
        positions = jnp.arange(time)
        q, k = rope(q, positions), rope(k, positions)
        groups = self.heads // self.kv_heads
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        logits = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(self.head_dim).astype(q.dtype)
        causal = positions[:, None] >= positions[None, :]
        probs = jax.nn.softmax(jnp.where(causal, logits, jnp.finfo(logits.dtype).min), axis=-1)
        encoded = jnp.einsum("bhts,bshd->bthd", probs, v)
        return nn.DenseGeneral(width, axis=(-2, -1), use_bias=False, name="o")(encoded)


class MoEFeedForward(nn.Module):
    """Top-k routed experts (every expert computed, the chosen ones combined): the router's
    logits in float32 (the model's own cast), and the load-balancing loss sown."""

    experts: int = 4
    top_k: int = 2
    hidden: int = 64

    @nn.compact
    def __call__(self, x):
        width = x.shape[-1]
        router_logits = nn.Dense(self.experts, use_bias=False, name="router")(x)
        router_logits = router_logits.astype(jnp.float32)
        top_logits, chosen = jax.lax.top_k(router_logits, self.top_k)
        weights = jax.nn.softmax(top_logits, axis=-1)
        init = nn.initializers.lecun_normal(batch_axis=(0,))
        w_in = self.param("w_in", init, (self.experts, width, self.hidden))
        w_out = self.param("w_out", init, (self.experts, self.hidden, width))
        hidden = jax.nn.gelu(jnp.einsum("btd,edh->bteh", x, w_in))
        outputs = jnp.einsum("bteh,ehd->bted", hidden, w_out)
        one_hot = jax.nn.one_hot(chosen, self.experts)  # [b, t, k, e]
        combine = jnp.sum(one_hot * weights[..., None], axis=2)  # [b, t, e]
        # Switch Transformer's auxiliary loss: experts * sum(fraction routed * mean probability)
        fraction = jnp.mean(jnp.sum(one_hot, axis=2), axis=(0, 1)) / self.top_k
        probability = jnp.mean(jax.nn.softmax(router_logits, axis=-1), axis=(0, 1))
        self.sow("losses", "load_balancing", self.experts * jnp.sum(fraction * probability))
        return jnp.einsum("bted,bte->btd", outputs, combine.astype(outputs.dtype))


class MoE(nn.Module):
    blocks: int = 2
    width: int = 32

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, self.width)(tokens)
        for _ in range(self.blocks):
            x = x + GroupedAttention()(LinenRMSNorm()(x))
            x = x + MoEFeedForward()(LinenRMSNorm()(x))
        return nn.Dense(VOCAB, name="head")(LinenRMSNorm()(x))


def moe_loss(apply: Any, params: Any, inputs: Any, targets: Any) -> Any:
    logits, sown = apply({"params": params}, inputs, mutable=["losses"])
    balance = sum(jax.tree.leaves(sown["losses"]))
    return cross_entropy(logits, targets) + 0.01 * balance


# --- jax.nn.dot_product_attention (Linen) --------------------------------------------------


class DotProductAttentionBlock(nn.Module):
    heads: int = 4

    @nn.compact
    def __call__(self, x):
        width = x.shape[-1]
        qkv = nn.DenseGeneral((3, self.heads, width // self.heads), name="qkv")(nn.LayerNorm()(x))
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        encoded = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + nn.DenseGeneral(width, axis=(-2, -1), name="out")(encoded)
        return x + nn.Dense(width)(nn.gelu(nn.Dense(4 * width)(nn.LayerNorm()(x))))


class DotProductAttention(nn.Module):
    blocks: int = 2
    width: int = 32

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, self.width)(tokens)
        x = x + self.param("positions", nn.initializers.normal(0.02), (LENGTH, self.width))
        for _ in range(self.blocks):
            x = DotProductAttentionBlock()(x)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def dpa_loss(apply: Any, params: Any, inputs: Any, targets: Any) -> Any:
    return cross_entropy(apply({"params": params}, inputs), targets)


# --- a neural ODE (Equinox and diffrax) ----------------------------------------------------


def neural_ode(key: Any) -> Any:
    import diffrax
    import equinox as eqx

    class VectorField(eqx.Module):
        mlp: eqx.nn.MLP

        def __init__(self, key):
            self.mlp = eqx.nn.MLP(
                2, 2, 32, 2, activation=jax.nn.softplus, final_activation=jnp.tanh, key=key
            )

        def __call__(self, t, y, args):
            return self.mlp(y)

    class NeuralODE(eqx.Module):
        func: VectorField

        def __call__(self, ts, y0):
            solution = diffrax.diffeqsolve(
                diffrax.ODETerm(self.func),
                diffrax.Tsit5(),
                t0=ts[0],
                t1=ts[-1],
                dt0=ts[1] - ts[0],
                y0=y0,
                stepsize_controller=diffrax.PIDController(rtol=1e-3, atol=1e-6),
                saveat=diffrax.SaveAt(ts=ts),
            )
            return solution.ys

    return NeuralODE(VectorField(key))


ODE_TIMES = jnp.linspace(0.0, 4.0, 24)


def spirals(key: Any, steps: int, batch: int = 16) -> tuple[Any, Any]:
    """Trajectories of a damped rotation `dy/dt = A y` from random starts: `y0` [steps, batch,
    2] and `ys` [steps, batch, times, 2] (the exact solution, `expm(A t) y0`)."""
    a = jnp.array([[-0.1, 2.0], [-2.0, -0.1]])
    y0 = jax.random.uniform(key, (steps, batch, 2), minval=-1.0, maxval=1.0)
    flows = jax.vmap(lambda t: jax.scipy.linalg.expm(a * t))(ODE_TIMES)  # [times, 2, 2]
    return y0, jnp.einsum("tij,sbj->sbti", flows, y0)


def ode_loss(model: Any, y0: Any, ys: Any) -> Any:
    predicted = jax.vmap(model, in_axes=(None, 0))(ODE_TIMES, y0)
    return jnp.mean((predicted - ys) ** 2)
