"""Tests for jmp_policy.policy: construction, casting, parsing, round trips."""

import typing

import chex
import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jmp_policy as jmp

FLOATS = (jnp.float16, jnp.bfloat16, jnp.float32)
F32, F16, BF16 = np.dtype("float32"), np.dtype("float16"), np.dtype(jnp.bfloat16)


class Pair(typing.NamedTuple):
    x: typing.Any
    y: typing.Any


@chex.dataclass
class Box:
    w: typing.Any
    n: typing.Any


def test_policy_normalises_dtypes_and_is_hashable():
    a = jmp.Policy(jnp.float32, np.float16, "bfloat16")
    b = jmp.Policy("float32", jnp.float16, jnp.bfloat16)
    assert a == b and hash(a) == hash(b)
    assert a.param_dtype == F32
    assert isinstance(a.compute_dtype, np.dtype)

    f = jax.jit(lambda x, p: p.cast_to_compute(x), static_argnums=1)
    assert f(jnp.ones(2), a).dtype == F16


@pytest.mark.parametrize("bad", [jnp.int32, "int8", np.bool_, jnp.complex64])
def test_policy_rejects_non_floating(bad):
    with pytest.raises(TypeError, match=r"floating dtype .* for `compute_dtype`"):
        jmp.Policy(jnp.float32, bad, jnp.float32)


def test_policy_rejects_non_dtype():
    with pytest.raises(TypeError, match="`param_dtype`"):
        jmp.Policy(object(), jnp.float32, jnp.float32)


def test_cast_touches_only_floating_leaves():
    policy = jmp.get_policy("mixed_float16")
    key = jax.random.key(0)
    old_key = jax.random.PRNGKey(0)
    tree = {
        "f32": jnp.ones(3),
        "np": np.ones(3, np.float64),
        "i": jnp.arange(3),
        "b": jnp.array([True]),
        "key": key,
        "old_key": old_key,
        "none": None,
        "py": 1.5,
        "obj": "text",
    }
    out = policy.cast_to_compute(tree)
    assert out["f32"].dtype == F16
    assert isinstance(out["np"], np.ndarray) and out["np"].dtype == F16
    for name in ("i", "b", "key", "old_key", "py", "obj"):
        assert out[name] is tree[name], name
    assert out["none"] is None


def test_cast_through_containers():
    policy = jmp.Policy(F32, BF16, F32)
    tree = [
        flax.core.FrozenDict({"a": jnp.ones(2)}),
        Pair(jnp.ones(2), jnp.arange(2)),
        Box(w=jnp.ones(2), n=jnp.int32(1)),
    ]
    out = policy.cast_to_compute(tree)
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    assert out[0]["a"].dtype == BF16
    assert out[1].x.dtype == BF16 and out[1].y.dtype == jnp.int32
    assert out[2].w.dtype == BF16 and out[2].n.dtype == jnp.int32


def test_cast_to_same_dtype_adds_no_convert():
    policy = jmp.get_policy("float32")
    x = jnp.ones(4)
    assert policy.cast_to_compute({"x": x})["x"] is x
    jaxpr = jax.make_jaxpr(policy.cast_to_compute)({"x": x, "h": jnp.ones(2, F16)})
    converts = [e for e in jaxpr.eqns if e.primitive.name == "convert_element_type"]
    assert len(converts) == 1  # only the float16 leaf


def test_cast_shape_dtype_struct():
    policy = jmp.get_policy("mixed_bfloat16")
    spec = {
        "w": jax.ShapeDtypeStruct((2, 3), jnp.float32),
        "i": jax.ShapeDtypeStruct((2,), jnp.int32),
    }
    out = policy.cast_to_compute(spec)
    assert out["w"] == jax.ShapeDtypeStruct((2, 3), BF16)
    assert out["i"] is spec["i"]
    # An eval_shape workflow: shapes in, shapes of the cast values out.
    shapes = jax.eval_shape(policy.cast_to_compute, {"w": jnp.ones((2, 3))})
    assert shapes["w"].dtype == BF16


