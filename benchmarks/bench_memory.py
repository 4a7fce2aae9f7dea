"""Memory of half precision: what each integration keeps for the backward pass.

For each model and policy, in one run: the bytes `jax.grad` of the loss keeps from the forward
pass (the residuals, arguments left out), by dtype, which is what activation memory follows on
any platform, and XLA's compiled temp and argument bytes of the gradient function (XLA:CPU
widens half-precision ops, so its temp bytes overstate what a GPU needs). Each row's ratio is
against the same model in float32; the baselines are the same Linen model written with Flax's
own `dtype=` on every layer, and the same Equinox model under MPX's `cast_to_half_precision`
(`pip install mixed-precision-for-jax`; left out when it is not installed).

    python benchmarks/bench_memory.py            # GPTs of 4 blocks, d 64, 8 x 128 tokens
    python benchmarks/bench_memory.py --quick    # one block, 2 x 32 tokens (smoke test)
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
from equinox_transformer import CharLM  # noqa: E402
from models import GPT, NNXGPT, residual_bytes  # noqa: E402

HALF = ("mixed_float16", "mixed_bfloat16")


def _cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels
    ).mean()


def _compiled(fun, *args) -> tuple[int, int]:
    stats = jax.jit(jax.grad(fun)).lower(*args).compile().memory_analysis()
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
    }


def linen_rows(layers, batch, length) -> list[dict]:
    tokens = jax.random.randint(jax.random.key(0), (batch, length), 0, 64)
    model = GPT(dim=64, length=length, layers=layers)
    params = model.init(jax.random.key(1), tokens)["params"]

    def loss(params):
        return _cross_entropy(model.apply({"params": params}, tokens), tokens)

    rows = [_row("Linen GPT", "float32", loss, (params,))]
    for name in HALF:
        half = jmp.get_policy(name).compute_dtype
        own = GPT(dim=64, length=length, layers=layers, dtype=half)
        rows.append(
            _row(
                "Linen GPT",
                f"Flax's own dtype={half.name}",
                lambda p, own=own: _cross_entropy(own.apply({"params": p}, tokens), tokens),
                (params,),
            )
        )
        rows.append(_row("Linen GPT", f"autocast {name}", jmp.autocast(loss, name), (params,)))
        mixed = jmp.linen.mixed_precision(model, jmp.get_policy(name))
        rows.append(
            _row(
                "Linen GPT",
                f"linen.mixed_precision {name}",
                lambda p, m=mixed: _cross_entropy(m.apply({"params": p}, tokens), tokens),
                (params,),
            )
        )
    return rows


def nnx_rows(layers, batch, length) -> list[dict]:
    tokens = jax.random.randint(jax.random.key(0), (batch, length), 0, 64)
    rows = []
    for how in ("float32", *HALF):
        model = NNXGPT(64, 64, layers, rngs=nnx.Rngs(0))
        if how != "float32":
            model = jmp.nnx.mixed_precision(model, jmp.get_policy(how))
        graph, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(params, graph=graph, rest=rest):
            return _cross_entropy(nnx.merge(graph, params, rest)(tokens), tokens)

        label = how if how == "float32" else f"nnx.mixed_precision {how}"
        rows.append(_row("NNX GPT", label, loss, (params,)))
    return rows


def equinox_rows(layers, batch, length) -> list[dict]:
    tokens = jax.random.randint(jax.random.key(0), (batch, length), 0, 128)
    model = CharLM(jax.random.key(1), length=length, layers=layers)

    def row(how, call, model):
        # Differentiated with respect to the arrays, as `eqx.filter_grad` does.
        arrays, static = eqx.partition(model, eqx.is_array)

        def loss(arrays):
            logits = jax.vmap(call(eqx.combine(arrays, static)))(tokens)
            return _cross_entropy(logits, tokens)

        return _row("Equinox GPT", how, loss, (arrays,))

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


def table(rows: list[dict]) -> str:
    mib = 2.0**20
    lines = [
        "| model | how | residuals (MiB) | by dtype (MiB) | vs float32 | XLA temp (MiB) | XLA arguments (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    base = {}
    for row in rows:
        if row["how"] == "float32":
            base[row["model"]] = row["residuals"]
        dtypes = ", ".join(
            f"{k} {v / mib:.2f}" for k, v in sorted(row["by_dtype"].items()) if v >= 0.005 * mib
        )
        ratio = row["residuals"] / base[row["model"]]
        lines.append(
            f"| {row['model']} | {row['how']} | {row['residuals'] / mib:.2f} | {dtypes} | "
            f"{ratio:.2f}x | {row['temp'] / mib:.2f} | {row['arguments'] / mib:.2f} |"
        )
    return "\n".join(lines)


def measure(quick: bool) -> list[dict]:
    layers, batch, length = (1, 2, 32) if quick else (4, 8, 128)
    return [
        *linen_rows(layers, batch, length),
        *nnx_rows(layers, batch, length),
        *equinox_rows(layers, batch, length),
    ]


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    args = parser.parse_args(argv)
    text = table(measure(args.quick))
    print(text)
    return text


if __name__ == "__main__":
    main()
