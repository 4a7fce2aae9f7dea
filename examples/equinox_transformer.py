"""An Equinox transformer language model, trained with mixed_float16 + dynamic loss scaling.

The model is plain Equinox (`eqx.nn.MultiheadAttention`, `eqx.nn.LayerNorm`, `eqx.nn.MLP`,
an activation function held as a leaf). `jmp_policy.eqx.mixed_precision` runs it with float16
matmuls and float32 norms and softmax while the weights stay float32;
`jmp_policy.eqx.filter_value_and_scaled_grad` and `jmp_policy.loss_scaling` give the scaled
gradients and the skip on overflow, under `eqx.filter_jit`. The text is the source of a
standard-library module (nothing to download), read character by character. About 40 s on
2 CPU cores:

    pip install -e ".[equinox]"
    python examples/equinox_transformer.py [--steps 300] [--policies float32,mixed_float16]
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json.decoder

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_policy as jmp

VOCAB, LENGTH, DIM, HEADS, LAYERS = 128, 64, 64, 4, 2


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, dim, heads, key):
        k1, k2 = jax.random.split(key)
        self.norm1 = eqx.nn.LayerNorm(dim)
        self.attention = eqx.nn.MultiheadAttention(heads, dim, key=k1)
        self.norm2 = eqx.nn.LayerNorm(dim)
        self.mlp = eqx.nn.MLP(dim, dim, 4 * dim, 1, activation=jax.nn.gelu, key=k2)

    def __call__(self, x, mask):
        h = jax.vmap(self.norm1)(x)
        x = x + self.attention(h, h, h, mask=mask)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class CharLM(eqx.Module):
    embed: eqx.nn.Embedding
    positions: jax.Array
    blocks: list
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key, vocab=VOCAB, length=LENGTH, dim=DIM, heads=HEADS, layers=LAYERS):
        keys = jax.random.split(key, layers + 3)
        self.embed = eqx.nn.Embedding(vocab, dim, key=keys[0])
        self.positions = 0.02 * jax.random.normal(keys[1], (length, dim))
        self.blocks = [Block(dim, heads, k) for k in keys[2:-1]]
        self.norm = eqx.nn.LayerNorm(dim)
        self.head = eqx.nn.Linear(dim, vocab, key=keys[-1])

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens) + self.positions[: tokens.shape[0]]
        mask = jnp.tril(jnp.ones((tokens.shape[0], tokens.shape[0]), bool))
        for block in self.blocks:
            x = block(x, mask)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def text_tokens() -> np.ndarray:
    text = inspect.getsource(json.decoder)
    return np.frombuffer(text.encode("ascii", "replace"), np.uint8).astype(np.int32) % VOCAB


def loss_fn(model, batch):
    logits = jax.vmap(model)(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


@dataclasses.dataclass
class Result:
    policy: str
    final_loss: float
    half_matmul_share: float
    loss_scale: float
    skipped: int


def train(policy: str, steps: int, batch: int = 16, seed: int = 0) -> Result:
    data = text_tokens()
    model = CharLM(jax.random.key(seed))
    if policy != "float32":
        model = jmp.eqx.mixed_precision(model, policy)
    scale = jmp.DynamicLossScale(2.0**15) if policy == "mixed_float16" else jmp.NoOpLossScale()
    tx = jmp.loss_scaling(optax.adam(1e-3), scale)
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    grad = jmp.eqx.filter_value_and_scaled_grad(loss_fn)

    @eqx.filter_jit
    def step(model, opt_state, batch):
        loss, grads = grad(opt_state, model, batch)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        starts = rng.integers(0, len(data) - LENGTH - 1, batch)
        tokens = jnp.asarray(np.stack([data[s : s + LENGTH + 1] for s in starts]))
        model, opt_state, loss = step(model, opt_state, tokens)
        losses.append(float(loss))
    report = jmp.precision_report(lambda m, t: loss_fn(m, t), model, tokens)
    return Result(
        policy,
        float(np.mean(losses[-20:])),
        report.half_matmul_flop_share,
        float(jmp.get_loss_scale(opt_state).loss_scale),
        int(opt_state.skipped_steps),
    )


def main(argv=None) -> list[Result]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--policies", default="float32,mixed_float16")
    args = parser.parse_args(argv)
    results = [train(p, args.steps) for p in args.policies.split(",")]
    print(
        f"{'policy':<16}{'final loss':>12}{'matmul FLOPs in half':>22}{'loss scale':>12}{'skipped':>9}"
    )
    for r in results:
        print(
            f"{r.policy:<16}{r.final_loss:>12.4f}{r.half_matmul_share:>21.0%}{r.loss_scale:>12g}{r.skipped:>9}"
        )
    return results


if __name__ == "__main__":
    main()
