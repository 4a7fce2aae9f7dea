"""What crosses the wire in which dtype (issue 37): `jmp_policy.matmul` and its use by the
Flax integrations and autocast, down to the collectives of compiled multi-device steps."""

import json
import pathlib
import subprocess
import sys

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from forced_devices import env_with_devices
from jax import lax

import jmp_policy as jmp
from jmp_policy._core.compat import jaxprs_in_params

ROOT = pathlib.Path(__file__).resolve().parents[1]
WIDTH, CLASSES, DEPTH = 256, 8, 5  # benchmarks/bench_collectives.py's MLP
DENSE = (((1,), (0,)), ((), ()))


def _values(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape).astype(dtype)


def test_weight_gradient_is_accumulated_in_float32_from_half_operands():
    x, w, g = _values(0, (64, 32), jnp.float16), _values(1, (32, 16)), _values(2, (64, 16))
    g = (g * 2.0**12).astype(jnp.float16)  # a scaled gradient: its float16 sum overflows
    dot = jmp.matmul.dot_general(jnp.float16)
    y, pullback = jax.vjp(lambda x, w: dot(x, w, DENSE), x, w)
    dx, dw = jax.jit(pullback)(g)
    assert y.dtype == jnp.float16 and dx.dtype == jnp.float16 and dw.dtype == jnp.float32
    # The sum over the batch of float16 products, accumulated in float32 (no float16 rounding
    # of the result, which here exceeds float16's range).
    exact = np.asarray(x, np.float64).T @ np.asarray(g, np.float64)
    assert np.abs(exact).max() > 65504
    np.testing.assert_allclose(np.asarray(dw), exact, rtol=1e-5, atol=1e-6 * np.abs(exact).max())
    # The activation gradient is the usual half-precision one.
    w16 = w.astype(jnp.float16)
    np.testing.assert_array_equal(dx, lax.dot_general(g, w16, (((1,), (1,)), ((), ()))))
    # Without the op (the weight cast before the matmul) the same gradient overflows.
    _, plain = jax.vjp(lambda w: lax.dot_general(x, w.astype(jnp.float16), DENSE), w)
    assert not np.isfinite(np.asarray(plain(g)[0])).all()


def test_the_weight_is_cast_inside_and_its_gradient_never_passes_through_half():
    x, w = _values(0, (8, 4), jnp.bfloat16), _values(1, (4, 3))
    dot = jmp.matmul.dot_general(jnp.bfloat16)
    jaxpr = jax.make_jaxpr(jax.grad(lambda w: dot(x, w, DENSE).astype(jnp.float32).sum()))(w)
    text = str(jaxpr)
    # The weight-gradient matmul writes float32; no convert to bfloat16 follows it.
    assert "preferred_element_type=float32" in text
    last = jaxpr.jaxpr.eqns[-1]
    assert last.outvars[0].aval.dtype == jnp.float32
    assert last.primitive.name != "convert_element_type"


def test_conv_and_batched_dimension_numbers():
    images, kernel = _values(0, (2, 3, 8, 8), jnp.float16), _values(1, (4, 3, 3, 3))
    conv = jmp.matmul.conv_general_dilated(jnp.float16)

    def loss(kernel):
        return conv(images, kernel, (1, 1), "SAME").astype(jnp.float32).sum()

    grad = jax.jit(jax.grad(loss))(kernel)
    reference = jax.grad(  # float32 math on the same float16 values
        lambda k: lax.conv_general_dilated(images.astype(jnp.float32), k, (1, 1), "SAME").sum()
    )(kernel.astype(jnp.float16).astype(jnp.float32))
    assert grad.dtype == jnp.float32
    np.testing.assert_allclose(grad, reference, rtol=1e-5)
    # Batch dimensions (attention-like): both operands' gradients in their own dtype.
    q, k = _values(2, (2, 5, 4), jnp.float16), _values(3, (2, 6, 4))
    dims = (((2,), (2,)), ((0,), (0,)))
    dot = jmp.matmul.dot_general(jnp.float16)
    dq, dk = jax.grad(lambda q, k: dot(q, k, dims).astype(jnp.float32).sum(), (0, 1))(q, k)
    assert (dq.dtype, dk.dtype) == (jnp.float16, jnp.float32)
    np.testing.assert_allclose(
        dk, jnp.einsum("bqd,bqk->bkd", q.astype(jnp.float32), jnp.ones((2, 5, 6))), rtol=1e-3
    )


