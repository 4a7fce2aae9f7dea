"""Block-scaled matmuls (MXFP8, NVFP4): the emulation is JAX's op, forward and backward.

JAX's `jax.nn.scaled_dot_general` runs only on GPUs: its one GPU-only piece is the cuDNN
`scaled_matmul` of already quantized operands. The reference here is JAX's own op with that one
piece replaced by its definition (dequantize each block, multiply in float32), so JAX's own
quantization, blocking and custom backward pass run on CPU and are compared with ours.
"""

import importlib.util
import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_policy.block_scaled import block_scaled_dot_general, eligible, fake_quantize
from jmp_policy.fp8 import Fp8DotGeneral

# Toy models whose last matmul is meant to multiply in float8 or a block-scaled format: the
# warning that names such a head (the logits head, by structure) is asserted in
# tests/test_float8_reports.py and where a test here asks for it.
_HEAD_IN_LOW_PRECISION = pytest.mark.filterwarnings(
    "ignore:jmp_policy. .* is the last matmul before the output:jmp_policy.errors.PrecisionWarning"
)
pytestmark = _HEAD_IN_LOW_PRECISION

reference = pytest.importorskip("jax._src.cudnn.scaled_matmul_stablehlo")
_benchmark = importlib.util.spec_from_file_location(
    "_gpu_transformer", pathlib.Path(__file__).parents[1] / "benchmarks" / "gpu_transformer.py"
)
gpu_transformer = importlib.util.module_from_spec(_benchmark)
_benchmark.loader.exec_module(gpu_transformer)
requested_block_gemms = gpu_transformer.requested_block_gemms  # what the GPU benchmark counts


def _scaled_matmul_on_cpu(lhs, rhs, lhs_scales, rhs_scales, preferred_element_type=jnp.float32):
    def dequantize(x, scales):
        block = x.shape[-1] // scales.shape[-1]
        return x.astype(jnp.float32) * jnp.repeat(scales.astype(jnp.float32), block, axis=-1)

    out = jnp.einsum(
        "bmk,bnk->bmn", dequantize(lhs, lhs_scales), dequantize(rhs, rhs_scales),
        preferred_element_type=jnp.float32,
    )  # fmt: skip
    return out.astype(preferred_element_type)


@pytest.fixture
def jax_op_on_cpu(monkeypatch):
    monkeypatch.setattr(reference, "scaled_matmul_wrapper", _scaled_matmul_on_cpu)

    configs = {mode: jax.nn.get_scaled_dot_general_config(mode) for mode in ("mxfp8", "nvfp4")}

    def op(lhs, rhs, dimension_numbers, mode):
        config = configs[mode]  # made outside any trace: NVFP4's holds an array
        return reference.scaled_dot_general_wrapper(
            lhs, rhs, dimension_numbers, jnp.float32, configs=[config] * 3
        )

    return op


CASES = [
    ((64, 96), (96, 32), (((1,), (0,)), ((), ()))),  # x @ w
    ((2, 32, 64), (2, 64, 32), (((2,), (1,)), ((0,), (0,)))),  # batched
    ((32, 64), (32, 64), (((1,), (1,)), ((), ()))),  # x @ w.T
]


@pytest.mark.parametrize("mode", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("shapes", CASES, ids=["xw", "batched", "xwT"])
def test_forward_and_gradients_are_jax_ops(jax_op_on_cpu, mode, shapes):
    lhs_shape, rhs_shape, dn = shapes
    lhs = 3.0 * jax.random.normal(jax.random.key(0), lhs_shape)
    rhs = jax.random.normal(jax.random.key(1), rhs_shape)
    exact = jax.lax.dot_general(lhs, rhs, dn)
    cotangent = jax.random.normal(jax.random.key(2), exact.shape)

    def ours(a, b):
        return block_scaled_dot_general(a, b, dn, mode=mode)

    def theirs(a, b):
        return jax_op_on_cpu(a, b, dn, mode)

    out, pullback = jax.vjp(jax.jit(ours), lhs, rhs)
    expected, expected_pullback = jax.vjp(jax.jit(theirs), lhs, rhs)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-5)
    for got, want in zip(pullback(cotangent), expected_pullback(cotangent), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-4)
    error = float(jnp.linalg.norm(out - exact) / jnp.linalg.norm(exact))
    print(f"{mode}: relative error of one matmul against float32 {error:.4f}")
    assert 0 < error < (0.06 if mode == "mxfp8" else 0.2)


