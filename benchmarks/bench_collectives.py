"""What crosses the wire, in which dtype: the collectives of a data-parallel and FSDP step.

A 5-layer MLP (256 wide, an 8-way head), Adam, the batch sharded over a "data" mesh axis,
the weights replicated (data parallel) or sharded on their first axis (FSDP), or a
`shard_map` step that `pmean`s its gradients. For each integration (Linen; Linen on the
same MLP written with `nn.Einsum` and a layer's own `x @ self.param(...)`; NNX; autocast)
and policy the compiled step's all-reduces, all-gathers and reduce-scatters
are read from XLA's HLO: dtype, shape and bytes per step, against plain float32 and a
hand-written bfloat16 cast (`astype` on the parameters before `apply`).

XLA:CPU carries bfloat16 collectives in float32: its `float-normalization-bf16` pass
rewrites them after SPMD partitioning. So each row also reads the program as the SPMD
partitioner left it (XLA's dump after `spmd-partitioning`), before any backend pass: a GPU
(NCCL reduces and gathers bfloat16 natively) runs the collectives in the dtypes shown there.

Needs several devices; on a CPU:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/bench_collectives.py
    [--json out.json] [--time]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
import tempfile
import time
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_policy as jmp

WIDTH, DEPTH, CLASSES = 256, 5, 8
_COLLECTIVE = re.compile(r"= (\(.*?\)|\S+) (all-reduce|all-gather|reduce-scatter)(?:-start)?\(")
_ARRAY = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")
_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "pred": 1, "f64": 8}


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(DEPTH - 1):
            x = nn.relu(nn.Dense(WIDTH)(x))
        return nn.Dense(CLASSES)(x)


class OwnWeight(nn.Module):
    """A layer as users write their own: `x @ self.param(...)`, no Flax matmul layer."""

    features: int

    @nn.compact
    def __call__(self, x):
        w = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
        return x @ w + self.param("bias", nn.initializers.zeros, (self.features,))


class LinenOwnMLP(nn.Module):
    """The same MLP from layers whose matmuls no integration takes over: `nn.Einsum` and
    a layer of one's own (the same 10 weights and biases, of the same shapes)."""

    @nn.compact
    def __call__(self, x):
        for i in range(DEPTH - 1):
            layer = nn.Einsum((WIDTH, WIDTH), "bd,df->bf") if i % 2 else OwnWeight(WIDTH)
            x = nn.relu(layer(x))
        return nn.Einsum((WIDTH, CLASSES), "bd,df->bf")(x)


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(WIDTH, WIDTH, rngs=rngs) for _ in range(DEPTH - 1)])
        self.head = nnx.Linear(WIDTH, CLASSES, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = nnx.relu(layer(x))
        return self.head(x)


def collectives_of_hlo(text: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """[(kind, dtype, shape)] of every collective in compiled HLO text (tuples split)."""
    found = []
    for result, kind in _COLLECTIVE.findall(text):
        for dtype, dims in _ARRAY.findall(result):
            found.append((kind, dtype, tuple(int(d) for d in dims.split(",") if d)))
    return found


def compile_partitioned(lowered) -> tuple[Any, str]:
    """(compiled, HLO text right after SPMD partitioning, before any backend pass)."""
    with tempfile.TemporaryDirectory() as folder:
        options = {"xla_dump_to": folder, "xla_dump_hlo_pass_re": "spmd-partitioning"}
        compiled = lowered.compile(options)
        (dump,) = pathlib.Path(folder).glob("*after_spmd-partitioning*.txt")
        return compiled, dump.read_text()


def nbytes(found) -> int:
    return sum(_BYTES.get(d, 4) * int(np.prod(s, dtype=np.int64)) for _, d, s in found)


def summary(found) -> dict:
    """{kind: {dtype: count}} and bytes."""
    table: dict = {}
    for kind, dtype, _ in found:
        table.setdefault(kind, {}).setdefault(dtype, 0)
        table[kind][dtype] += 1
    return table


def _loss(apply, params, x, y):
    logits = apply(params, x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_apply(integration: str, policy: str, reduce_dtype="float32"):
    """(params, apply(params, x)) for an integration: "linen", "linen_own" (Linen, the MLP
    written with `nn.Einsum` and a layer of one's own), "nnx", "autocast", "float32"
    (plain) or "cast_bf16" (a hand-written bfloat16 cast of the parameters)."""
    x = jnp.zeros((2, WIDTH))
    # The default is not passed, so this file also measures revisions without the argument.
    options = {} if reduce_dtype == "float32" else {"reduce_dtype": reduce_dtype}
    if integration == "nnx":
        model = jmp.nnx.mixed_precision(NnxMLP(nnx.Rngs(0)), policy, **options)
        graphdef, params = nnx.split(model)
        return params, lambda p, x: nnx.merge(graphdef, p)(x)
    plain = LinenOwnMLP() if integration == "linen_own" else LinenMLP()
    params = plain.init(jax.random.key(0), x)["params"]
    if integration in ("linen", "linen_own"):
        mixed = jmp.linen.mixed_precision(plain, policy, **options)
        return params, lambda p, x: mixed.apply({"params": p}, x)
    if integration == "autocast":
        cast = jmp.autocast(plain.apply, policy, **options)
        return params, lambda p, x: cast({"params": p}, x)
    if integration == "cast_bf16":
        return params, lambda p, x: plain.apply(
            {"params": jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)}, x.astype(jnp.bfloat16)
        )
    return params, lambda p, x: plain.apply({"params": p}, x)


def build_step(integration, policy, layout, mesh, reduce_dtype="float32", batch=64):
    """(compiled step, its HLO after SPMD partitioning, args) of one configuration."""
    params, apply = make_apply(integration, policy, reduce_dtype)
    half = integration in ("linen", "linen_own", "nnx", "autocast") and policy == "mixed_float16"
    tx = optax.adam(1e-3)
    if half:
        tx = jmp.loss_scaling(tx, jmp.DynamicLossScale(2.0**15))
    loss_fn = partial(_loss, apply)

    def step(params, opt_state, x, y):
        if half:
            _, grads = jmp.value_and_scaled_grad(loss_fn)(opt_state, params, x, y)
        else:
            grads = jax.grad(loss_fn)(params, x, y)
        if layout == "shard_map":
            grads = jax.lax.pmean(grads, "data")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def weight_spec(leaf):
        if layout == "fsdp" and leaf.ndim == 2:
            return P("data", None)
        return P()

    specs = jax.tree.map(weight_spec, params)
    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    opt_state = tx.init(params)
    x = jax.device_put(
        jax.random.normal(jax.random.key(1), (batch, WIDTH)), NamedSharding(mesh, P("data"))
    )
    y = jax.device_put(jnp.arange(batch) % CLASSES, NamedSharding(mesh, P("data")))
    if layout == "shard_map":
        state_specs = jax.tree.map(lambda _: P(), opt_state)
        run = jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(specs, state_specs, P("data"), P("data")),
            out_specs=(specs, state_specs),
            # Per-device gradients, pmean-ed by hand (autocast traces its function outside
            # shard_map's varying-axes typing, so it needs the check off).
            check_vma=False,
        )
    else:
        run = step
    jitted = jax.jit(run, donate_argnums=(0, 1))
    compiled, partitioned = compile_partitioned(jitted.lower(params, opt_state, x, y))
    return compiled, partitioned, (params, opt_state, x, y)


CONFIGS = [
    ("float32", "float32"),
    ("cast_bf16", "float32"),
    ("linen", "mixed_float16"),
    ("linen", "mixed_bfloat16"),
    ("linen_own", "mixed_float16"),
    ("linen_own", "mixed_bfloat16"),
    ("nnx", "mixed_float16"),
    ("nnx", "mixed_bfloat16"),
    ("autocast", "mixed_float16"),
    ("autocast", "mixed_bfloat16"),
]


def measure(
    layouts=("dp", "fsdp", "shard_map"),
    reduce_dtypes=("float32", None),
    integrations=("linen", "linen_own", "nnx", "autocast"),
    timed=False,
    baselines=None,
):
    """One row per configuration; `baselines`: the layouts that also get the float32 and
    hand-cast bfloat16 rows (default: every layout)."""
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = []
    for layout in layouts:
        for integration, policy in CONFIGS:
            if integration not in (*integrations, "float32", "cast_bf16"):
                continue
            if integration in ("float32", "cast_bf16") and layout not in (baselines or layouts):
                continue
            for reduce_dtype in reduce_dtypes:
                if reduce_dtype is None and (
                    integration in ("float32", "cast_bf16") or layout == "shard_map"
                ):
                    continue  # nothing to choose (shard_map: the user's pmean of float32 grads)
                compiled, partitioned, args = build_step(
                    integration, policy, layout, mesh, reduce_dtype
                )
                hlo = collectives_of_hlo(compiled.as_text())
                spmd = collectives_of_hlo(partitioned)
                row = {
                    "layout": layout,
                    "integration": integration,
                    "policy": policy,
                    "reduce_dtype": reduce_dtype,
                    "devices": jax.device_count(),
                    "hlo": [list(c[:2]) + [list(c[2])] for c in hlo],
                    "hlo_bytes": nbytes(hlo),
                    "partitioned": [list(c[:2]) + [list(c[2])] for c in spmd],
                    "partitioned_bytes": nbytes(spmd),
                    "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
                }
                if timed:
                    row["step_ms"] = _time(compiled, args)
                    if integration == "float32":  # A/A: the same program timed again
                        row["step_ms_again"] = _time(compiled, args)
                rows.append(row)
    return rows


def _time(compiled, args, repeats=20):
    params, opt_state, x, y = jax.tree.map(lambda a: a.copy(), args)
    for _ in range(3):
        params, opt_state = compiled(params, opt_state, x, y)
    jax.block_until_ready(params)
    start = time.perf_counter()
    for _ in range(repeats):
        params, opt_state = compiled(params, opt_state, x, y)
    jax.block_until_ready(params)
    return 1e3 * (time.perf_counter() - start) / repeats


def _kinds(found) -> str:
    return "; ".join(
        f"{kind}: " + ", ".join(f"{d} x{n}" for d, n in sorted(by.items()))
        for kind, by in sorted(summary(found).items())
    )


def table(rows) -> str:
    """Bytes per step as the SPMD partitioner left the program (what a GPU sends) against
    plain float32 and a hand-written bfloat16 cast, and what XLA:CPU compiled."""
    base = {r["layout"]: r["partitioned_bytes"] for r in rows if r["integration"] == "float32"}
    cast = {r["layout"]: r["partitioned_bytes"] for r in rows if r["integration"] == "cast_bf16"}
    timed = "step_ms" in rows[0]
    lines = [
        f"Collectives per step: {DEPTH}-layer MLP ({WIDTH} wide), Adam, "
        f"{rows[0]['devices']} devices",
        "",
        "| layout | integration | policy | reduce_dtype | after SPMD partitioning (any backend) "
        "| bytes | vs float32 | vs bf16 cast | XLA:CPU compiled | temp KiB |"
        + (" step ms |" if timed else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if timed else ""),
    ]

    def ratio(value, to):
        return f"{value / to:.2f}x" if to else "-"  # "-": that layout's baseline was not run

    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['integration']} | {r['policy']} | {r['reduce_dtype']} | "
            f"{_kinds(r['partitioned'])} | {r['partitioned_bytes']:,} | "
            f"{ratio(r['partitioned_bytes'], base.get(r['layout']))} | "
            f"{ratio(r['partitioned_bytes'], cast.get(r['layout']))} | {_kinds(r['hlo'])} | "
            f"{r['temp_bytes'] / 1024:,.0f} |" + (f" {r['step_ms']:.2f} |" if timed else "")
        )
    return "\n".join(lines)


