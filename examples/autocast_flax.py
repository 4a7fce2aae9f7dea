"""autocast on an unmodified Flax model's loss, trained with loss_scaling.

`jmp_policy.autocast(loss_fn, "mixed_float16")` rewrites the traced loss:
matmuls and convolutions in float16, exp/log/softmax sums/normalisation
statistics in float32, everything else in the widest dtype of its inputs. The
model code is plain Flax (float32 parameters, no dtype arguments). Prints the
precision report, then trains. About 20 s on 2 CPU cores:

    python examples/autocast_flax.py [--steps 150] [--policy mixed_float16]
"""

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jmp_policy as jmp


class Classifier(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(32, (3,))(x)
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=4)(h, h)
        h = nn.LayerNorm()(x)
        x = x + nn.Dense(32)(nn.gelu(nn.Dense(64)(h)))
        return nn.Dense(2)(x.mean(axis=1))


def make_batch(key, batch=64, length=16):
    x = jax.random.normal(key, (batch, length, 8))
    # Does channel 0 outweigh channel 1 over the sequence?
    y = (x[:, :, 0].mean(1) > x[:, :, 1].mean(1)).astype(jnp.int32)
    return x, y


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--policy", default="mixed_float16")
    args = parser.parse_args(argv)

    model = Classifier()
    x, y = make_batch(jax.random.key(0))
    params = model.init(jax.random.key(1), x)["params"]

    def loss_fn(params, x, y):
        logits = model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    policy = jmp.get_policy(args.policy)
    mixed_loss = jmp.autocast(loss_fn, policy)
    print(jmp.precision_report(mixed_loss, params, x, y, original=loss_fn))

    tx = jmp.loss_scaling(optax.adam(2e-3), jmp.DynamicLossScale(2.0**15, period=50))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        scale = jmp.get_loss_scale(opt_state)
        loss, grads = jax.value_and_grad(lambda p: scale.scale(mixed_loss(p, x, y)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss / scale.loss_scale

    for i in range(args.steps):
        params, opt_state, loss = step(params, opt_state, *make_batch(jax.random.key(10 + i)))
        if i % 50 == 0 or i == args.steps - 1:
            print(f"step {i:4d}  loss {float(loss):.4f}  {jmp.loss_scaling_report(opt_state)}")
    x, y = make_batch(jax.random.key(10**6), batch=1024)
    acc = float((model.apply({"params": params}, x).argmax(-1) == y).mean())
    print(f"policy {policy}; held-out accuracy (float32 evaluation) {acc:.3f}")
    return acc


if __name__ == "__main__":
    main()
