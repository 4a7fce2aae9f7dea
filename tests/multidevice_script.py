"""Run by tests/test_multidevice.py in a subprocess with 8 forced CPU devices.

Prints one JSON object with what the test asserts on.
"""

import json
import os

assert "xla_force_host_platform_device_count=8" in os.environ.get("XLA_FLAGS", "")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jmp_policy as jmp  # noqa: E402


def loss_fn(params, x, y):
    pred = jnp.tanh(x @ params["w1"]) @ params["w2"]
    return jnp.mean((pred - y) ** 2)


def make(key=0):
    k1, k2, k3 = jax.random.split(jax.random.key(key), 3)
    params = {"w1": jax.random.normal(k1, (4, 8)) * 0.5, "w2": jax.random.normal(k2, (8, 1)) * 0.5}
    x = jax.random.normal(k3, (64, 4))
    y = jnp.sin(x.sum(axis=1, keepdims=True))
    return params, x, y


def replicas_identical(tree):
    for leaf in jax.tree.leaves(tree):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        if not all(np.array_equal(shards[0], s) for s in shards[1:]):
            return False
    return True


def spmd():
    mesh = jax.make_mesh((8,), ("data",))
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    tx = jmp.loss_scaling(optax.adam(1e-2), jmp.DynamicLossScale(2.0**10, period=5))
    params, x, y = make()
    params = jax.device_put(params, replicated)
    state = jax.device_put(tx.init(params), replicated)

    @jax.jit
    def step(params, state, x, y):
        scale = jmp.get_loss_scale(state)
        grads = jax.grad(lambda p: scale.scale(loss_fn(p, x, y)))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    skipped, scales = [], []
    for i in range(12):
        xi = x.at[37, 2].set(jnp.nan) if i in (3, 8) else x  # row 37 lives on device 4
        xi, yi = jax.device_put(xi, batch), jax.device_put(y, batch)
        before = params
        params, state = step(params, state, xi, yi)
        skipped.append(bool(state.last_step_skipped))
        scales.append(float(state.loss_scale.loss_scale))
        if i in (3, 8):
            assert all(
                np.array_equal(a, b)
                for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(params), strict=True)
            )
    return {
        "skipped": skipped,
        "scales": scales,
        "params_replicated": replicas_identical(params),
        "state_replicated": replicas_identical(state),
        "devices": jax.device_count(),
    }


def shard_mapped(axis_name):
    mesh = jax.make_mesh((8,), ("data",))
    tx = jmp.loss_scaling(optax.sgd(0.1), jmp.DynamicLossScale(2.0**4), axis_name=axis_name)
    params, x, y = make()
    x = x.at[37, 2].set(jnp.nan)

    def per_device(params, x, y):
        scale = jmp.get_loss_scale(tx.init(params))
        grads = jax.grad(lambda p: scale.scale(loss_fn(p, x, y)))(params)  # local, not averaged
        updates, state = tx.update(grads, tx.init(params), params)
        return optax.apply_updates(params, updates), state.last_step_skipped[None]

    fn = jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(P(), P("data"), P("data")),
            out_specs=(P("data"), P("data")),
            check_vma=False,
        )
    )
    batch = NamedSharding(mesh, P("data"))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    new_params, skipped = fn(params, jax.device_put(x, batch), jax.device_put(y, batch))
    return {"skipped": np.asarray(skipped).tolist()}


def spikes_agreed():
    """SkipSpikes with axis_name under shard_map: a spike in one device's shard only (its
    targets 100x, after one clean step) is skipped on every device, whose statistics stay
    equal."""
    mesh = jax.make_mesh((8,), ("data",))
    tx = jmp.loss_scaling(
        optax.sgd(0.1),
        jmp.DynamicLossScale(2.0**4),
        axis_name="data",
        skip_spikes=jmp.scaling.SkipSpikes(warmup=1),
    )
    params, x, y = make()
    spiky = y.at[32:40].multiply(100.0)  # device 4's 8 rows

    def per_device(params, x, y, spiky):
        state = tx.init(params)
        for targets in (y, spiky):
            loss, grads = jmp.value_and_scaled_grad(loss_fn)(state, params, x, targets)
            updates, state = tx.update(grads, state, params, value=loss)
            params = optax.apply_updates(params, updates)
        stats = state.spike_stats
        return state.last_step_skipped[None], stats.norm_mean[None], stats.loss_mean[None]

    fn = jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(P(), P("data"), P("data"), P("data")),
            out_specs=(P("data"), P("data"), P("data")),
            check_vma=False,
        )
    )
    batch = NamedSharding(mesh, P("data"))
    skipped, norms, losses = fn(
        jax.device_put(params, NamedSharding(mesh, P())),
        *(jax.device_put(a, batch) for a in (x, y, spiky)),
    )
    return {
        "skipped": np.asarray(skipped).tolist(),
        "norms_equal": len(set(np.asarray(norms).tolist())) == 1,
        "losses_equal": len(set(np.asarray(losses).tolist())) == 1,
    }


def low_precision_sharded():
    """bfloat16 parameters sharded over the mesh, stochastic rounding and Kahan: the same bits
    as on one device, and the shardings kept."""
    mesh = jax.make_mesh((8,), ("data",))
    rows = NamedSharding(mesh, P("data", None))
    out = {}
    for rounding in ("stochastic", "kahan"):
        tx = jmp.low_precision_optimizer(optax.adamw(1e-2), rounding)
        params = {"w": (jax.random.normal(jax.random.key(0), (64, 32)) * 0.1).astype(jnp.bfloat16)}

        @jax.jit
        def step(params, state, i, tx=tx):
            grads = {"w": jnp.cos(params["w"].astype(jnp.float32) + i)}
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        results = []
        for sharding in (rows, None):
            p = jax.device_put(params, sharding) if sharding is not None else params
            state = tx.init(p)
            for i in range(5):
                p, state = step(p, state, i)
            results.append(p)
        out[rounding] = {
            "equal": bool(np.array_equal(np.asarray(results[0]["w"]), np.asarray(results[1]["w"]))),
            "sharded": results[0]["w"].sharding.is_equivalent_to(rows, 2),
            "dtype": str(results[0]["w"].dtype),
        }
    return out


print(
    json.dumps(
        {
            "spmd": spmd(),
            "with_axis": shard_mapped("data"),
            "without_axis": shard_mapped(None),
            "low_precision": low_precision_sharded(),
            "spikes": spikes_agreed(),
        }
    )
)
