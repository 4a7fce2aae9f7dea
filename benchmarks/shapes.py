"""The model shapes users train, as functional train-step ingredients.

Each shape is a `Shape`: parameters, non-parameter state (`extra`: BatchNorm
statistics, or `{}`), a batch, and `loss(params, extra, batch) -> (loss,
new_extra)` computed under `mixed_float16` (float32 master weights, float16
compute, float32 norms). They differ in what matters to a loss-scaled step:

- `mlp`: few large leaves (8);
- `gpt`: a GPT-style Linen transformer written as a Python loop of blocks
  (16 leaves a block: ~200 at 12 layers, ~400 at 24);
- `gpt_scan`: the same blocks under `nn.scan` over `nn.remat` (leaves stacked
  per layer: 16 leaves whatever the depth);
- `cnn`: convolutions with BatchNorm (batch statistics as `extra`);
- `nnx`: an NNX transformer, split into a graph and a parameter state.

The models themselves are `tests/models.py`, the one copy the tests use
too; the test suite runs the benchmarks in their fast mode.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jmp_policy as jmp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from models import CNN, GPT, NNXGPT  # noqa: E402

POLICY = "mixed_float16"


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    params: Any
    extra: Any
    batch: Any
    loss: Callable[[Any, Any, Any], tuple[jax.Array, Any]]

    @property
    def leaves(self) -> int:
        return len(jax.tree.leaves(self.params))


def _cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels
    ).mean()


def _tokens(vocab, length, batch):
    tokens = jax.random.randint(jax.random.key(1), (batch, length + 1), 0, vocab)
    return tokens[:, :-1], tokens[:, 1:]


def mlp(width=1024, batch=256, policy=POLICY) -> Shape:
    """Few large leaves. `policy="float32"` is the MLP of the benchmarks before the
    suite of shapes (no casting), kept for comparisons with older revisions."""
    sizes = [512, width, width, width, 10]
    keys = jax.random.split(jax.random.key(0), len(sizes) - 1)
    params = [
        {"w": jax.random.normal(k, (m, n)) / m**0.5, "b": jnp.zeros(n)}
        for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]
    x = jax.random.normal(jax.random.key(1), (batch, sizes[0]))
    y = jax.random.randint(jax.random.key(2), (batch,), 0, sizes[-1])
    name = f"MLP ({len(sizes) - 1} layers{'' if policy == POLICY else ', ' + policy})"
    policy = jmp.get_policy(policy)

    def loss(params, extra, batch):
        x, y = policy.cast_to_compute(batch[0]), batch[1]
        for layer in policy.cast_to_compute(params[:-1]):
            x = jax.nn.relu(x @ layer["w"] + layer["b"])
        head = policy.cast_to_compute(params[-1])
        return _cross_entropy(x @ head["w"] + head["b"], y), extra

    return Shape(name, params, {}, (x, y), loss)


def gpt(layers=12, dim=32, length=16, batch=8, vocab=64, scan=False) -> Shape:
    model = jmp.linen.mixed_precision(GPT(vocab, dim, length, layers, scan), jmp.get_policy(POLICY))
    x, y = _tokens(vocab, length, batch)
    params = jax.jit(model.init)(jax.random.key(0), x)["params"]

    def loss(params, extra, batch):
        return _cross_entropy(model.apply({"params": params}, batch[0]), batch[1]), extra

    kind = "nn.scan" if scan else "loop"
    return Shape(f"GPT {layers} layers ({kind})", params, {}, (x, y), loss)


def cnn(batch=16, size=16) -> Shape:
    model = jmp.linen.mixed_precision(CNN((16, 32, 32), 10), jmp.get_policy(POLICY))
    x = jax.random.normal(jax.random.key(1), (batch, size, size, 3))
    y = jax.random.randint(jax.random.key(2), (batch,), 0, 10)
    variables = jax.jit(model.init)(jax.random.key(0), x)

    def loss(params, extra, batch):
        logits, updated = model.apply(
            {"params": params, **extra}, batch[0], mutable=["batch_stats"]
        )
        return _cross_entropy(logits, batch[1]), updated

    return Shape(
        "CNN + BatchNorm", variables["params"], {"batch_stats": variables["batch_stats"]},
        (x, y), loss,
    )  # fmt: skip


def nnx_gpt(layers=4, dim=32, length=16, batch=8, vocab=64) -> Shape:
    model = NNXGPT(vocab, dim, layers, rngs=nnx.Rngs(0))
    model = jmp.nnx.mixed_precision(model, jmp.get_policy(POLICY))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    x, y = _tokens(vocab, length, batch)

    def loss(params, extra, batch):
        logits = nnx.merge(graphdef, params, extra)(batch[0])
        return _cross_entropy(logits, batch[1]), extra

    return Shape(f"NNX GPT {layers} layers", params, rest, (x, y), loss)


def by_name(name: str, quick: bool = False) -> Shape:
    """One shape of `NAMES`, at benchmark size or (quick) test size."""
    tiny_gpt = dict(dim=16, length=8, batch=2)
    made = {
        "mlp": lambda: mlp(width=32, batch=8) if quick else mlp(),
        "mlp_float32": lambda: mlp(**(dict(width=32, batch=8) if quick else {}), policy="float32"),
        "gpt": lambda: gpt(layers=1, **tiny_gpt) if quick else gpt(layers=12),
        "gpt24": lambda: gpt(layers=2, **tiny_gpt) if quick else gpt(layers=24),
        "gpt_scan": lambda: gpt(layers=1, **tiny_gpt, scan=True) if quick else gpt(scan=True),
        "cnn": lambda: cnn(batch=2, size=8) if quick else cnn(),
        "nnx": lambda: nnx_gpt(layers=1, **tiny_gpt) if quick else nnx_gpt(layers=12),
    }
    return made[name]()


NAMES = ("mlp", "mlp_float32", "gpt", "gpt24", "gpt_scan", "cnn", "nnx")


def all_shapes(quick: bool = False) -> list[Shape]:
    """The suite: every shape above (the float32 MLP aside), at benchmark size or (quick)
    test size; quick mode leaves out the 24-block GPT."""
    names = (
        ("mlp", "gpt", "gpt_scan", "cnn", "nnx")
        if quick
        else ("mlp", "gpt", "gpt24", "gpt_scan", "cnn", "nnx")
    )
    return [by_name(name, quick) for name in names]