def fsdp_table(rows) -> str:
    """The FSDP step's temp memory per device and step time against plain float32 FSDP and
    against `reduce_dtype=None` (gradients in the compute dtype, as before float32 sums)."""
    fsdp = {
        (r["integration"], r["policy"], r["reduce_dtype"]): r for r in rows if r["layout"] == "fsdp"
    }
    base = fsdp.get(("float32", "float32", "float32"))
    if base is None or "step_ms" not in base:
        return ""
    lines = [
        "",
        "FSDP step, temp memory per device and step time (ratios; step times on forced CPU "
        "devices that share the machine's cores: plain float32 timed again gave "
        f"{base['step_ms_again'] / base['step_ms']:.2f}x, their noise)",
        "",
        "| integration | policy | temp vs float32 | temp vs reduce_dtype=None "
        "| step vs float32 | step vs reduce_dtype=None |",
        "|---|---|---|---|---|---|",
    ]
    for (integration, policy, reduce_dtype), r in fsdp.items():
        if reduce_dtype != "float32" or integration in ("float32",):
            continue
        lean = fsdp.get((integration, policy, None), r)
        lines.append(
            f"| {integration} | {policy} | {r['temp_bytes'] / base['temp_bytes']:.2f}x | "
            f"{r['temp_bytes'] / lean['temp_bytes']:.2f}x | "
            f"{r['step_ms'] / base['step_ms']:.2f}x | {r['step_ms'] / lean['step_ms']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="write the rows to this file (-: stdout's first line)")
    parser.add_argument("--layouts", default="dp,fsdp,shard_map")
    parser.add_argument("--integrations", default="linen,linen_own,nnx,autocast")
    parser.add_argument("--reduce-dtypes", default="float32,None")
    parser.add_argument("--time", action="store_true", help="also time each step")
    parser.add_argument(
        "--baselines",
        help="layouts that get the float32 and bfloat16-cast rows (default: all; none: no rows)",
    )
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)  # compiles must run: dumps
    if jax.device_count() < 2:
        sys.exit("needs 2 or more devices: XLA_FLAGS=--xla_force_host_platform_device_count=4")
    reduce_dtypes = tuple(None if r == "None" else r for r in args.reduce_dtypes.split(","))
    rows = measure(
        tuple(args.layouts.split(",")),
        reduce_dtypes,
        tuple(args.integrations.split(",")),
        timed=args.time,
        baselines=None if args.baselines is None else tuple(args.baselines.split(",")),
    )
    text = table(rows) + ("\n" + fsdp_table(rows) if args.time else "")
    if args.json == "-":  # the rows on the first line of stdout, then the table
        print(json.dumps(rows))
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    print(text)
    return text, rows


if __name__ == "__main__":
    main()
