"""Unmodified models, one copy for the tests and the benchmarks (no mixed-precision code here).

The benchmarks (`benchmarks/shapes.py`, `benchmarks/bench_autocast.py`) import this file too; the
examples stay self-contained and define their own.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax


def widened_on_cpu(eqn: Any, half: Any) -> bool:
    """A weight-gradient matmul whose bfloat16 operands `jmp_policy.matmul` widened to float32:
    it accumulates in float32, and XLA:CPU cannot run bfloat16 x bfloat16 -> float32."""
    return (
        jnp.dtype(half) == jnp.bfloat16
        and jax.default_backend() == "cpu"
        and eqn.params.get("preferred_element_type") == jnp.float32
        and {v.aval.dtype for v in eqn.invars} == {jnp.dtype(jnp.float32)}
    )


def block_layers(x: jax.Array, heads: int, causal: bool = False, dtype: Any = None) -> jax.Array:
    """A pre-norm transformer block (LayerNorm, self-attention, LayerNorm, MLP 4x).

    Called inside a compact `__call__`, so its layers belong to the caller:
    `LayerNorm_0`, `MultiHeadDotProductAttention_0`, `LayerNorm_1`, `Dense_0`, `Dense_1`.
    """
    mask = nn.make_causal_mask(x[..., 0]) if causal else None
    h = nn.LayerNorm(dtype=dtype)(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=heads, dtype=dtype)(h, h, mask=mask)
    h = nn.LayerNorm(dtype=dtype)(x)
    up = nn.Dense(4 * x.shape[-1], dtype=dtype)(h)
    return x + nn.Dense(x.shape[-1], dtype=dtype)(nn.gelu(up))


class Block(nn.Module):
    """`block_layers` as a module: one GPT block."""

    heads: int = 4
    causal: bool = True
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        return block_layers(x, self.heads, self.causal, self.dtype)


class ScannedBlock(nn.Module):
    """`Block` in the (carry, output) form `nn.scan` wants."""

    heads: int = 4
    dtype: Any = None

    @nn.compact
    def __call__(self, x, _):
        return Block(self.heads, dtype=self.dtype)(x), None


class GPT(nn.Module):
    """Token and position embeddings, `layers` causal blocks, a final LayerNorm and a head.

    Written as a Python loop of blocks (16 parameter leaves a block), or with `scan=True` as
    `nn.scan` over `nn.remat` (the leaves stacked per layer). `dtype` is passed to every layer
    of the loop, the way Flax's examples write it (None: float32): with `dtype=jnp.bfloat16` it
    is the hand-written half-precision baseline the memory benchmark and tests hold the
    integrations to.
    """

    vocab: int = 64
    dim: int = 32
    length: int = 16
    layers: int = 12
    scan: bool = False
    dtype: Any = None

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.dim, dtype=self.dtype)(tokens)
        position = self.param("position", nn.initializers.normal(0.02), (self.length, self.dim))
        x = x + position.astype(x.dtype)
        if self.scan:
            stack = nn.scan(
                nn.remat(ScannedBlock),
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=self.layers,
            )
            x, _ = stack(dtype=self.dtype, name="blocks")(x, None)
        else:
            for _ in range(self.layers):
                x = Block(dtype=self.dtype)(x)
        x = nn.LayerNorm(dtype=self.dtype)(x)
        return nn.Dense(self.vocab, use_bias=False, dtype=self.dtype, name="head")(x)


def residual_bytes(fun: Any, *args: Any) -> dict[str, int]:
    """Bytes `jax.grad(fun)` keeps from the forward pass for the backward pass, by dtype
    (the arguments left out): what activation memory follows on any platform.

    As `jax.ad_checkpoint.print_saved_residuals` counts them, less the residuals that are
    broadcasts of literals (the zeros JAX instantiates for a tangent known to be zero, e.g.
    in `relu`'s or `jnp.where`'s derivative): XLA fuses such a broadcast into the op that
    reads it, so nothing is kept for it.
    """
    from jax.extend import core as jcore

    flat, tree = jax.tree.flatten(args)
    closed, shapes = jax.make_jaxpr(
        lambda *flat: jax.vjp(lambda *a: fun(*jax.tree.unflatten(tree, a)), *flat),
        return_shape=True,
    )(*flat)
    jaxpr = closed.jaxpr
    kept = jaxpr.outvars[len(jaxpr.outvars) - len(jax.tree.leaves(shapes[1])) :]

    def literal_only(var: Any, program: Any, outer: dict) -> bool:
        if isinstance(var, jcore.Literal):
            return True
        if var in outer:  # an input of an inner program: what the caller passed
            return outer[var]()
        made = next((e for e in program.eqns if var in e.outvars), None)
        if made is None:
            return False
        inner = made.params.get("jaxpr")
        if made.primitive.name in ("jit", "pjit", "closed_call") and inner is not None:
            inner = getattr(inner, "jaxpr", inner)
            passed = {
                v: (lambda a=a: literal_only(a, program, outer))
                for v, a in zip(inner.invars, made.invars, strict=True)
            }
            return literal_only(inner.outvars[made.outvars.index(var)], inner, passed)
        if made.primitive.name in ("broadcast_in_dim", "convert_element_type", "reshape"):
            return all(literal_only(v, program, outer) for v in made.invars)
        return False

    found: dict[str, int] = {}
    for var in {v for v in kept if not isinstance(v, jcore.Literal)}:
        if var in jaxpr.invars or literal_only(var, jaxpr, {}):
            continue
        aval = var.aval
        found[aval.dtype.name] = found.get(aval.dtype.name, 0) + aval.size * aval.dtype.itemsize
    return found


class Classifier(nn.Module):
    """An optional conv stem, one transformer block, a classifier head on the mean token.

    `dtype` set: every layer computes in it (the hand-cast baseline of the autocast benchmark);
    None: plain float32 Flax.
    """

    dim: int = 16
    heads: int = 2
    classes: int = 4
    stem: bool = False
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        if self.stem:
            x = nn.Conv(self.dim, (3,), dtype=self.dtype)(x)
        x = block_layers(x, self.heads, dtype=self.dtype)
        return nn.Dense(self.classes, dtype=self.dtype, name="head")(x.mean(axis=1))


class CNN(nn.Module):
    """Conv -> BatchNorm -> relu blocks, then a Dense classifier (`dtype`: as `GPT`'s)."""

    features: tuple[int, ...] = (8, 16)
    classes: int = 4
    dtype: Any = None

    @nn.compact
    def __call__(self, x, train: bool = True):
        for features in self.features:
            x = nn.Conv(features, (3, 3), dtype=self.dtype)(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=self.dtype)(x)
            x = nn.relu(x)
        return nn.Dense(self.classes, dtype=self.dtype, name="head")(x.mean(axis=(1, 2)))


class MLP(nn.Module):
    """Dense -> gelu layers and a Dense head (`dtype`: as `GPT`'s)."""

    features: tuple[int, ...] = (256, 256)
    classes: int = 10
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        for features in self.features:
            x = nn.gelu(nn.Dense(features, dtype=self.dtype)(x))
        return nn.Dense(self.classes, dtype=self.dtype, name="head")(x)


class NNXBlock(nnx.Module):
    """The pre-norm transformer block in NNX."""

    def __init__(self, dim: int = 16, heads: int = 2, *, rngs: nnx.Rngs):
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


class NNXClassifier(NNXBlock):
    """`NNXBlock` with a classifier head on the mean token (its layers stay at the top level)."""

    def __init__(self, dim: int = 16, heads: int = 2, classes: int = 4, *, rngs: nnx.Rngs):
        super().__init__(dim, heads, rngs=rngs)
        self.head = nnx.Linear(dim, classes, rngs=rngs)

    def __call__(self, x):
        return self.head(jnp.mean(super().__call__(x), axis=1))


class NNXGPT(nnx.Module):
    """`GPT` in NNX: embeddings, a list of blocks, a final LayerNorm and a head."""

    def __init__(self, vocab: int, dim: int, layers: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.blocks = nnx.List([NNXBlock(dim, 4, rngs=rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class ScanBlock(nnx.Module):
    """A layer of Flax's `examples/nnx_toy_examples/06_scan_over_layers.py`: Linear, BatchNorm,
    Dropout, gelu."""

    def __init__(self, dim, *, rngs):
        self.linear = nnx.Linear(dim, dim, rngs=rngs)
        self.bn = nnx.BatchNorm(dim, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return jax.nn.gelu(self.dropout(self.bn(self.linear(x))))


class ScanMLP(nnx.Module):
    """Its model: the layers made with `nnx.vmap` (`nnx.split_rngs`), run by `nnx.scan`."""

    def __init__(self, dim, *, n_layers, rngs):
        @nnx.split_rngs(splits=n_layers)
        @nnx.vmap(axis_size=n_layers)
        def create_block(rngs):
            return ScanBlock(dim, rngs=rngs)

        self.layers = create_block(rngs)

    def __call__(self, x):
        @nnx.scan
        def scan_fn(x, block):
            return block(x), None

        return scan_fn(x, self.layers)[0]


def rnn(params, xs):
    """A plain JAX recurrence under `lax.scan` (7 steps with `XS`): two dots and an exp a step."""

    def cell(h, x):
        h = jnp.tanh(h @ params["w"] + x @ params["u"])
        return h, jnp.exp(h).sum()

    h, outs = lax.scan(cell, jnp.zeros((xs.shape[1], params["w"].shape[0])), xs)
    return h.sum() + outs.sum()


RNN_PARAMS = {"w": jnp.eye(4) * 0.5, "u": jnp.ones((3, 4)) * 0.1}
XS = jax.random.normal(jax.random.key(3), (7, 2, 3))


# A conv stem, a block and a 5-class head on (8, 12, 6) inputs: the autocast and census tests'.
MODEL = Classifier(dim=32, heads=4, classes=5, stem=True)
X = jax.random.normal(jax.random.key(0), (8, 12, 6))
Y = jax.random.randint(jax.random.key(1), (8,), 0, 5)
# Jitted: one compilation instead of op-by-op dispatch (about 2 s against 8 s at import).
PARAMS = jax.jit(MODEL.init)(jax.random.key(2), X)["params"]


def loss_fn(params, x, y):
    """`MODEL`'s mean cross-entropy: plain float32 Flax, no mixed-precision code."""
    logits = MODEL.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def round_trips(jaxpr: Any) -> dict[str, list]:
    """The casts of a program (and of every program inside it) that a hand-written half-precision
    model would not have:
    - "widen_op_narrow": a half value widened to float32, used by an op whose float32 result is
      narrowed back (an add done in float32 between two half values);
    - "lossy": a float32 value narrowed to 16 bits and widened back (bits lost for nothing).
    Each entry is the equation that closes the pair."""
    from jax.extend import core as jcore

    found: dict[str, list] = {"widen_op_narrow": [], "lossy": []}

    def bits(aval) -> int:
        dtype = getattr(aval, "dtype", None)
        return (
            jnp.finfo(dtype).bits
            if dtype is not None and jnp.issubdtype(dtype, jnp.floating)
            else 0
        )

    def walk(program) -> None:
        made = {v: e for e in program.eqns for v in e.outvars}
        # Shape-only ops pass a value through: look through them to the cast that made it.
        through = {"reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims", "slice"}

        def origin(v):
            e = None if isinstance(v, jcore.Literal) else made.get(v)
            while e is not None and e.primitive.name in through:
                v = e.invars[0]
                e = None if isinstance(v, jcore.Literal) else made.get(v)
            return e

        def is_cast(e, src, dst):
            return (
                e is not None
                and e.primitive.name == "convert_element_type"
                and bits(e.invars[0].aval) == src
                and bits(e.outvars[0].aval) == dst
            )

        for e in program.eqns:
            for value in e.params.values():
                for inner in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(inner, jcore.ClosedJaxpr):
                        walk(inner.jaxpr)
                    elif isinstance(inner, jcore.Jaxpr):
                        walk(inner)
            if e.primitive.name != "convert_element_type" or isinstance(e.invars[0], jcore.Literal):
                continue
            src = origin(e.invars[0])
            if (
                is_cast(e, 32, 16)
                and src is not None
                and src.primitive.name != "convert_element_type"
            ):
                widened = [origin(v) for v in src.invars]
                if any(is_cast(w, 16, 32) for w in widened):
                    found["widen_op_narrow"].append(e)
            if is_cast(e, 16, 32) and is_cast(src, 32, 16):
                found["lossy"].append(e)

    walk(jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr)
    return found


class NNXBatchNormNet(nnx.Module):
    """An NNX model that writes variables when called: BatchNorm's statistics (train mode)
    and Dropout's RNG counts."""

    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(4, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.head = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(self.drop(self.norm(nnx.relu(self.up(x)))))


def dot_operand_types(fun: Any, *args: Any, platform: str) -> list[tuple[str, ...]]:
    """The operand element types ("bf16", "f32", ...) of every `dot_general` in `fun` lowered
    for `platform` (`jax.export`: no device of that platform needed)."""
    import re

    module = jax.export.export(jax.jit(fun), platforms=[platform])(*args).mlir_module()
    dots = [line for line in module.splitlines() if "stablehlo.dot_general" in line]
    return [tuple(re.findall(r"tensor<(?:\d+x)*(\w+)>", d.split(" : ")[-1])[:2]) for d in dots]
