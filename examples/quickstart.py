"""A small mixed-precision training loop with jmp_policy's core pieces.

float32 master weights, float16 computation, a dynamic loss scale that skips
the update on overflow. Runs in a few seconds on a CPU:

    python examples/quickstart.py --steps 200
"""

import argparse

import jax
import jax.numpy as jnp
import optax

import jmp_policy as jmp


def make_data(key, n=512, d=16):
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (n, d))
    w_true = jax.random.normal(kw, (d, 1))
    return x, x @ w_true


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--policy", default="mixed_float16")
    args = parser.parse_args(argv)

    policy = jmp.get_policy(args.policy)
    x, y = make_data(jax.random.key(0))
    params = policy.cast_to_param({"w": jnp.zeros((x.shape[1], 1)), "b": jnp.zeros((1,))})
    optimizer = optax.adam(5e-2)
    opt_state = optimizer.init(params)
    loss_scale = jmp.DynamicLossScale(2.0**15, period=50)

    def loss_fn(params, x, y):
        params, x = policy.cast_to_compute((params, x))
        pred = policy.cast_to_output(x @ params["w"] + params["b"])
        return jnp.mean((pred - y) ** 2)

    @jax.jit
    def step(params, opt_state, loss_scale, x, y):
        def scaled_loss(p):
            loss = loss_fn(p, x, y)
            return loss_scale.scale(loss), loss

        grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
        grads = loss_scale.unscale(grads)
        finite = jmp.all_finite(grads)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp.select_tree(
            finite, (new_params, new_opt_state), (params, opt_state)
        )
        return params, opt_state, loss_scale.adjust(finite), loss, finite

    skipped = jnp.zeros((), jnp.int32)  # counted on the device: no sync per step
    for i in range(args.steps):
        params, opt_state, loss_scale, loss, finite = step(params, opt_state, loss_scale, x, y)
        skipped = skipped + (~finite).astype(jnp.int32)
        if i % 50 == 0 or i == args.steps - 1:
            print(f"step {i:4d}  loss {float(loss):.5f}  scale {float(loss_scale.loss_scale):g}")
    print(f"policy {policy}; skipped steps: {int(skipped)}; final loss {float(loss):.5f}")
    return float(loss)


if __name__ == "__main__":
    main()
