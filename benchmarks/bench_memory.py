"""Memory of half precision: what each integration keeps for the backward pass.

For each model and policy, in one run: the bytes `jax.grad` of the loss keeps from the forward
pass (the residuals, arguments left out, as `tests/models.residual_bytes` counts them), by
dtype, which is what activation memory follows on any platform, and XLA's compiled temp and
argument bytes of the gradient function (XLA:CPU widens half-precision ops, so its temp bytes
overstate what a GPU needs). Each row's ratio is against the same model in float32; the
baselines are the same model written with Flax's own `dtype=` on every layer (Linen, NNX), and
the Equinox example under MPX's `cast_to_half_precision` (`pip install mixed-precision-for-jax`;
left out when it is not installed). The models are the suite's: an MLP, a GPT as a Python loop
of blocks and as `nn.scan` over `nn.remat` blocks, a CNN with BatchNorm, the GPT in NNX, and the
Equinox example's transformer.

    python benchmarks/bench_memory.py            # GPTs of 4 blocks, d 64, 8 x 128 tokens
    python benchmarks/bench_memory.py --large    # also a GPT of 16 blocks, 32 x 256 tokens
    python benchmarks/bench_memory.py --quick    # one block, 2 x 32 tokens (smoke test)
    python benchmarks/bench_memory.py --step-time 5   # also each row's gradient step time

With `--step-time`, run it under another revision's package too (`git worktree add /tmp/old
REV`, then `PYTHONPATH=/tmp/old python benchmarks/bench_memory.py --step-time 5`): the ratios
to Flax's own `dtype=` model, each measured in its own run, compare the revisions.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jmp_policy as jmp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import interleaved_medians  # noqa: E402
from equinox_transformer import CharLM  # noqa: E402
from models import CNN, GPT, MLP, NNXGPT, residual_bytes  # noqa: E402

HALF = ("mixed_float16", "mixed_bfloat16")


def _cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels
    ).mean()


def _compiled(fun, *args) -> tuple[float, float]:
    """XLA's temp and argument bytes of the compiled gradient (NaN where XLA:CPU cannot compile
    it: NNX's own float16 attention asks for an F16_F16_F32 dot)."""
    try:
        stats = jax.jit(jax.grad(fun)).lower(*args).compile().memory_analysis()
    except ValueError as error:
        if "F16_F16_F32" not in str(error):
            raise
        return float("nan"), float("nan")
    if stats is None:
        return 0, 0
    return stats.temp_size_in_bytes, stats.argument_size_in_bytes


def _row(model, how, fun, args) -> dict:
    by_dtype = residual_bytes(fun, *args)
    temp, arguments = _compiled(fun, *args)
    return {
        "model": model,
        "how": how,
        "residuals": sum(by_dtype.values()),
        "by_dtype": by_dtype,
        "temp": temp,
        "arguments": arguments,
        "grad": (jax.jit(jax.grad(fun)), args),
    }


def step_times(rows: list[dict], rounds: int) -> dict:
    """The median time of each row's compiled gradient, interleaved over `rounds` rounds
    within each model's rows, as a ratio to the same model written with Flax's own `dtype=`
    in the same policy's half dtype (Equinox's: under MPX's `cast_to_half_precision`; the
    float32 row: to float32 itself). NaN where XLA:CPU cannot compile the row or its
    baseline."""
    times = {}
    for model in dict.fromkeys(r["model"] for r in rows):
        group = {r["how"]: r["grad"] for r in rows if r["model"] == model}
        runnable = {}
        for how, (fn, args) in group.items():
            try:
                jax.block_until_ready(fn(*args))
                runnable[how] = fn
            except ValueError as error:
                if "F16_F16_F32" not in str(error):
                    raise
        medians = interleaved_medians(runnable, {h: group[h][1] for h in runnable}, rounds, 5)
        for how in group:
            times[(model, how)] = medians.get(how, float("nan"))
    ratios = {}
    for (model, how), seconds in times.items():
        half = next((d for d in ("bfloat16", "float16") if d in how), None)
        bases = [f"Flax's own dtype={half}", f"MPX cast_to_half_precision {half}"]
        base = next((b for b in bases if (model, b) in times), None) if half else "float32"
        reference = times.get((model, base), float("nan"))
        ratios[(model, how)] = (seconds, seconds / reference)
    return ratios


def _linen_model(name, size, dtype=None):
    """One of the suite's Linen models written with `dtype=` on every layer (None: float32),
    its input, labels and the collections `apply` updates."""
    layers, batch, length = size
    tokens = jax.random.randint(jax.random.key(0), (batch, length), 0, 64)
    if name == "MLP":
        x = jax.random.normal(jax.random.key(0), (batch * length, 128))
        return MLP((512, 512), 10, dtype=dtype), x, jnp.zeros(len(x), jnp.int32), False
    if name == "CNN + BatchNorm":
        x = jax.random.normal(jax.random.key(0), (batch * 4, 32, 32, 3))
        model = CNN((16, 32, 32), 10, dtype=dtype)
        return model, x, jnp.zeros(len(x), jnp.int32), ["batch_stats"]
    scan = name.startswith("nn.scan")
    return GPT(dim=64, length=length, layers=layers, scan=scan, dtype=dtype), tokens, tokens, False