def test_nvfp4_gradient_is_zero_where_the_forward_pass_clips(jax_op_on_cpu):
    """NVFP4's straight-through estimator, as JAX's op has it: values beyond what the format
    holds (global scale x 6 x 448 = 2688) get no gradient, in either operand, also for a
    weight shared under `vmap`, where the mask applies to the examples' summed gradient (so no
    weight-sized gradient is kept per example)."""
    dn = (((1,), (0,)), ((), ()))
    lhs = jax.random.normal(jax.random.key(0), (32, 64)).at[3, 5].set(4000.0)
    rhs = jax.random.normal(jax.random.key(1), (64, 16)).at[7, 2].set(-5000.0)

    def loss(dot):
        return lambda a, b: jnp.sum(dot(a, b) ** 2)

    ours = jax.jit(
        jax.grad(loss(lambda a, b: block_scaled_dot_general(a, b, dn, mode="nvfp4")), (0, 1))
    )
    theirs = jax.jit(jax.grad(loss(lambda a, b: jax_op_on_cpu(a, b, dn, "nvfp4")), (0, 1)))
    grads, expected = ours(lhs, rhs), theirs(lhs, rhs)
    for got, want in zip(grads, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-3)
    assert grads[0][3, 5] == 0 and grads[1][7, 2] == 0
    assert bool(jnp.all(grads[0].at[3, 5].set(1.0) != 0))  # only there

    def per_example(a, b):  # an Equinox layer: one example, the weight shared
        return block_scaled_dot_general(b.T, a, (((1,), (0,)), ((), ())), mode="nvfp4")

    mapped = jax.jit(jax.grad(loss(jax.vmap(per_example, in_axes=(0, None))), (0, 1)))
    weight_grad = mapped(lhs, rhs)[1]
    assert weight_grad[7, 2] == 0
    np.testing.assert_allclose(weight_grad, grads[1], rtol=1e-5, atol=1e-2)


@pytest.mark.parametrize("mode", ["mxfp8", "nvfp4"])
def test_an_equinox_weight_keeps_no_gradient_per_example(mode):
    """Under `vmap` (an Equinox MLP, 64 examples, 256 wide), the compiled train step's
    temporaries stay far below one weight gradient per example (64 x 256 x 256 x 4 bytes =
    16 MiB; the NVFP4 mask inside the matmul's backward pass once kept exactly that). XLA's
    buffer sizes are deterministic."""
    import equinox as eqx

    import jmp_policy as jmp

    x = jax.random.normal(jax.random.key(0), (64, 256))
    mlp = eqx.nn.MLP(256, 256, 256, 1, key=jax.random.key(1))
    arrays, static = eqx.partition(jmp.eqx.mixed_precision(mlp, f"mixed_{mode}"), eqx.is_array)

    def step(arrays, x):
        return jax.grad(lambda a: jnp.sum(jax.vmap(eqx.combine(a, static))(x) ** 2))(arrays)

    temp = jax.jit(step).lower(arrays, x).compile().memory_analysis().temp_size_in_bytes
    print(f"{mode}: {temp / 2**20:.2f} MiB of temporaries")
    assert temp < 64 * 256 * 256 * 4 / 8


@pytest.mark.parametrize("mode", ["mxfp8", "nvfp4"])
def test_fake_quantize_is_jax_quantization(mode):
    config = jax.nn.get_scaled_dot_general_config(mode)
    x = 5.0 * jax.random.normal(jax.random.key(3), (1, 8, 64))
    values, scales = reference.quantize(x, config)
    block = 64 // scales.shape[-1]
    expected = values.astype(jnp.float32) * jnp.repeat(scales.astype(jnp.float32), block, axis=-1)
    if mode == "nvfp4":
        expected = expected * config.global_scale
    np.testing.assert_array_equal(fake_quantize(x, (2,), mode), expected)
    assert eligible((8, 64), (1,), mode) and not eligible((8, 40), (1,), mode)


def test_bad_arguments():
    x = jnp.ones((32, 32))
    with pytest.raises(ValueError, match="`mode`"):
        block_scaled_dot_general(x, x, (((1,), (0,)), ((), ())), mode="mxfp4")
    with pytest.raises(ValueError, match="`implementation`"):
        block_scaled_dot_general(x, x, (((1,), (0,)), ((), ())), implementation="cudnn")
    with pytest.raises(ValueError, match=r"`lhs`'s contracting axes \(1,\) of shape \(4, 24\)"):
        block_scaled_dot_general(jnp.ones((4, 24)), jnp.ones((24, 32)), (((1,), (0,)), ((), ())))


# --- On a Blackwell GPU: JAX's op, with the same numbers --------------------------------------