def test_bad_dtypes_are_refused_at_construction():
    with pytest.raises(ValueError, match="`reduce_dtype`"):
        jmp.linen.mixed_precision(nn.Dense(2), "mixed_float16", reduce_dtype="bfloat16")
    with pytest.raises(TypeError, match="`accumulate_dtype`"):
        jmp.autocast(lambda x: x, "mixed_float16", accumulate_dtype="int32")
    with pytest.raises(TypeError, match="`compute_dtype`"):
        jmp.matmul.dot_general("int8")


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(16, dtype=jnp.float32)(x))  # as Flax's examples write it
        x = nn.Conv(8, (3,))(x[:, :, None])[:, :, 0]
        return nn.Dense(4)(x)


class _NnxMlp(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(8, 16, dtype=jnp.float32, rngs=rngs)
        self.conv = nnx.Conv(1, 8, (3,), rngs=rngs)
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.dense(x))
        return self.head(self.conv(x[:, :, None])[:, :, 0])


def _integrations(policy, **options):
    """{name: (params, apply)} for the same kind of model under each integration."""
    x = jnp.ones((4, 8))
    linen = _Mlp()
    params = linen.init(jax.random.key(0), x)["params"]
    mixed = jmp.linen.mixed_precision(linen, policy, **options)
    cast = jmp.autocast(linen.apply, policy, **options)
    model = jmp.nnx.mixed_precision(_NnxMlp(nnx.Rngs(0)), policy, **options)
    graphdef, state = nnx.split(model)
    return {
        "linen": (params, lambda p, x: mixed.apply({"params": p}, x)),
        "autocast": (params, lambda p, x: cast({"params": p}, x)),
        "nnx": (state, lambda s, x: nnx.merge(graphdef, s)(x)),
    }


def _matmul_outputs(apply, params, x):
    """[(output dtype, lhs dtype)] of every matmul and conv in `apply`'s program."""

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
                yield eqn.outvars[0].aval.dtype, eqn.invars[0].aval.dtype
            for inner in jaxprs_in_params(eqn.params):
                yield from walk(getattr(inner, "jaxpr", inner))

    return list(walk(jax.make_jaxpr(apply)(params, x).jaxpr))


@pytest.mark.parametrize("name", ["linen", "nnx", "autocast"])
def test_gradients_are_float32_and_match_the_reference_in_every_integration(name):
    params, apply = _integrations("mixed_float16")[name]
    _, plain = _integrations("mixed_float16", reduce_dtype=None)[name]
    x = _values(5, (4, 8))

    def loss(apply, p):
        return (apply(p, x).astype(jnp.float32) ** 2).sum()

    grads = jax.jit(jax.grad(lambda p: loss(apply, p)))(params)
    reference = jax.jit(jax.grad(lambda p: loss(plain, p)))(params)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {np.dtype(np.float32)}
    # The same math; the reference rounds each weight gradient to float16 once.
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-3)
    # Every matmul and conv still multiplies half-precision operands.
    backward = _matmul_outputs(lambda p, x: jax.grad(lambda p: loss(apply, p))(p), params, x)
    inputs = {str(i) for _, i in backward}
    assert inputs and inputs <= {"float16", "float32"} and "float16" in inputs


@pytest.mark.parametrize("name", ["linen", "nnx", "autocast"])
def test_accumulate_dtype_returns_float32_sums_in_every_integration(name):
    params, apply = _integrations("mixed_float16", accumulate_dtype="float32")[name]
    _, half = _integrations("mixed_float16")[name]
    x = _values(5, (4, 8))
    forward = _matmul_outputs(apply, params, x)
    assert forward and all(str(out) == "float32" for out, _ in forward)
    assert all(str(out) == "float16" for out, _ in _matmul_outputs(half, params, x))
    assert all(str(inp) == "float16" for _, inp in forward)  # operands still half
    grads = jax.grad(lambda p: apply(p, x).astype(jnp.float32).sum())(params)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {np.dtype(np.float32)}