def linen_rows(name, size) -> list[dict]:
    model, x, labels, mutable = _linen_model(name, size)
    variables = jax.jit(model.init)(jax.random.key(1), x)
    rest = {k: v for k, v in variables.items() if k != "params"}

    def loss_of(apply):
        def loss(params):
            out = apply({"params": params, **rest}, x, mutable=mutable)
            return _cross_entropy(out[0] if mutable else out, labels)

        return loss

    params = (variables["params"],)
    rows = [_row(name, "float32", loss_of(model.apply), params)]
    for policy in HALF:
        half = jmp.get_policy(policy).compute_dtype
        own = _linen_model(name, size, half)[0]
        with jax.numpy_dtype_promotion("standard"):  # Flax's own model mixes dtypes as written
            rows.append(_row(name, f"Flax's own dtype={half.name}", loss_of(own.apply), params))
        rows.append(
            _row(name, f"autocast {policy}", jmp.autocast(loss_of(model.apply), policy), params)
        )
        mixed = jmp.linen.mixed_precision(model, jmp.get_policy(policy))
        rows.append(_row(name, f"linen.mixed_precision {policy}", loss_of(mixed.apply), params))
    return rows


def nnx_rows(size) -> list[dict]:
    layers, batch, length = size
    tokens = jax.random.randint(jax.random.key(0), (batch, length), 0, 64)

    def row(how, model):
        graph, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(params, graph=graph, rest=rest):
            return _cross_entropy(nnx.merge(graph, params, rest)(tokens), tokens)

        return _row("NNX GPT", how, loss, (params,))

    rows = [row("float32", NNXGPT(64, 64, layers, rngs=nnx.Rngs(0)))]
    for policy in HALF:
        half = jmp.get_policy(policy).compute_dtype
        own = NNXGPT(64, 64, layers, rngs=nnx.Rngs(0))
        for _, module in nnx.iter_graph(own):  # Flax's own dtype= on every layer
            if isinstance(module, nnx.Module) and hasattr(module, "dtype"):
                module.dtype = half
        with jax.numpy_dtype_promotion("standard"):
            rows.append(row(f"Flax's own dtype={half.name}", own))
        mixed = jmp.nnx.mixed_precision(NNXGPT(64, 64, layers, rngs=nnx.Rngs(0)), policy)
        rows.append(row(f"nnx.mixed_precision {policy}", mixed))
    return rows


def equinox_rows(size) -> list[dict]:
    layers, batch, length = size
    tokens = jax.random.randint(jax.random.key(0), (batch, length), 0, 128)
    model = CharLM(jax.random.key(1), length=length, layers=layers)

    def row(how, call, model):
        # Differentiated with respect to the arrays, as `eqx.filter_grad` does.
        arrays, static = eqx.partition(model, eqx.is_array)

        def loss(arrays):
            logits = jax.vmap(call(eqx.combine(arrays, static)))(tokens)
            return _cross_entropy(logits, tokens)

        return _row("Equinox GPT (example)", how, loss, (arrays,))

    rows = [row("float32", lambda m: m, model)]
    try:
        import mpx
    except ImportError:
        mpx = None
    for name in HALF:
        half = jmp.get_policy(name).compute_dtype
        if mpx is not None:
            mpx.set_half_precision_datatype(half)
            how = f"MPX cast_to_half_precision {half.name}"
            rows.append(row(how, mpx.cast_to_half_precision, model))
        mixed = jmp.eqx.mixed_precision(model, name)
        rows.append(row(f"eqx.mixed_precision {name}", lambda m: m, mixed))
    return rows


def table(rows: list[dict], steps: dict | None = None) -> str:
    mib = 2.0**20
    lines = [
        "| model | how | residuals (MiB) | by dtype (MiB) | vs float32 | XLA temp (MiB) | XLA arguments (MiB) |"
        + (" step ms | step vs Flax dtype= |" if steps else ""),
        "|---|---|---|---|---|---|---|" + ("---|---|" if steps else ""),
    ]
    base = {}
    for row in rows:
        if row["how"] == "float32":
            base[row["model"]] = row["residuals"]
        dtypes = ", ".join(
            f"{k} {v / mib:.2f}" for k, v in sorted(row["by_dtype"].items()) if v >= 0.005 * mib
        )
        ratio = row["residuals"] / base[row["model"]]
        line = (
            f"| {row['model']} | {row['how']} | {row['residuals'] / mib:.2f} | {dtypes} | "
            f"{ratio:.2f}x | {row['temp'] / mib:.2f} | {row['arguments'] / mib:.2f} |"
        )
        if steps:
            seconds, against = steps[(row["model"], row["how"])]
            line += f" {seconds * 1e3:.2f} | {against:.2f}x |"
        lines.append(line)
    return "\n".join(lines)


LINEN = ("MLP", "GPT loop", "nn.scan GPT", "CNN + BatchNorm")


def measure(quick: bool, large: bool = False) -> list[dict]:
    size = (1, 2, 32) if quick else (4, 8, 128)  # GPT blocks, batch, tokens
    rows = [row for name in LINEN for row in linen_rows(name, size)]
    if large:  # the shape of issue 51's table: 16 blocks, 32 x 256 tokens
        rows += linen_rows("GPT loop, 16 blocks, 32 x 256", (16, 32, 256))
    return [*rows, *nnx_rows(size), *equinox_rows(size)]


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    parser.add_argument("--large", action="store_true", help="also a GPT of 16 blocks, 32 x 256")
    parser.add_argument(
        "--step-time",
        type=int,
        metavar="ROUNDS",
        help="also time each row's compiled gradient (interleaved rounds), as a ratio to the "
        "same model with Flax's own dtype= (XLA:CPU: half precision is emulated, so compare "
        "ratios between revisions, not against float32)",
    )
    args = parser.parse_args(argv)
    rows = measure(args.quick, args.large)
    text = table(rows, step_times(rows, args.step_time) if args.step_time else None)
    print(text)
    return text


if __name__ == "__main__":
    main()