@pytest.mark.parametrize("mode", ["mxfp8", "nvfp4"])
def test_the_gpu_path_computes_what_the_emulation_does(jax_op_on_cpu, mode):
    """`implementation="jax"` (what a Blackwell GPU runs) against the emulation: forward and
    gradients, float32 and bfloat16 operands, and under `vmap` (an Equinox layer's weight is
    unmapped: JAX's own batching of its op refuses that; the op is folded into the matmul)."""
    del jax_op_on_cpu  # JAX's GEMM of quantized operands, by its definition, on CPU
    lhs = 3.0 * jax.random.normal(jax.random.key(0), (64, 96))
    rhs = jax.random.normal(jax.random.key(1), (96, 64))

    def run(implementation):
        def dot(a, b, dn, out=jnp.float32):
            return block_scaled_dot_general(
                a, b, dn, mode=mode, preferred_element_type=out, implementation=implementation
            )

        def loss(a, b, out=jnp.float32):
            return jnp.sum(dot(a, b, (((1,), (0,)), ((), ())), out).astype(jnp.float32) ** 2)

        grads = jax.value_and_grad(loss, argnums=(0, 1))
        # Under `vmap`: the weight unmapped on either side, or both operands mapped.
        per_example = [
            jax.vmap(lambda x, w: dot(w.T, x, (((1,), (0,)), ((), ()))), in_axes=(0, None)),
            jax.vmap(lambda x, w: dot(x, w, (((0,), (0,)), ((), ()))), in_axes=(0, None)),
            jax.vmap(lambda x, w: dot(x, w, (((0,), (0,)), ((), ()))), in_axes=(0, 1)),
        ]
        mapped = [jax.grad(lambda a, b, f=f: jnp.sum(f(a, b) ** 2), (0, 1)) for f in per_example]

        @jax.jit  # one program: every case at once
        def cases(lhs, rhs):
            half = (lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16), jnp.bfloat16)
            return [grads(lhs, rhs), jax.grad(loss, (0, 1))(*half)] + [g(lhs, rhs) for g in mapped]

        return cases(lhs, rhs)

    results = jax.tree.leaves(run("jax")), jax.tree.leaves(run("emulated"))
    assert len(results[0]) == len(results[1]) == 11
    for got, want in zip(*results, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("mode", ["mxfp8", "nvfp4"])
def test_on_blackwell_the_policies_call_jax_op(monkeypatch, request, mode):
    """The program a Blackwell GPU would compile (lowered for CUDA here, on CPU, with the
    hardware check made to say yes): every block-scaled matmul of a train step is JAX's op,
    with the format's value and scale types, and the report counts them as the format."""
    import equinox as eqx
    import flax.linen as nn
    from jax import export

    import jmp_policy as jmp
    from jmp_policy import block_scaled

    assert not block_scaled.hardware_path()  # a CPU
    policy = jmp.get_policy(f"mixed_{mode}")
    x = jax.random.normal(jax.random.key(0), (32, 64))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(64)(nn.relu(nn.Dense(64)(x))))
            return nn.Dense(10, name="head")(x)

    linen = jmp.linen.mixed_precision(Net(), policy)
    variables = linen.init(jax.random.key(1), x)
    mlp = jmp.eqx.mixed_precision(eqx.nn.MLP(64, 32, 64, 1, key=jax.random.key(2)), policy)
    arrays, static = eqx.partition(mlp, eqx.is_array)

    def linen_step(variables, x):
        return jax.grad(lambda v: jnp.mean(linen.apply(v, x) ** 2))(variables)

    def eqx_step(arrays, x):
        model = lambda a: eqx.combine(a, static)  # noqa: E731
        return jax.grad(lambda a: jnp.sum(jax.vmap(model(a))(x) ** 2))(arrays)

    steps = {"linen": (linen_step, variables), "eqx": (eqx_step, arrays)}
    emulated = {
        k: jmp.precision_report(f, a, x).counts["dot_general"] for k, (f, a) in steps.items()
    }
    monkeypatch.setattr(block_scaled, "hardware_path", lambda: True)
    # Equinox's wrapper keeps one program per policy for the process: a fresh one for the GPU
    # program, and another for the tests after this one.
    jmp.eqx._call_under.cache_clear()
    request.addfinalizer(jmp.eqx._call_under.cache_clear)
    # Forward matmuls, and (MXFP8) the gradient matmuls whose contracted axes hold whole
    # blocks: Linen 2 + 2 kernel gradients + 1 input gradient (the first layer's input needs
    # none); Equinox under `vmap` 2 + 1 (a weight's gradient per example contracts nothing).
    expected = {"mxfp8": {"linen": 5, "eqx": 3}, "nvfp4": {"linen": 2, "eqx": 2}}[mode]
    types = {"mxfp8": {"f8E4M3FN", "f8E8M0FNU"}, "nvfp4": {"f4E2M1FN", "f8E4M3FN"}}[mode]
    for name, (step, params) in steps.items():
        lowered = export.export(
            jax.jit(step),
            platforms=["cuda"],
            disabled_checks=[export.DisabledSafetyCheck.custom_call("__op$block_scaled_dot")],
        )(params, x)
        module = lowered.mlir_module()
        assert requested_block_gemms(module) == expected[name], name
        operand_types = {
            t
            for line in module.splitlines()
            if "custom_call @__op$block_scaled_dot" in line
            for t in re.findall(r"tensor<[\dx]+x(f\w+)>", line.rsplit(" : ", 1)[-1])
        }
        assert operand_types == types | {"f32"}, name  # values and scales in, float32 out
        report = jmp.precision_report(step, params, x)
        # The same matmuls, counted the same way (quantization's own operations differ). The
        # report reads the traced program, before XLA drops the first layer's unused input
        # gradient: Linen's MXFP8 count is 6 there.
        assert report.counts["dot_general"] == emulated[name], name
        assert report.counts["dot_general"][mode] >= expected[name], name