def test_linen_under_nn_scan_casts_each_layer_inside_the_loop():
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return nn.relu(nn.Dense(32)(x)), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            scan = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=6)  # fmt: skip
            return scan()(x, None)[0]

    x = jnp.ones((2, 32))
    mixed = jmp.linen.mixed_precision(Stack(), "mixed_float16")
    params = mixed.init(jax.random.key(0), x)["params"]
    jaxpr = jax.make_jaxpr(lambda p: mixed.apply({"params": p}, x))(params).jaxpr
    # The model runs in its `cast_at_use` region (the float32 list in its own code).
    (region,) = [e for e in jaxpr.eqns if e.primitive.name == "jit"]
    body = region.params["jaxpr"].jaxpr
    # No half copy of the stacked (6, 32, 32) kernel is made before the loop: each layer's
    # kernel is cast where it is used, inside the scan.
    outer = [e for e in body.eqns if e.primitive.name == "convert_element_type"]
    assert not [e for e in outer if e.invars[0].aval.shape[:1] == (6,)], outer
    assert "scan" in {e.primitive.name for e in body.eqns}


def _collectives(devices, *flags):
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_collectives.py"), "--json", "-", *flags],
        capture_output=True, text=True, env=env_with_devices(devices), timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    print(out.stdout.split("\n\n", 1)[-1][-6000:])
    return json.loads(out.stdout.split("\n", 1)[0])


def _kinds(found):
    return {(kind, dtype) for kind, dtype, _ in found}


@pytest.mark.slow  # a run of bench_collectives.py (27 s): .ci/run's slow lane
def test_gradients_cross_the_wire_in_float32_on_4_devices():
    # One run of the benchmark (its compiles are most of the time), two checks of its rows:
    # the dtypes of every collective, then the bytes. The float32 and hand-cast rows are
    # compared with under FSDP only.
    rows = _collectives(4, "--baselines", "fsdp")
    _check_dtypes_on_the_wire(rows)
    _check_bytes_against_float32_and_a_bfloat16_cast(rows)


def _check_dtypes_on_the_wire(rows):
    for row in rows:
        half = row["policy"] != "float32" and row["integration"] not in ("float32", "cast_bf16")
        if not half:
            continue
        compute = "f16" if row["policy"] == "mixed_float16" else "bf16"
        spmd = row["partitioned"]
        reduces = [c for c in spmd if c[0] in ("all-reduce", "reduce-scatter")]
        gathers = [c for c in spmd if c[0] == "all-gather"]
        where = f"{row['layout']} {row['integration']} {row['policy']} {row['reduce_dtype']}"
        if row["reduce_dtype"] == "float32" or row["layout"] == "shard_map":
            # Every gradient sum (and the finite check's) in float32: 10 weights and biases.
            assert reduces and {c[1] for c in reduces} == {"f32"}, where
            grads = [c for c in reduces if c[2] != [1]]
            assert len(grads) == 10, where
        else:  # reduce_dtype=None: the 5 kernels' gradients in the compute dtype
            kernels = [c for c in reduces if len(c[2]) == 2]
            assert len(kernels) == 5 and {c[1] for c in kernels} == {compute}, where
        kernels = [c for c in gathers if c[2] in ([WIDTH, WIDTH], [WIDTH, CLASSES])]
        if row["layout"] == "fsdp":
            # Every sharded kernel gathered in the compute dtype (forward, and again for the
            # backward pass). XLA may also gather a batch-sized activation gradient; on XLA:CPU
            # a bfloat16 one is widened (jmp_policy.matmul._runnable), so only kernels count.
            assert len(kernels) >= DEPTH and {c[1] for c in kernels} == {compute}, where
        else:
            assert not gathers, where


def _check_bytes_against_float32_and_a_bfloat16_cast(rows):
    by = {(r["layout"], r["integration"], r["policy"], r["reduce_dtype"]): r for r in rows}
    f32 = by[("fsdp", "float32", "float32", "float32")]["partitioned_bytes"]
    cast = by[("fsdp", "cast_bf16", "float32", "float32")]["partitioned_bytes"]
    assert cast * 2 == f32  # everything in bfloat16
    for name in ("linen", "linen_own", "nnx", "autocast"):
        ours = by[("fsdp", name, "mixed_bfloat16", "float32")]["partitioned_bytes"]
        lean = by[("fsdp", name, "mixed_bfloat16", None)]["partitioned_bytes"]
        # Gathers in bfloat16, gradients in float32: between the two; with reduce_dtype=None
        # as lean as the cast (autocast keeps the bias adds, and so their sums, in float32).
        assert cast < ours < f32 and cast <= lean < ours, name
    # XLA:CPU carries bfloat16 collectives in float32 after partitioning: the compiled
    # program shows it, which is why the partitioned program is the one checked.
    cpu = by[("fsdp", "linen", "mixed_bfloat16", "float32")]["hlo"]
    assert {c[1] for c in cpu if c[0] == "all-gather"} == {"f32"}