def test_cast_under_jit():
    policy = jmp.get_policy("p=f32,c=f16,o=f32")

    @jax.jit
    def f(params, x):
        params, x = policy.cast_to_compute((params, x))
        return policy.cast_to_output(x @ params["w"])

    out = f({"w": jnp.ones((3, 2))}, jnp.ones((4, 3)))
    assert out.dtype == F32
    chex.assert_trees_all_close(out, jnp.full((4, 2), 3.0))


def test_with_dtype_methods():
    p = jmp.get_policy("float32")
    assert p.with_param_dtype(jnp.bfloat16).param_dtype == BF16
    assert p.with_compute_dtype("float16").compute_dtype == F16
    assert p.with_output_dtype(np.float16).output_dtype == F16
    with pytest.raises(TypeError, match="`output_dtype`"):
        p.with_output_dtype(jnp.int8)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("float32", (F32, F32, F32)),
        ("f16", (F16, F16, F16)),
        ("bfloat16", (BF16, BF16, BF16)),
        ("mixed_float16", (F32, F16, F32)),
        ("mixed_bfloat16", (F32, BF16, F32)),
        ("c=f16", (F32, F16, F16)),
        ("params=float32,compute=float16,output=float32", (F32, F16, F32)),
        (" p = bf16 , c = f32 ", (BF16, F32, F32)),
        ("p=f16,c=bf16", (F16, BF16, BF16)),
        ("o=bf16", (F32, F32, BF16)),
        ("c=full", (F32, F32, F32)),
        ("c=half", (F32, jmp.half_dtype(), jmp.half_dtype())),
    ],
)
def test_get_policy(name, expected):
    p = jmp.get_policy(name)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == expected


@pytest.mark.parametrize(
    "name, error, match",
    [
        ("p=f32=x", ValueError, r"'key=dtype' pairs .* 'p=f32=x'"),
        ("compute=flaot16", ValueError, r"Unknown dtype 'flaot16'.*Did you mean 'float16'"),
        ("comptue=float16", ValueError, r"Unknown key 'comptue'.*Did you mean 'compute'"),
        (
            "compute_float16",
            ValueError,
            r"Unknown dtype or policy name.*Did you mean 'compute=float16'",
        ),
        # A preset is suggested before the pure half dtype the spelling is closest to.
        (
            "mixed-float16",
            ValueError,
            r"mixed_float16, mixed_bfloat16.*Did you mean 'mixed_float16'",
        ),
        ("mixed_fp16", ValueError, r"Did you mean 'mixed_float16'"),
        ("fp16_mixed", ValueError, r"Did you mean 'mixed_float16'"),
        ("bf16 mixed", ValueError, r"Did you mean 'mixed_bfloat16'"),
        ("float8", ValueError, r"Did you mean 'float8_e4m3fn'"),
        ("flaot32", ValueError, r"Did you mean 'float32'"),
        ("c=f16,c=f32", ValueError, "given twice"),
        ("c=int32", ValueError, "Unknown dtype 'int32'"),
        ("", ValueError, "empty"),
        ("c=f16,", ValueError, "'key=dtype' pairs"),
        (3, TypeError, "`policy_name`"),
    ],
)
def test_get_policy_bad_input(name, error, match):
    with pytest.raises(error, match=match):
        jmp.get_policy(name)


def test_str_of_numpy_dtype_policy():
    # jmp raises KeyError here.
    p = jmp.Policy(np.dtype("float32"), np.dtype("float16"), np.dtype("float32"))
    assert str(p) == "params=float32,compute=float16,output=float32"


def test_half_and_full():
    half = jmp.half_dtype()
    assert half == (BF16 if jax.default_backend() == "tpu" else F16)
    tree = {"h": jnp.ones(2, half), "f": jnp.ones(2), "i": jnp.ones(2, jnp.int16)}
    assert jmp.cast_to_full(tree)["h"].dtype == F32
    assert jmp.cast_to_full(tree)["f"] is tree["f"]
    assert jmp.cast_to_half(tree)["f"].dtype == half
    assert jmp.cast_to_half(tree)["i"] is tree["i"]


