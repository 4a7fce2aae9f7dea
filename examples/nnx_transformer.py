"""An NNX transformer classifier, trained with mixed_float16 + dynamic loss scaling.

The model is plain Flax NNX; `jmp_policy.nnx.mixed_precision` sets its layers
to compute in float16 with float32 LayerNorms and a float32 softmax, keeps the
parameters in float32, and `nnx.Optimizer` runs Adam through
`jmp_policy.loss_scaling`. The task is synthetic: does a sequence of tokens
contain more 1s than 2s. About 15 s on 2 CPU cores:

    python examples/nnx_transformer.py [--steps 200] [--policy mixed_float16]
"""

import argparse

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jmp_policy as jmp

VOCAB, LENGTH, DIM = 8, 16, 32


class Block(nnx.Module):
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


class Classifier(nnx.Module):
    def __init__(self, *, rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.position = nnx.Param(jax.random.normal(rngs.params(), (LENGTH, DIM)) * 0.02)
        self.blocks = nnx.List([Block(DIM, 4, rngs=rngs) for _ in range(2)])
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)
        self.head = nnx.Linear(DIM, 2, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.position[...]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(axis=1))


def make_batch(key, batch=64):
    tokens = jax.random.randint(key, (batch, LENGTH), 0, VOCAB)
    labels = ((tokens == 1).sum(axis=1) > (tokens == 2).sum(axis=1)).astype(jnp.int32)
    return tokens, labels


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--policy", default="mixed_float16")
    args = parser.parse_args(argv)

    policy = jmp.get_policy(args.policy)
    model = jmp.nnx.mixed_precision(Classifier(rngs=nnx.Rngs(0)), policy)
    optimizer = nnx.Optimizer(
        model,
        jmp.loss_scaling(optax.adam(2e-3), jmp.DynamicLossScale(2.0**15, period=50)),
        wrt=nnx.Param,
    )

    @nnx.jit
    def train_step(model, optimizer, tokens, labels):
        scale = jmp.get_loss_scale(optimizer)

        def loss_fn(model):
            loss = optax.softmax_cross_entropy_with_integer_labels(model(tokens), labels).mean()
            return scale.scale(loss), loss

        with jmp.nnx.revert_if_skipped(model, optimizer):  # a skipped step changes no state
            grads, loss = nnx.grad(loss_fn, has_aux=True)(model)
            optimizer.update(model, grads)
        return loss

    @nnx.jit
    def accuracy(model, tokens, labels):
        return (model(tokens).argmax(-1) == labels).mean()

    for step in range(args.steps):
        loss = train_step(model, optimizer, *make_batch(jax.random.key(step)))
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {float(loss):.4f}  {jmp.loss_scaling_report(optimizer)}")
    acc = float(accuracy(model, *make_batch(jax.random.key(10**6), batch=1024)))
    kinds = sorted({p.dtype.name for p in jax.tree.leaves(nnx.state(model, nnx.Param))})
    print(f"policy {policy}; parameters stored as {kinds}; held-out accuracy {acc:.3f}")
    return acc


if __name__ == "__main__":
    main()