@pytest.mark.slow  # the 4-device test's layouts again (20 s): .ci/run's slow lane
def test_gradients_cross_the_wire_in_float32_on_8_devices():
    # Every layout again, with 8 devices (32 rows of each kernel per device under FSDP).
    rows = _collectives(8, "--reduce-dtypes", "float32", "--baselines", "none")
    for row in rows:
        if row["integration"] in ("float32", "cast_bf16"):
            continue
        reduces = [c for c in row["partitioned"] if c[0] in ("all-reduce", "reduce-scatter")]
        assert {c[1] for c in reduces} == {"f32"}, row["integration"]
        kernels = {
            c[1]
            for c in row["partitioned"]
            if c[0] == "all-gather" and c[2] in ([WIDTH, WIDTH], [WIDTH, CLASSES])
        }
        compute = {"mixed_float16": "f16", "mixed_bfloat16": "bf16"}[row["policy"]]
        expected = {compute} if row["layout"] == "fsdp" else set()
        assert kernels == expected, (row["layout"], row["integration"])


def test_nnx_einsum_weight_gradient_is_made_in_float32():
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.proj = nnx.Einsum("btd,dnh->btnh", (16, 2, 8), (2, 8), rngs=rngs)

        def __call__(self, x):
            return self.proj(x)

    model = jmp.nnx.mixed_precision(Model(nnx.Rngs(0)), "mixed_float16")
    graphdef, state = nnx.split(model)
    x = _values(9, (2, 3, 16))

    def loss(state, x):
        return nnx.merge(graphdef, state)(x).astype(jnp.float32).sum()

    dots = _matmul_outputs(lambda s, x: jax.grad(loss)(s, x), state, x)
    print(dots)
    # Forward and activation gradient in float16; the kernel's gradient comes out in float32.
    assert [str(out) for out, _ in dots] == ["float16", "float16", "float32"]
    assert {str(lhs) for _, lhs in dots} == {"float16"}
    grads = jax.jit(jax.grad(loss))(state, x)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {np.dtype(np.float32)}


class _OwnWeight(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.lecun_normal(), (x.shape[-1], 16))
        return x @ w + self.param("b", nn.initializers.zeros, (16,))


class _LinenWithoutHooks(nn.Module):
    """Layers whose matmul Flax gives no hook for: Einsum, ConvTranspose, one's own; and
    a BatchNorm, so `apply` returns updated statistics too."""

    @nn.compact
    def __call__(self, x):
        h = nn.Einsum((16, 2, 8), "bd,dnh->bnh")(x).reshape(x.shape[0], 16)
        h = nn.relu(_OwnWeight()(nn.BatchNorm(use_running_average=False)(h)))
        h = nn.ConvTranspose(3, (3, 3))(h.reshape(x.shape[0], 4, 4, 1))
        return h.mean((1, 2, 3))


@pytest.mark.parametrize("reduce_dtype", ["float32", None])
def test_linen_einsum_conv_transpose_and_own_weights_make_float32_gradients(reduce_dtype):
    x = _values(3, (4, 16))
    mixed = jmp.linen.mixed_precision(
        _LinenWithoutHooks(), "mixed_float16", reduce_dtype=reduce_dtype
    )
    variables = mixed.init(jax.random.key(0), x)
    params, stats = variables["params"], variables["batch_stats"]

    def loss(params, x):
        out, updated = mixed.apply(
            {"params": params, "batch_stats": stats}, x, mutable=["batch_stats"]
        )
        assert jax.tree.map(lambda a: a.dtype, updated["batch_stats"]) == jax.tree.map(
            lambda a: a.dtype, stats
        )
        return out.astype(jnp.float32).sum()

    dots = _matmul_outputs(jax.grad(loss), params, x)
    print(dots)
    # Forward: einsum, matmul, conv in float16. Backward: each weight's gradient (Einsum's
    # kernel, the own matmul's w, ConvTranspose's kernel) out of its matmul in float32
    # (float16 with reduce_dtype=None); activation gradients in float16.
    assert {str(lhs) for _, lhs in dots} == {"float16"}
    outs = sorted(str(out) for out, _ in dots)
    weights = 3 if reduce_dtype else 0
    assert outs.count("float32") == weights and outs.count("float16") == len(dots) - weights
    grads = jax.jit(jax.grad(loss))(params, x)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {np.dtype(np.float32)}
    # The forward pass is the one without the rewrite, bit for bit.
    variables = {"params": params, "batch_stats": stats}
    plain = jmp.linen.mixed_precision(_LinenWithoutHooks(), "mixed_float16", reduce_dtype=None)
    forward = jax.jit(lambda m: m.apply(variables, x, mutable=["batch_stats"]), static_argnums=0)
    chex.assert_trees_all_equal(forward(mixed), forward(plain))

    # The same gradients as float32's, to float16's rounding of the forward pass.
    def reference(params, x):
        out, _ = _LinenWithoutHooks().apply(
            {"params": params, "batch_stats": stats}, x, mutable=["batch_stats"]
        )
        return out.sum()

    reference = jax.grad(reference)
    for got, want in zip(
        jax.tree.leaves(grads), jax.tree.leaves(reference(params, x)), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-3)