# --- property tests -----------------------------------------------------------

DTYPE_NAMES = ["full", "half", "f32", "float32", "f16", "float16", "bf16", "bfloat16"]
dtypes = st.sampled_from([F32, F16, BF16])
policies = st.builds(jmp.Policy, dtypes, dtypes, dtypes)


@settings(max_examples=60, deadline=None)
@given(policies)
def test_str_round_trips(policy):
    assert jmp.get_policy(str(policy)) == policy


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["params", "p", "compute", "c", "output", "o"]),
        st.sampled_from(DTYPE_NAMES),
        min_size=1,
        max_size=3,
    ),
    st.sampled_from(["", " "]),
)
def test_parse_grammar_defaults(pairs, space):
    canonical = {}
    for key, value in pairs.items():
        canonical.setdefault(key[0], value)
    text = ",".join(f"{space}{k}{space}={space}{v}{space}" for k, v in pairs.items())
    if len({k[0] for k in pairs}) != len(pairs):
        with pytest.raises(ValueError, match="twice"):
            jmp.get_policy(text)
        return
    policy = jmp.get_policy(text)
    names = {
        "full": F32,
        "f32": F32,
        "float32": F32,
        "f16": F16,
        "float16": F16,
        "bf16": BF16,
        "bfloat16": BF16,
        "half": jmp.half_dtype(),
    }
    p = names[canonical["p"]] if "p" in canonical else F32
    c = names[canonical["c"]] if "c" in canonical else p
    o = names[canonical["o"]] if "o" in canonical else c
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (p, c, o)


leaf_dtypes = st.sampled_from(["float16", "bfloat16", "float32", "int32", "int8", "bool", "uint32"])
leaves = st.one_of(
    st.tuples(leaf_dtypes, st.integers(0, 3), st.booleans()).map(
        lambda t: (
            np.zeros((t[1],), dtype=jnp.dtype(t[0]))
            if t[2]
            else jnp.zeros((t[1],), dtype=jnp.dtype(t[0]))
        )
    ),
    st.none(),
    st.integers(-3, 3),
    st.floats(allow_nan=False, width=32),
    st.text(max_size=3),
)
trees = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(st.text("abc", min_size=1, max_size=2), children, max_size=3),
        st.tuples(children, children).map(lambda t: Pair(*t)),
    ),
    max_leaves=8,
)


@settings(max_examples=80, deadline=None)
@given(trees, dtypes)
def test_cast_property(tree, dtype):
    out = jmp.Policy(dtype, dtype, dtype).cast_to_compute(tree)
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    for before, after in zip(jax.tree.leaves(tree), jax.tree.leaves(out), strict=True):
        if isinstance(before, (jax.Array, np.ndarray)) and jnp.issubdtype(
            before.dtype, jnp.floating
        ):
            assert after.dtype == dtype and after.shape == before.shape
            # A NumPy array stays a NumPy array, a JAX array a JAX array.
            assert isinstance(after, np.ndarray) == isinstance(before, np.ndarray)
            if before.dtype == dtype:
                assert after is before
        else:
            assert after is before


@pytest.mark.parametrize("where", ["autocast", "linen", "nnx"])
def test_a_dtype_where_a_policy_is_expected_is_explained(where):
    import flax.linen as nn
    from flax import nnx

    calls = {
        "autocast": lambda p: jmp.autocast(lambda x: x, p),
        "linen": lambda p: jmp.linen.mixed_precision(nn.Dense(2), p),
        "nnx": lambda p: jmp.nnx.mixed_precision(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), p),
    }
    with pytest.raises(TypeError, match=r"got the dtype float16.*'mixed_float16'.*'float16'"):
        calls[where](jnp.float16)
    with pytest.raises(TypeError, match=r"or a policy name for `policy`, got object"):
        calls[where](object())
    calls[where]("mixed_bfloat16")  # a name is accepted everywhere