# --- As policies: "mixed_mxfp8" and "mixed_nvfp4" wherever "mixed_float8" goes -----------


@pytest.mark.parametrize("mode", ["mxfp8", "nvfp4"])
def test_the_policy_names_and_their_long_form(mode):
    import jmp_policy as jmp

    policy = jmp.get_policy(f"mixed_{mode}")
    assert str(policy) == f"params=float32,compute={mode},output=float32"
    assert jmp.get_policy(str(policy)) == policy != jmp.get_policy("mixed_float8")
    with pytest.raises(ValueError, match=f"Did you mean 'mixed_{mode}'"):
        jmp.get_policy(f"{mode}_mixed_typo")


@pytest.mark.parametrize("mode", ["mxfp8", "nvfp4"])
def test_every_integration_multiplies_in_the_block_format(mode):
    import equinox as eqx
    import flax.linen as nn
    from flax import nnx

    import jmp_policy as jmp

    policy = jmp.get_policy(f"mixed_{mode}")
    x = jax.random.normal(jax.random.key(0), (32, 64))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(10, name="head")(nn.relu(nn.Dense(64)(x)))

    linen = jmp.linen.mixed_precision(Net(), policy)
    variables = linen.init(jax.random.key(1), x)
    layers = nnx.Sequential(
        nnx.Linear(64, 64, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(64, 32, rngs=nnx.Rngs(1))
    )
    model = jmp.nnx.mixed_precision(layers, policy)
    # The emulation's matmul is its format's, not a float32 matmul slipped through: the
    # integrations do not warn of it (they do of a float32 one, `tests/test_flax.py`). They
    # do warn that the last layer, the head by the program's structure, is in the format
    # (Linen's is named `head`: it stays in bfloat16).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        linen.apply(variables, x)
        model(x)
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and "layers/2 is the last matmul before the output" in said[0], said
    mlp = jmp.eqx.mixed_precision(eqx.nn.MLP(64, 32, 64, 1, key=jax.random.key(2)), policy)
    params = {"w": 0.1 * jax.random.normal(jax.random.key(3), (64, 32))}
    # The same warning for the last matmul of the NNX, Equinox and autocast functions.
    with pytest.warns(jmp.errors.PrecisionWarning, match="is the last matmul before the output"):
        reports = {
            "linen": (jmp.precision_report(linen.apply, variables, x), {mode: 1}),
            "nnx": (jmp.precision_report(lambda m, x: m(x), model, x), {mode: 2}),
            "eqx": (jmp.precision_report(jax.vmap(mlp), x), {mode: 2}),
            "autocast": (
                jmp.precision_report(jmp.autocast(lambda p, x: x @ p["w"], policy), params, x),
                {mode: 1},
            ),
        }
    for name, (report, expected) in reports.items():
        counts = report.counts["dot_general"]
        assert {k: v for k, v in counts.items() if k == mode} == expected, name
        assert report.fp8_matmul_flop_share > 0.5, name
    # The head (N = 10, `FP8_EXCLUDE`) stays in bfloat16 under Linen.
    assert reports["linen"][0].counts["dot_general"].get("bfloat16") == 1
    # The numbers are the format's: autocast's matmul is the block-scaled one.
    out = jmp.autocast(lambda p, x: x @ p["w"], policy)(params, x)
    expected = block_scaled_dot_general(
        x, params["w"], (((1,), (0,)), ((), ())), mode=mode, preferred_element_type=jnp.bfloat16
    )  # the float32 operands quantized straight to the format
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))
    grads = eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x) ** 2))(mlp)
    assert all(
        bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(eqx.filter(grads, eqx.is_array))
    )
    # Another policy takes the block-scaled matmul away again.
    assert model.model.layers[0].dot_general.fmt == mode
    model = jmp.nnx.mixed_precision(model, jmp.get_policy("mixed_bfloat16"))
    assert not isinstance(model.model.layers[0].dot_general, Fp8DotGeneral)
