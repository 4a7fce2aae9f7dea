"""The routes compared: the Linen/NNX policy and autocast on the same model (issue 71's
`hard_models.py`: Gemma (NNX), the MoE decoder and the `jax.nn.dot_product_attention` decoder
(Linen)), forward and backward, float16.

Each operation is named by its module path and primitive; where both routes run an operation at
the same place, they must run it in the same dtypes. The places where they still differ are
listed below, each with its cause, and must be exactly those: a new difference fails, and so
does a listed one that is gone (take it off the list). What differs is where the routes read a
program differently, not the float32 list: every such operation already agrees (the list's
shift by the maximum, norms' scaling by their float32 scale, softmax's denominators).

- `explicit float32`: the model's own `astype(jnp.float32)` (Gemma's logits before the
  soft-capping `tanh`, and its `sqrt(d).astype(float32)` scale that promotes the residual
  stream): the policy traces the model in the compute dtype and sees it; autocast traces in
  float32, where the cast leaves no operation (issue 71's open point).
- `a constant table meets an activation`: rotary embeddings' `x * cos` with tables computed in
  float32 from the positions: the policy follows the program's own promotion to float32 (as
  the model's own `dtype=` recipe does), autocast casts the table to the activation's dtype
  (`activations.meet`, rule 2).
"""

from __future__ import annotations

import collections
import functools
import re

import hard_models as hm
import jax
import numpy as np
import pytest
from flax import nnx

import jmp_policy as jmp
from jmp_policy._core import naming as _naming
from jmp_policy._core.naming import module_path
from jmp_policy._core.overrides import FLOAT32_ISLAND
from jmp_policy._reports.census import compute_dtype, iter_equations

pytestmark = pytest.mark.standard_promotion  # the models' own code mixes dtypes

POLICY = "mixed_float16"
_ROOTS = ("Gemma", "MoE", "DotProductAttention")
_MARKERS = (FLOAT32_ISLAND, "jmp_autocast_region", "jmp_cast_at_use", "rematted_computation")
# Data movement and casts: where each route puts them is its own (saturating casts, copies).
_MOVES = frozenset(
    "convert_element_type clamp reduce_precision broadcast_in_dim reshape squeeze transpose "
    "slice concatenate dynamic_slice dynamic_update_slice gather scatter select_n copy copy_p "
    "pad iota stop_gradient split rev name pjit jit closed_call remat2 checkpoint "
    "custom_jvp_call custom_vjp_call".split()
)

EXPLICIT_FLOAT32 = "explicit float32"
CONSTANT_TABLE = "a constant table meets an activation"
_ATTENTION = r"(GroupedAttention_\d+|layers/\d+/attn)(/[qk])?"
KNOWN: dict[str, dict[str, tuple[str, str]]] = {
    # cause: (path pattern, primitive pattern), matched in full
    "dot_product_attention": {},
    "moe": {CONSTANT_TABLE: (_ATTENTION, "add|mul|sub|neg|add_any")},
    "gemma": {
        CONSTANT_TABLE: (_ATTENTION, "add|mul|sub|neg|add_any"),
        EXPLICIT_FLOAT32: (r"\(top level\)|layers/\d+", "add|mul|div|sub|tanh"),
    },
}


def _place(name_stack: str) -> str:
    """An operation's module path below the root, each module named once (an island's scope
    repeats its module's name)."""
    parts = module_path(name_stack, _MARKERS).split("/")
    for root in _ROOTS:
        if root in parts:
            parts = parts[parts.index(root) + 1 :]
    unique = [p for i, p in enumerate(parts) if p not in parts[:i]]
    return "/".join(unique) or "(top level)"


def _dtypes(program) -> dict:
    """{(place, primitive): the set of dtypes it computes in}."""
    found: dict = collections.defaultdict(set)
    for eqn in iter_equations(program):
        dtype = compute_dtype(eqn)
        if eqn.primitive.name in _MOVES or dtype is None:
            continue
        key = (_place(str(eqn.source_info.name_stack)), eqn.primitive.name)
        found[key].add(np.dtype(dtype).name)
    return found


def _losses(model: str):
    """`(policy's loss, autocast's loss, its weights for each, batch)`."""
    inputs, targets = (a[0] for a in hm.tokens(jax.random.key(1), 1))
    if model == "gemma":
        plain = hm.Gemma(hm.GemmaConfig(), nnx.Rngs(0))
        mixed = jmp.nnx.mixed_precision(hm.Gemma(hm.GemmaConfig(), nnx.Rngs(0)), POLICY)
        (graph, state), (mixed_graph, mixed_state) = nnx.split(plain), nnx.split(mixed)
        policy_loss = lambda s, i, t: hm.gemma_loss(nnx.merge(mixed_graph, s), i, t)  # noqa: E731
        auto_loss = jmp.autocast(lambda s, i, t: hm.gemma_loss(nnx.merge(graph, s), i, t), POLICY)
        return policy_loss, auto_loss, (mixed_state, state), (inputs, targets)
    module = hm.MoE() if model == "moe" else hm.DotProductAttention()
    loss = hm.moe_loss if model == "moe" else hm.dpa_loss
    params = module.init(jax.random.key(0), inputs)["params"]
    policy_loss = functools.partial(loss, jmp.linen.mixed_precision(module, POLICY).apply)
    auto_loss = jmp.autocast(functools.partial(loss, module.apply), POLICY)
    return policy_loss, auto_loss, (params, params), (inputs, targets)


def _cause(model: str, place: str, primitive: str) -> str | None:
    for cause, (where, what) in KNOWN[model].items():
        if re.fullmatch(where, place) and re.fullmatch(what, primitive):
            return cause
    return None


@pytest.mark.parametrize("model", ["gemma", "moe", "dot_product_attention"])
def test_the_policy_and_autocast_give_each_operation_the_same_dtype(model):
    policy_loss, auto_loss, (policy_weights, auto_weights), batch = _losses(model)
    differ, unexplained = collections.defaultdict(list), []
    for direction, transform in (("forward", lambda f: f), ("backward", jax.grad)):
        policy = _dtypes(jax.make_jaxpr(transform(policy_loss))(policy_weights, *batch))
        with _naming.module_names():  # NNX modules named under autocast as under the policy
            auto = _dtypes(jax.make_jaxpr(transform(auto_loss))(auto_weights, *batch))
        shared = set(policy) & set(auto)
        assert len(shared) > 40, sorted(shared)  # the places line up
        for place, primitive in sorted(shared):
            if policy[place, primitive] == auto[place, primitive]:
                continue
            seen = f"{direction} {place} {primitive}: policy {sorted(policy[place, primitive])}"
            seen += f", autocast {sorted(auto[place, primitive])}"
            cause = _cause(model, place, primitive)
            if cause is None:
                unexplained.append(seen)
            else:
                differ[cause].append(seen)
    assert unexplained == []
    assert set(differ) == set(KNOWN[model]), dict(differ)  # a cause that is gone: take it off