class _NnxWithConvTranspose(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.BatchNorm(1, rngs=rngs)
        self.up = nnx.ConvTranspose(1, 3, (3, 3), rngs=rngs)

    def __call__(self, x):
        return self.up(self.norm(x)).mean((1, 2, 3))


@pytest.mark.parametrize("reduce_dtype", ["float32", None])
def test_nnx_conv_transpose_makes_float32_gradients_and_keeps_its_state(reduce_dtype):
    x = _values(4, (4, 4, 4, 1))

    def mixed(reduce_dtype):
        model = _NnxWithConvTranspose(nnx.Rngs(0))
        return jmp.nnx.mixed_precision(model, "mixed_float16", reduce_dtype=reduce_dtype)

    model = mixed(reduce_dtype)
    graphdef, state = nnx.split(model)

    def loss(state, x):
        return nnx.merge(graphdef, state)(x).astype(jnp.float32).sum()

    dots = _matmul_outputs(jax.grad(loss), state, x)
    print(dots)
    # Forward and input gradient in float16; the kernel's gradient in float32 (float16 with
    # reduce_dtype=None).
    assert [str(out) for out, _ in dots] == [
        "float16",
        "float16",
        "float32" if reduce_dtype else "float16",
    ]
    # Called in place, as a user does: the same output as without the rewrite, bit for bit,
    # and the batch statistics it updates, in float32.
    plain = mixed(None)
    out = nnx.jit(lambda m, x: m(x))(model, x)
    chex.assert_trees_all_equal(out, nnx.jit(lambda m, x: m(x))(plain, x))
    chex.assert_trees_all_equal(nnx.state(model, nnx.BatchStat), nnx.state(plain, nnx.BatchStat))
    assert float(jnp.abs(model.model.norm.mean[...]).max()) > 0
    assert model.model.norm.mean[...].dtype == jnp.float32
    grads = nnx.grad(lambda m, x: m(x).astype(jnp.float32).sum())(model, x)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {np.dtype(np.float32)}


class _EinsumBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.relu(nn.Einsum((16, 16), "bd,df->bf")(x)), None


class _OwnBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.relu(_OwnWeight()(x)), None


@pytest.mark.parametrize("layer", ["einsum", "own"])
@pytest.mark.parametrize("remat", [False, True])
def test_linen_under_nn_scan_makes_float32_gradients_layer_by_layer(layer, remat):
    # Einsum's stacked kernels enter the loop in float32 and each layer's is cast inside it;
    # an own layer's are cast before the loop and followed into it with their float32
    # weights. Either way each layer's gradient comes out of its backward matmul in float32.
    block = {"einsum": _EinsumBlock, "own": _OwnBlock}[layer]
    block = nn.remat(block) if remat else block
    scanned = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return scanned()(x, None)[0].sum(-1)

    x = _values(5, (4, 16))
    mixed = jmp.linen.mixed_precision(Model(), "mixed_float16")
    params = mixed.init(jax.random.key(0), x)["params"]

    def loss(params, x):
        return mixed.apply({"params": params}, x).astype(jnp.float32).sum()

    dots = _matmul_outputs(jax.grad(loss), params, x)
    print(dots)
    # Forward (and its recomputation under remat) and activation gradients in float16; the
    # kernel's and the bias's gradients in float32, one kernel matmul in the loop body.
    assert {str(lhs) for _, lhs in dots} == {"float16"}
    assert [str(out) for out, _ in dots].count("float32") == 1
    grads = jax.jit(jax.grad(loss))(params, x)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {np.dtype(np.float32)}
    assert jax.tree.leaves(grads)[0].shape[0] == 3  # stacked: one kernel a layer
