"""Multi-process data-parallel training with JAX's distributed runtime, on one machine.

Launches N local processes (default 2, each with 2 CPU devices) that join one
JAX runtime over loopback (gloo collectives) and train a small Flax model with
`mixed_float16` + `jmp_policy.loss_scaling` on global arrays over a `Mesh`.
At `--nan-step` one process (`--nan-process`) puts a NaN in its own part of the
batch; at `--overflow-step` every process sees a batch whose float16
gradients overflow. The loss-scaled step must behave as on one device: every
process skips the same steps, holds the same scale and ends with bit-identical
parameters. Each process prints its loss-scale trajectory, its skipped steps
and a checksum of its final parameters.

    python examples/multihost.py [--processes 2] [--devices 2] [--steps 30] [--mode spmd|shard_map]
    python examples/multihost.py --checkpoint-dir /tmp/ckpt --checkpoint-step 15   # save at 15
    python examples/multihost.py --checkpoint-dir /tmp/ckpt --resume                # resume from it

On a real cluster run the worker part once per host and let
`jax.distributed.initialize()` find the coordinator (README: "Multi-host").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import time

FEATURES, BATCH_PER_DEVICE = 8, 4


# --- the launcher -------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args) -> list[dict]:
    """Starts the worker processes, waits (bounded), and returns their reports."""
    port = free_port()
    # The caller's XLA flags stay; the device count is this launch's.
    flags = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    flags.append(f"--xla_force_host_platform_device_count={args.devices}")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags)}
    base = [sys.executable, os.path.abspath(__file__), "--worker", "--port", str(port)]
    passthrough = [a for a in sys.argv[1:] if a != "--worker"] if args.argv is None else args.argv
    procs = [
        subprocess.Popen(
            [*base, "--process-id", str(i), *passthrough],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(args.processes)
    ]
    deadline = time.monotonic() + args.timeout
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                raise RuntimeError(f"worker exited with {proc.returncode}:\n{err[-3000:]}")
            outputs.append(out)
    finally:
        for proc in procs:  # on error or timeout, nothing is left running
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    reports = []
    for out in outputs:
        lines = [line for line in out.splitlines() if line.startswith("{")]
        reports.append(json.loads(lines[-1]))
    return reports


# --- the worker ---------------------------------------------------------------------


def worker(args) -> dict:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}",
        num_processes=args.processes,
        process_id=args.process_id,
        initialization_timeout=60,
    )
    import flax.linen as nn
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jmp_policy as jmp

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    replicated, batch_sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    model = jmp.linen.mixed_precision(
        nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(32), nn.relu, nn.Dense(1)]),
        jmp.get_policy("mixed_float16"),
    )
    local_batch = BATCH_PER_DEVICE * jax.local_device_count()

    def local_data(step):
        """This process's slice of the global batch for `step` (deterministic)."""
        rng = np.random.default_rng([step, jax.process_index()])
        x = rng.standard_normal((local_batch, FEATURES)).astype(np.float32)
        y = np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32)
        if step == args.nan_step and jax.process_index() == args.nan_process:
            x[0, 0] = np.nan
        if step == args.overflow_step:
            y = y * np.float32(1e6)  # float16 gradients of this loss overflow
        return x, y

    def global_batch(step):
        x, y = local_data(step)
        return (
            jax.make_array_from_process_local_data(batch_sharded, x),
            jax.make_array_from_process_local_data(batch_sharded, y),
        )

    params = model.init(jax.random.key(0), np.zeros((1, FEATURES), np.float32))["params"]
    params = jax.device_put(params, replicated)
    axis_name = "data" if args.mode == "shard_map" else None
    tx = jmp.loss_scaling(
        optax.adam(1e-2), jmp.DynamicLossScale(2.0**10, period=4), axis_name=axis_name
    )
    opt_state = jax.device_put(tx.init(params), replicated)

    def loss_fn(params, x, y):
        return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

    if args.mode == "spmd":
        # Global arrays under SPMD jit: the finite check is global by itself.
        @jax.jit
        def step(params, opt_state, x, y):
            scale = jmp.get_loss_scale(opt_state)
            grads = jax.grad(lambda p: scale.scale(loss_fn(p, x, y)))(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

    else:
        # pmap-style per-device code: gradients averaged by hand, the skip
        # decision agreed through `axis_name`.
        def per_device(params, opt_state, x, y):
            scale = jmp.get_loss_scale(opt_state)
            grads = jax.grad(lambda p: scale.scale(loss_fn(p, x, y)))(params)
            grads = jax.lax.pmean(grads, "data")
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        step = jax.jit(
            jax.shard_map(
                per_device,
                mesh=mesh,
                in_specs=(P(), P(), P("data"), P("data")),
                out_specs=(P(), P()),
                check_vma=False,
            )
        )

    first = 0
    checkpointer = None
    if args.checkpoint_dir:
        import orbax.checkpoint as ocp

        checkpointer = ocp.StandardCheckpointer()
        path = os.path.abspath(os.path.join(args.checkpoint_dir, "state"))
        if args.resume:
            target = jax.tree.map(
                ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": opt_state}
            )
            restored = checkpointer.restore(path, target)
            params, opt_state = restored["params"], restored["opt_state"]
            first = int(jmp.loss_scaling_report(opt_state).applied_steps) + int(
                jmp.loss_scaling_report(opt_state).skipped_steps
            )

    scales, skipped = [], []
    for i in range(first, args.steps):
        if checkpointer is not None and not args.resume and i == args.checkpoint_step:
            checkpointer.save(path, {"params": params, "opt_state": opt_state})
            checkpointer.wait_until_finished()
        params, opt_state = step(params, opt_state, *global_batch(i))
        report = jmp.loss_scaling_report(opt_state)  # works on non-addressable arrays
        scales.append(report.loss_scale)
        if report.last_step_skipped:
            skipped.append(i)
    if checkpointer is not None:
        checkpointer.close()

    digest = hashlib.sha256()
    flat = []
    for leaf in jax.tree.leaves(params):
        local = np.asarray(leaf.addressable_data(0))  # replicated: every process has it all
        digest.update(local.tobytes())
        flat.extend(local.ravel().tolist())
    result = {
        "process": jax.process_index(),
        "devices": jax.device_count(),
        "mode": args.mode,
        "first_step": first,
        "skipped": skipped,
        "scales": scales,
        "checksum": digest.hexdigest()[:16],
        "params": flat,
        "report": str(jmp.loss_scaling_report(opt_state)),
    }
    jax.distributed.shutdown()
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2, help="CPU devices per process")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--nan-step", type=int, default=10)
    parser.add_argument("--nan-process", type=int, default=1)
    parser.add_argument("--overflow-step", type=int, default=20)
    parser.add_argument("--mode", choices=["spmd", "shard_map"], default="spmd")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-step", type=int, default=15)
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir")
    parser.add_argument(
        "--timeout", type=float, default=110.0, help="seconds before the workers are killed"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = argv
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return None
    reports = launch(args)
    for r in reports:
        print(
            f"process {r['process']} ({r['devices']} devices, {r['mode']}): skipped steps {r['skipped']}; "
            f"checksum {r['checksum']}; scales {' '.join(f'{s:g}' for s in r['scales'])}"
        )
    same = all(
        r["checksum"] == reports[0]["checksum"] and r["scales"] == reports[0]["scales"]
        for r in reports
    )
    print("all processes agree" if same else "PROCESSES DIVERGED")
    return reports


if __name__ == "__main__":
    main()
