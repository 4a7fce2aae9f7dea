"""Tests for jmp_policy._core.overrides: per-class and per-path policies, through Linen and NNX."""

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from models import Classifier, NNXClassifier

import jmp_policy as jmp
from jmp_policy._core.overrides import Overrides
from jmp_policy._reports.census import iter_equations

F32 = jnp.dtype("float32")
F16 = jmp.get_policy("mixed_float16")


def test_matching_rules():
    """A path beats a class on the same module; glob and regex match the whole path."""
    overrides = Overrides(
        {nn.Dense: jmp.get_policy("bfloat16"), "*/head": "float32", re.compile(r"Dense_\d"): F16},
        nn.Module,
    )
    dense = nn.Dense(2)
    assert overrides.own_policy(("Model", "head"), dense) == jmp.get_policy("float32")
    assert overrides.own_policy(("Dense_0",), dense) == F16
    assert overrides.own_policy(("Model", "Dense_0"), dense) == jmp.get_policy("bfloat16")
    assert overrides.own_policy(("Model", "LayerNorm_0"), nn.LayerNorm()) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        overrides.warn_unmatched()  # every pattern matched
        unmatched = Overrides({"x/*": F16}, nn.Module)  # constructing does not warn
    with pytest.warns(UserWarning, match="'x/\\*' matches no module path"):
        unmatched.warn_unmatched()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        unmatched.warn_unmatched()  # once


@pytest.mark.standard_promotion  # Flax's LayerNorm in bfloat16 mixes dtypes
def test_path_and_regex_overrides_linen():
    f32 = jmp.get_policy("float32")
    x = jnp.ones((2, 5, 16))
    mixed = jmp.linen.mixed_precision(
        Classifier(), jmp.get_policy("mixed_bfloat16"), {re.compile(r"Dense_\d"): f32}
    )
    variables = mixed.init(jax.random.key(0), x)
    jaxpr = jax.make_jaxpr(lambda v: mixed.apply(v, x))(variables)
    seen = []
    for eqn in iter_equations(jaxpr):
        if eqn.primitive.name == "dot_general":
            in_dense = re.search(r"Classifier/Dense_\d", str(eqn.source_info.name_stack))
            expected = F32 if in_dense else jnp.dtype(jnp.bfloat16)
            assert {v.aval.dtype for v in eqn.invars} == {expected}, eqn
            seen.append(expected)
    # Both occur: the overridden Dense layers in float32, attention in bfloat16.
    assert seen.count(F32) >= 2 and seen.count(jnp.dtype(jnp.bfloat16)) >= 4, seen
    # Without NORMS_IN_FLOAT32, LayerNorm follows the policy (its statistics in
    # float32 all the same: Flax reduces in float32 by default).


def test_nnx_path_override_and_nesting():
    model = NNXClassifier(rngs=nnx.Rngs(0))
    jmp.nnx.mixed_precision(
        model, jmp.get_policy("mixed_float16"), {"attn": jmp.get_policy("float32")}
    )
    assert model.attn.dtype == F32 and model.attn.query.dtype == F32  # inherited
    assert model.up.dtype == jnp.float16 and model.norm1.dtype == jnp.float16


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        ({3: jmp.get_policy("float32")}, TypeError, "key of `overrides`"),
        ({nn.Dense(3): jmp.get_policy("float32")}, TypeError, "key of `overrides`"),
        ({int: jmp.get_policy("float32")}, TypeError, "key of `overrides`"),
        # A name is a policy too; a dtype is explained.
        ({"head": jnp.float32}, TypeError, r"Policy .* for `overrides\['head'\]`, got the dtype"),
        ([], TypeError, "mapping"),
    ],
)
def test_bad_overrides(overrides, error, match):
    with pytest.raises(error, match=match):
        jmp.linen.mixed_precision(Classifier(), jmp.get_policy("mixed_float16"), overrides)
    with pytest.raises(error, match=match):
        jmp.nnx.mixed_precision(
            NNXClassifier(rngs=nnx.Rngs(0)), jmp.get_policy("mixed_float16"), overrides
        )


def test_unmatched_pattern_warns():
    mixed = jmp.linen.mixed_precision(
        Classifier(), jmp.get_policy("mixed_float16"), {"*/nothing": jmp.get_policy("float32")}
    )
    with pytest.warns(UserWarning, match="'\\*/nothing' matches no module"):
        mixed.init(jax.random.key(0), jnp.ones((1, 3, 16)))
    with pytest.warns(UserWarning, match="'decoder' matches no module"):
        jmp.nnx.mixed_precision(
            NNXClassifier(rngs=nnx.Rngs(0)),
            jmp.get_policy("mixed_float16"),
            {"decoder": jmp.get_policy("float32")},
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jmp.linen.mixed_precision(
            Classifier(), jmp.get_policy("mixed_float16"), {"head": jmp.get_policy("float32")}
        ).init(jax.random.key(0), jnp.ones((1, 3, 16)))
