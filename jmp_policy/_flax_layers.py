"""What the Linen and NNX integrations do to Flax's own layers, in one place."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jmp_policy._pytree import split_traced
from jmp_policy.activations import softmax_in_float32
from jmp_policy.policy import Policy, cast_floating


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
