"""A characterisation snapshot of what the jaxpr readers and rewriters produce (issue 52).

Before the interpreters and name parsers are merged into one core, this records, on the models
of tests/: the programs autocast writes, the rows of `precision_report` under autocast and every
integration, and `debug_precision`'s layers, first non-finite operation and advice. The
redesign must leave all of it as it is, except where the issue asks for a change; the test
(`test_snapshot.py`) compares against `snapshots/characterisation.json`, written under the
suite's settings by

    JMP_WRITE_SNAPSHOT=1 python -m pytest tests/test_snapshot.py

Floats are rounded to 4 significant digits; jaxprs are compared as text with object addresses
left out.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys
import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from models import GPT, MODEL, PARAMS, RNN_PARAMS, XS, NNXClassifier, X, Y, loss_fn, rnn  # noqa: E402

import jmp_policy as jmp  # noqa: E402

FILE = pathlib.Path(__file__).resolve().parent / "snapshots" / "characterisation.json"
POLICIES = ("mixed_float16", "mixed_bfloat16")


def _round(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {str(k): _round(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_round(v) for v in value]
    return value


def _program(fun, *args) -> str:
    return re.sub(r" at 0x[0-9a-f]+", "", str(jax.make_jaxpr(fun)(*args)))


def _rows(fun, *args) -> list:
    report = jmp.precision_report(fun, *args)
    return _round(
        {
            "rows": [list(row) for row in report.rows],
            "half_matmul_flop_share": report.half_matmul_flop_share,
            "casts": report.casts,
            "misaligned": [list(map(str, m)) for m in report.misaligned],
        }
    )


def _origin(origin) -> list:
    """The first non-finite operation: its primitive, layer, direction and source file."""
    return [origin.primitive, origin.layer, origin.direction, pathlib.Path(origin.source).stem]


def _debugged(loss, *args, **kwargs) -> dict:
    report = jmp.debug_precision(loss, *args, **kwargs)
    origin = report.origin
    return _round(
        {
            "layers": [
                [s.layer, s.direction, s.count, s.amax, s.underflow, s.overflow, s.nonfinite]
                for s in report.layers
            ],
            "origin": None if origin is None else _origin(origin),
            "nonfinite_inputs": list(report.nonfinite_inputs),
            "advice": report.advice(),
        }
    )


def _cases() -> dict:
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 64)

    def gpt_loss(model):
        def loss(params):
            logits = model.apply({"params": params}, tokens).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

        return loss

    gpts = {}
    for scan in (False, True):
        model = GPT(dim=32, length=16, layers=2, scan=scan)
        gpts["nn.scan GPT" if scan else "GPT loop"] = (
            gpt_loss(model),
            jax.jit(model.init)(jax.random.key(1), tokens)["params"],
        )
    return {"Classifier": (loss_fn, PARAMS, X, Y), **gpts, "rnn": (rnn, RNN_PARAMS, XS)}


def collect() -> dict:
    out: dict[str, Any] = {"jax": jax.__version__, "autocast": {}, "report": {}, "debug": {}}
    for name, (fun, *args) in _cases().items():
        for policy in POLICIES:
            mixed = jmp.autocast(fun, policy)
            out["autocast"][f"{name} {policy}"] = _program(mixed, *args)
            out["report"][f"{name} autocast {policy}"] = _rows(mixed, *args)
    features = jax.random.normal(jax.random.key(3), (4, 12, 32))  # NNXClassifier's input
    for policy in POLICIES:
        linen = jmp.linen.mixed_precision(MODEL, jmp.get_policy(policy))
        out["report"][f"Classifier linen {policy}"] = _rows(
            lambda p, x, y, linen=linen: optax.softmax_cross_entropy_with_integer_labels(
                linen.apply({"params": p}, x), y
            ).mean(),
            PARAMS, X, Y,
        )  # fmt: skip
        model = jmp.nnx.mixed_precision(NNXClassifier(32, 4, 5, rngs=nnx.Rngs(0)), policy)
        graph, state = nnx.split(model)
        out["report"][f"NNXClassifier nnx {policy}"] = _rows(
            lambda s, graph=graph: nnx.merge(graph, s)(features).astype(jnp.float32).sum(), state
        )
        mlp = jmp.eqx.mixed_precision(eqx.nn.MLP(6, 5, 32, 2, key=jax.random.key(0)), policy)
        out["report"][f"Equinox MLP eqx {policy}"] = _rows(
            lambda m: jax.vmap(m)(X[:, 0]).astype(jnp.float32).sum(), mlp
        )
    out["debug"]["Classifier float16 2^15"] = _debugged(
        loss_fn, PARAMS, X, Y, dtype="float16", loss_scale=2.0**15
    )
    out["debug"]["Classifier bfloat16"] = _debugged(loss_fn, PARAMS, X, Y, dtype="bfloat16")
    nnx_model = NNXClassifier(32, 4, 5, rngs=nnx.Rngs(0))
    out["debug"]["NNXClassifier float16"] = _debugged(
        lambda m: optax.softmax_cross_entropy_with_integer_labels(m(features), Y[:4]).mean(),
        nnx_model,
    )
    # log(0) after a scan: the first non-finite operation and where it is named.
    out["debug"]["rnn then log(0)"] = _debugged(
        lambda p, xs: jnp.log(rnn(p, xs) * 0.0), RNN_PARAMS, XS
    )
    return out


def main(argv=None) -> dict:
    warnings.simplefilter("ignore")
    out = collect()
    if "--write" in (argv or sys.argv[1:]):
        FILE.parent.mkdir(exist_ok=True)
        FILE.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
        print(f"wrote {FILE} ({FILE.stat().st_size:,} bytes)")
    return out


if __name__ == "__main__":
    main()
