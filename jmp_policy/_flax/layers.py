"""What the Linen and NNX integrations do to Flax's own layers, in one place: which layers
run in float32 (`LINEN_NORMS`, `NNX_NORMS`: the default overrides) and as recomputed islands
(`recomputes`, `recomputed`), attention's float32 softmax (`attention_with_float32_softmax`)
and the float8 layers (`fp8_dot_for`). `linen.py` and `nnx.py` read these; what differs between
the two is only how each reaches a module (a Linen clone, an NNX object). Matmuls are the
engine's (`autocast.cast_at_use`): no hook of Flax's is filled for a 16-bit matmul."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmp_policy._autocast.activations import softmax_in_float32
from jmp_policy._core.overrides import is_compute_dtype
from jmp_policy._core.pytree import split_traced
from jmp_policy._flax.fp8_layers import is_delayed_dot
from jmp_policy.block_scaled import MODES
from jmp_policy.fp8 import (
    Fp8DotGeneral,
    float8_format,
    fp8_eligible,
    fp8_layer,
    warn_head_in_low_precision,
)
from jmp_policy.policy import BLOCK_FORMATS, Policy, cast_floating, is_floating_array

LINEN_NORMS = (nn.LayerNorm, nn.BatchNorm, nn.GroupNorm, nn.RMSNorm, nn.InstanceNorm)
NNX_NORMS = (nnx.LayerNorm, nnx.BatchNorm, nnx.GroupNorm, nnx.RMSNorm, nnx.InstanceNorm)
"""Flax's normalisation layers: they compute in float32 (`NORMS_IN_FLOAT32`, the default
overrides) and run as recomputed islands inside a 16-bit model."""

# One float8 op per format, told apart from a user's by identity.
_POLICY_FP8_DOTS = {fmt: Fp8DotGeneral(fmt) for fmt in ("hybrid", *BLOCK_FORMATS.values())}


def fp8_dot_for(
    module: Any,
    policy: Policy,
    path: tuple[str, ...],
    delayed: Callable[[tuple[str, ...], Any], Any] | None = None,
) -> Any:
    """The `dot_general` a layer takes under `policy`: float8's (`Fp8DotGeneral`, one per
    format; with `delayed`, what it makes: the layer's delayed-scaling dot, `_fp8_layers`)
    for a Dense/Linear-like layer with Flax's default op (none given by the user) under a
    float8 policy, except the logits head and the embedding (`jmp_policy.fp8.FP8_EXCLUDE`,
    matched against the path); `lax.dot_general` back for a layer this put in float8 and the
    policy no longer does; None to leave it as it is."""
    current = getattr(module, "dot_general", _ABSENT)
    if current is _ABSENT or getattr(module, "dot_general_cls", None) is not None:
        return None
    fp8 = fp8_layer(policy.compute_dtype, "/".join(path))
    # Equal is not enough: the user's own Fp8DotGeneral() is theirs.
    ours = any(current is dot for dot in _POLICY_FP8_DOTS.values()) or is_delayed_dot(current)
    if fp8 and (current in (None, jax.lax.dot_general) or ours):
        if delayed is not None:
            return None if is_delayed_dot(current) else delayed(path, module)
        return _POLICY_FP8_DOTS[float8_format(policy.compute_dtype)]
    if not fp8 and ours:
        return jax.lax.dot_general
    return None


_ABSENT = object()


class _LastMatmul(threading.local):
    """The last matmul layer a policy's forward pass called, in this thread: (its module path,
    the format it multiplies in, or None for 16 bits)."""

    layer: tuple[str, str | None] | None = None


_LAST_MATMUL = _LastMatmul()


def note_matmul_layer(module: Any, where: str, args: tuple) -> None:
    """Notes a call of a Dense/Linear-like layer (one with a `dot_general`) at module path
    `where` with these arguments, for `warning_if_head_in_low_precision`."""
    dot = getattr(module, "dot_general", _ABSENT)
    if dot is _ABSENT or not hasattr(module, "dtype"):
        return
    fmt = None
    if any(dot is ours for ours in _POLICY_FP8_DOTS.values()) or is_delayed_dot(dot):
        fmt = getattr(dot, "fmt", "hybrid")
        k = getattr(args[0], "shape", (0,))[-1] if args else 0
        n = getattr(module, "features", getattr(module, "out_features", 16))
        n = int(np.prod(n)) if isinstance(n, (int, tuple)) else 16
        if fp8_eligible((1, k), (k, n), (((1,), (0,)), ((), ())), fmt) is not None:
            fmt = None  # too small: it multiplies in bfloat16
    _LAST_MATMUL.layer = (where, None if fmt is None else fmt if fmt in MODES else "float8")


@contextlib.contextmanager
def warning_if_head_in_low_precision() -> Any:
    """Around a Linen or NNX policy's forward pass: afterwards, warns when the last matmul
    layer it called (the logits head, by the program's structure) multiplies in float8 or a
    block-scaled format (`jmp_policy.fp8.warn_head_in_low_precision`), with the override that
    keeps it in bfloat16."""
    outer, _LAST_MATMUL.layer = _LAST_MATMUL.layer, None
    try:
        yield
        last = _LAST_MATMUL.layer
        if last is not None and last[1] is not None:
            keep_out = (
                f'overrides={{**overrides, "{last[0]}": jmp_policy.get_policy("mixed_bfloat16")}}'
            )
            warn_head_in_low_precision(last[0], last[1], keep_out)
    finally:
        _LAST_MATMUL.layer = outer


def block_keeps_its_dtype(x: Any, out: Any, compute: Any) -> Any:
    """A block's output (`x -> block(x)`, the same shape) in the compute dtype its input came
    in, where a float32 island at its end (a layer an override keeps in float32, e.g. the
    precision debugger's advice) left it wider: the model continues in the compute dtype, and
    an `nnx.scan` over such blocks needs its carry's dtype kept. Any other output (another
    shape, a tuple, an input that came in wider) is returned as it is."""
    if (
        is_floating_array(out)
        and is_floating_array(x)
        and out.shape == x.shape
        and x.dtype == compute
        and jnp.finfo(out.dtype).bits > jnp.finfo(compute).bits
    ):
        return out.astype(compute)
    return out


def recomputes(module: Any, norms: Any, island: Policy, outer: Policy) -> bool:
    """Whether `module` runs as a recomputed float32 island (`recomputed`): one of Flax's
    normalisation layers (`norms`, the integration's `NORMS_IN_FLOAT32` classes) whose own
    policy computes in float32 inside a model that computes in 16 bits."""
    return (
        isinstance(module, tuple(norms))
        and island.compute_dtype == jnp.float32
        and outer.compute_dtype != jnp.float32
    )


def recomputed(call: Any, cast: Policy, state: Any, args: tuple, kwargs: dict, back_to: Any) -> Any:
    """A float32 normalisation layer inside a half-precision model, as Flax's own `dtype=`
    layers and `activations.meet` treat an island: `call(state, *args, **kwargs)` (the layer
    on its variables `state`) with the arrays of `args`/`kwargs` cast by `cast` (the island's
    float32 policy), and its floating output handed back in `back_to` (the compute dtype of
    the model around it, so a `nn.scan`/`nnx.scan` carry keeps its dtype).

    The cast and the layer run inside a `jax.checkpoint`: the backward pass keeps the layer's
    half-precision inputs (and `state`) and recomputes its float32 values from them, instead
    of float32 copies of activations (a LayerNorm keeps three, a BatchNorm two). The forward
    values are the same; the cost is the layer's forward computation again in the backward
    pass, an elementwise pass over the activation. Non-array arguments
    (`use_running_average=False`) are passed as they are. Returns what `call` returns (the
    layer's output, and whatever `call` adds to it) with the output's floating leaves cast."""
    arrays, rebuild = split_traced((args, kwargs))

    def run(state, arrays):
        args, kwargs = cast.cast_to_compute(rebuild(arrays))
        return call(state, *args, **kwargs)

    out, rest = jax.checkpoint(run)(state, arrays)
    return cast_floating(out, back_to), rest


def attention_with_float32_softmax(
    query,
    key,
    value,
    bias=None,
    mask=None,
    broadcast_dropout: bool = True,
    dropout_rng=None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype=None,
    precision=None,
    module=None,
    promote_dtype=None,
    is_causal: bool = False,
):
    """Dot-product attention with half-precision matmuls and a float32 softmax.

    A drop-in `attention_fn` for `nnx.MultiHeadAttention` and Linen's
    `MultiHeadDotProductAttention` (the arguments of `nnx.dot_product_attention`). Both
    matmuls run in the compute dtype; the softmax runs in float32 (exp overflows float16
    above ~11) and returns the weights in the value's dtype for the second matmul
    (`activations.softmax_in_float32`: the one copy the backward pass keeps, as Flax's own
    `dtype=` layers keep). It also avoids `jax.nn.dot_product_attention`'s float16 path,
    which asks for the F16_F16_F32 dot algorithm that XLA:CPU cannot compile.
    """
    if promote_dtype is not None:
        query, key, value = promote_dtype((query, key, value), dtype=dtype)
    depth = query.shape[-1]
    query = query / jnp.sqrt(jnp.asarray(depth, jnp.float32)).astype(query.dtype)
    # The matmul runs in the compute dtype (GPUs accumulate it in float32); the logits
    # are widened after it, so the backward matmuls stay in half precision too.
    logits = jnp.einsum("...qhd,...khd->...hqk", query, key, precision=precision)
    logits = logits.astype(jnp.float32)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if is_causal:
        causal = jnp.tril(jnp.ones(logits.shape[-2:], jnp.bool_))
        mask = causal if mask is None else jnp.logical_and(mask, causal)
    weights = softmax_in_float32(logits, axis=-1, dtype=value.dtype, where=mask)
    if module is not None:
        collection = nnx.Intermediate if isinstance(module, nnx.Module) else "intermediates"
        module.sow(collection, "attention_weights", weights)
    if not deterministic and dropout_rate > 0.0:
        if dropout_rng is None:
            raise ValueError("Expected a PRNG key for `dropout_rng` when dropout is on, got None.")
        keep_prob = 1.0 - dropout_rate
        shape = (
            (1,) * (weights.ndim - 2) + weights.shape[-2:] if broadcast_dropout else weights.shape
        )
        keep = jax.random.bernoulli(dropout_rng, keep_prob, shape)
        weights = jnp.where(keep, weights / keep_prob, 0.0)
    return jnp.einsum("...hqk,...khd->...qhd", weights, value, precision=precision)


# Linen's modules: the bound module is a per-call clone, its fields set with object.__setattr__.


def carry_keeps_its_dtype(carry_in: Any, out: Any) -> Any:
    """A lifted body's `(carry, y)` result with the carry in its input dtypes.

    Lifted transforms (`nn.scan`, `nn.remat`, `nn.vmap`, `nn.jit`) run a clone
    of the module whose parent is a Scope; its inputs were cast inside the
    transform, but `lax.scan` fixed the carry's type from the uncast input, so
    a carry that came in as float32 (from a float32 island) must leave as
    float32. Results of any other form are returned as they are.
    """
    if not (isinstance(out, tuple) and len(out) == 2):
        return out
    carry_out, y = out
    if jax.tree.structure(carry_out) != jax.tree.structure(carry_in):
        return out

    def like(new, old):
        old_dtype = getattr(old, "dtype", None)
        if is_floating_array(new) and old_dtype is not None and new.dtype != old_dtype:
            return new.astype(old_dtype)
        return new

    return jax.tree.map(like, carry_out, carry_in), y


def linen_compute_in(module: nn.Module, dtype: np.dtype) -> None:
    """The policy decides the module's computation dtype, whatever the model wrote.

    Linen layers promote their inputs and kernels to their `dtype`, so a layer
    given `dtype=self.dtype` or `dtype=config.dtype` (float32 by default, as in
    Flax's examples) would compute in float32 whatever its inputs are. A
    floating (or unset) `dtype` field, and the floating `dtype` of a config
    dataclass held in a field, become the policy's compute dtype; an integer or
    bool `dtype` (indices, masks) is left alone. The bound module is a per-call
    clone, so the user's module is untouched.
    """
    fields = getattr(module, "__dataclass_fields__", {})
    if "dtype" in fields and is_compute_dtype(getattr(module, "dtype", None)):
        object.__setattr__(module, "dtype", dtype)
    for name in fields:
        config = getattr(module, name, None)
        if not dataclasses.is_dataclass(config) or isinstance(config, (type, nn.Module)):
            continue
        given = getattr(config, "dtype", None)
        if (
            given is not None
            and "dtype" in {f.name for f in dataclasses.fields(config)}
            and is_compute_dtype(given)
            and jnp.dtype(given) != dtype
        ):
            object.__setattr__(module, name, dataclasses.replace(config, dtype=dtype))


def linen_softmax_in_float32(module: nn.Module, policy: Policy) -> None:
    """Attention modules (Flax's MultiHeadDotProductAttention) get a float32 softmax: Flax's
    default attention becomes `attention_with_float32_softmax` (one half-precision copy of
    the weights kept); a custom `attention_fn` or einsum gets Flax's `force_fp32_for_softmax`.

    The bound module is a per-call clone, so the user's module is untouched.
    """
    fields = getattr(module, "__dataclass_fields__", {})
    if "force_fp32_for_softmax" not in fields or policy.compute_dtype == jnp.float32:
        return
    custom = ("qk_attn_weights_einsum_cls", "attn_weights_value_einsum_cls")
    if getattr(module, "attention_fn", None) is nn.dot_product_attention and all(
        getattr(module, name, None) is None for name in custom
    ):
        object.__setattr__(module, "attention_fn", attention_with_float32_softmax)
    else:
        object.__setattr__(module, "force_fp32_for_softmax", True)
