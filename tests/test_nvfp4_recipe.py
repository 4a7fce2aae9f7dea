"""NVFP4's training recipe for one linear layer (`jmp_policy.nvfp4`, issue 74): each of the three
GEMMs against a NumPy reference of the format (ml_dtypes' float4_e2m1fn and float8_e4m3fn), bit for
bit where a GEMM contracts one block (its float32 sum is then exact in any order); stochastic
rounding unbiased over many keys and the same for one key; each part of the recipe switchable;
the CUDA program of a train step multiplying NVFP4 in all three GEMMs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import export

from jmp_policy import nvfp4

E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def _np_stochastic(v: np.ndarray, u: np.ndarray) -> np.ndarray:
    """The neighbours of |v| on the e2m1 grid, found by search; up where u < the fraction."""
    a = np.minimum(np.abs(v), 6.0)
    hi_index = np.clip(np.searchsorted(E2M1_GRID, a, side="right"), 1, len(E2M1_GRID) - 1)
    lo, hi = E2M1_GRID[hi_index - 1], E2M1_GRID[hi_index]
    on_grid = a == lo
    up = ~on_grid & (u < (a - lo) / (hi - lo))
    return (np.sign(v) * np.where(up, hi, lo)).astype(np.float32)


def np_quantize(a: np.ndarray, tiles: bool = False, u: np.ndarray | None = None):
    """The recipe's NVFP4 quantization along the last axis, in NumPy: dequantized values."""
    a = np.asarray(a, np.float32)
    rows, cols = a.shape
    amax = np.float32(np.abs(a).max())
    encode = np.float32(6.0 * 448.0) / amax if amax > 0 else np.float32(1.0)
    if tiles:
        tile = np.abs(a).reshape(rows // 16, 16, cols // 16, 16).max(axis=(1, 3))
        block = np.repeat(tile, 16, axis=0)
    else:
        block = np.abs(a).reshape(rows, cols // 16, 16).max(axis=-1)
    scale = np.minimum(block / np.float32(6.0) * encode, np.float32(448.0))
    scale = scale.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    per_value = np.repeat(scale, 16, axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(per_value == 0, 0.0, a * encode / per_value).astype(np.float32)
    scaled = np.clip(scaled, -6.0, 6.0)
    if u is None:
        values = scaled.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    else:
        values = _np_stochastic(scaled, u)
    return values * per_value, encode


def np_gemm(lhs, rhs) -> np.ndarray:
    """`lhs @ rhs.T` of two np_quantize results, times the reciprocal of the tensor scales'
    product."""
    (lv, le), (rv, re_) = lhs, rhs
    return (lv @ rv.T) * (np.float32(1.0) / np.float32(le * re_))


def _case(tokens: int, k: int, m: int, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(keys[0], (tokens, k)) * jnp.exp(jax.random.normal(keys[1], (tokens, 1)))
    w = jax.random.normal(keys[2], (k, m)) * 0.1
    g = jax.random.normal(keys[3], (tokens, m)) * 1e-3
    return x, w, g


FULL = nvfp4.Recipe()


@functools.partial(jax.jit, static_argnums=4)
def _grads(x, w, g, key, recipe=FULL):
    out, pull = jax.vjp(lambda x, w: nvfp4.nvfp4_matmul(x, w, key, recipe=recipe), x, w)
    return (out, *pull(g))


@pytest.mark.parametrize("tiles", [True, False], ids=["tiles", "rows"])
@pytest.mark.parametrize("stochastic", [True, False], ids=["stochastic", "nearest"])
def test_each_gemm_is_the_numpy_reference_bit_for_bit(tiles, stochastic):
    """16 tokens, K = M = 16: each GEMM contracts one block, so its sum is exact and the
    program's is the reference's to the bit."""
    x, w, g = _case(16, 16, 16)
    key = jax.random.key(7)
    recipe = nvfp4.Recipe(stochastic_rounding=stochastic, weight_tiles=tiles)
    out, dx, dw = _grads(x, w, g, key, recipe)
    x_, w_, g_ = (np.asarray(a) for a in (x, w, g))
    sign_key, data_key, weight_key, _ = nvfp4._keys(key)
    draw = lambda k, shape: np.asarray(jax.random.uniform(k, shape)) if stochastic else None  # noqa: E731

    weight = np_quantize(w_.T, tiles)  # (M, K), along K
    np.testing.assert_array_equal(np.asarray(out), np_gemm(np_quantize(x_), weight))

    weight_m = np_quantize(w_, tiles)  # (K, M), along M: with tiles, the forward's values
    if tiles:
        np.testing.assert_array_equal(weight_m[0], weight[0].T)
    expected_dx = np_gemm(np_quantize(g_, u=draw(data_key, g_.shape)), weight_m)
    np.testing.assert_array_equal(np.asarray(dx), expected_dx)

    h = np.asarray(nvfp4.hadamard_matrix(nvfp4.random_signs(sign_key)))
    xt = np.asarray(nvfp4.hadamard_rows(x, nvfp4.random_signs(sign_key))).T
    gt = np.asarray(nvfp4.hadamard_rows(g, nvfp4.random_signs(sign_key))).T
    np.testing.assert_allclose(xt.T, h.T @ x_, rtol=1e-5, atol=1e-6)  # the transform itself
    expected_dw = np_gemm(np_quantize(xt), np_quantize(gt, u=draw(weight_key, gt.shape)))
    np.testing.assert_array_equal(np.asarray(dw), expected_dw)


def test_the_hardware_path_through_jaxs_op_is_the_emulation_bit_for_bit(monkeypatch):
    """`implementation="jax"` (what a Blackwell GPU runs: `jax.nn.scaled_matmul` of the quantized
    values and scales) with JAX's cuDNN kernel replaced by its definition (each value times its
    block's scale, a float32 dot), on CPU: the emulation's three GEMMs to the bit (one block per
    contraction), so the values, the scales' layout and the transposes given to JAX's op are
    the emulation's."""
    functions = pytest.importorskip("jax._src.nn.functions")
    if not hasattr(functions, "cudnn_scaled_matmul"):
        pytest.skip("this JAX names its cuDNN scaled matmul otherwise")

    def on_cpu(a, b, a_scales, b_scales, preferred_element_type=jnp.float32):
        def dequantize(x, scales):
            return x.astype(jnp.float32) * jnp.repeat(scales.astype(jnp.float32), 16, axis=-1)

        out = jnp.einsum("bmk,bnk->bmn", dequantize(a, a_scales), dequantize(b, b_scales))
        return out.astype(preferred_element_type)

    monkeypatch.setattr(functions, "cudnn_scaled_matmul", on_cpu)
    x, w, g = _case(16, 16, 16)
    key = jax.random.key(3)
    # Each side compiled as one program (`jax.jit`): eagerly, each of the recipe's operations
    # compiled on its own (431 compiles, 7.2 s of this test's; 4.0 s jitted).
    for recipe in (FULL, nvfp4.Recipe(weight_tiles=False, hadamard=False)):

        @functools.partial(jax.jit, static_argnums=0)
        def grads(implementation, recipe=recipe):
            def f(x, w):
                return nvfp4.nvfp4_matmul(x, w, key, recipe=recipe, implementation=implementation)

            out, pull = jax.vjp(f, x, w)
            return (out, *pull(g))

        jax.tree.map(np.testing.assert_array_equal, grads("jax"), grads("emulated"))

    # Under `vmap` (JAX's own batching of its op wants all four arguments mapped): the inputs
    # mapped and the weight shared (an Equinox layer per example), the weight mapped alone, both.
    xs = jnp.stack([x, 2 * x, -x])
    ws = jnp.stack([w, w[::-1], 0.5 * w])
    for axes, args in (((0, None), (xs, w)), ((None, 0), (x, ws)), ((0, 0), (xs, ws))):

        @functools.partial(jax.jit, static_argnums=0)
        def batched(implementation, axes=axes, args=args):
            def f(x, w):
                out = nvfp4.nvfp4_matmul(x, w, key, implementation=implementation)
                return jnp.sum(out * g)

            return jax.vmap(jax.value_and_grad(f, argnums=(0, 1)), in_axes=axes)(*args)

        jax.tree.map(np.testing.assert_array_equal, batched("jax"), batched("emulated"))


def test_many_blocks_match_the_reference_to_float32_rounding():
    """Several blocks per contraction (and a 3-D input): the same quantized operands, their
    products exact; only the order of the float32 sum can differ from the reference."""
    x, w, g = _case(64, 48, 32, seed=1)
    key = jax.random.key(3)
    out, dx, dw = _grads(x.reshape(4, 16, 48), w, g.reshape(4, 16, 32), key)
    x_, w_, g_ = (np.asarray(a) for a in (x, w, g))
    sign_key, data_key, weight_key, _ = nvfp4._keys(key)
    signs = nvfp4.random_signs(sign_key)
    expected = [
        np_gemm(np_quantize(x_), np_quantize(w_.T, True)),
        np_gemm(
            np_quantize(g_, u=np.asarray(jax.random.uniform(data_key, g_.shape))),
            np_quantize(w_, True),
        ),  # fmt: skip
        np_gemm(
            np_quantize(np.asarray(nvfp4.hadamard_rows(x, signs)).T),
            np_quantize(
                np.asarray(nvfp4.hadamard_rows(g, signs)).T,
                u=np.asarray(jax.random.uniform(weight_key, (32, 64))),
            ),
        ),
    ]
    for got, want in zip((out.reshape(64, 32), dx.reshape(64, 48), dw), expected, strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=2e-6 * np.abs(want).max())


def test_stochastic_rounding_is_unbiased_and_reproducible():
    v = jax.random.uniform(jax.random.key(0), (256,), minval=-6.0, maxval=6.0)
    draws = jax.jit(
        jax.vmap(lambda k: nvfp4.e2m1_stochastic_round(v, jax.random.uniform(k, v.shape)))
    )(jax.random.split(jax.random.key(1), 4000)).astype(jnp.float32)
    # Each value's rounding is a draw between neighbours at most 2 apart: the mean of 4000 has
    # a standard deviation of at most 1/sqrt(4000) = 0.016.
    error = np.abs(np.asarray(draws.mean(axis=0) - v))
    assert error.max() < 5 * 0.016, error.max()
    assert np.abs(np.asarray(draws.mean() - v.mean())) < 0.005
    x, w, g = _case(32, 32, 16)
    first = _grads(x, w, g, jax.random.key(5))
    again = _grads(x, w, g, jax.random.key(5))
    other = _grads(x, w, g, jax.random.key(6))
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(first[0]), np.asarray(other[0]))  # forward: nearest
    assert not np.array_equal(np.asarray(first[2]), np.asarray(other[2]))  # draws of another key


def test_the_hadamard_transform_is_orthogonal_and_keeps_the_weight_gradient_unbiased():
    h = nvfp4.hadamard_matrix(nvfp4.random_signs(jax.random.key(0)))
    np.testing.assert_allclose(np.asarray(h @ h.T), np.eye(16), atol=1e-6)
    x, w, g = _case(64, 32, 16, seed=2)
    exact = np.asarray(x.T @ g)
    dws = jax.jit(jax.vmap(lambda k: _grads(x, w, g, k)[2]))(
        jax.random.split(jax.random.key(4), 64)
    )
    mean = np.asarray(dws.mean(axis=0))
    one = np.asarray(dws[0])
    # The mean over keys approaches the exact product: stochastic rounding and random signs
    # average out, rounding to nearest in x would not.
    error_one = np.linalg.norm(one - exact) / np.linalg.norm(exact)
    error_mean = np.linalg.norm(mean - exact) / np.linalg.norm(exact)
    assert error_mean < 0.5 * error_one, (error_mean, error_one)


def test_each_part_switches_off():
    x, w, g = _case(32, 32, 32)
    key = jax.random.key(0)
    full = _grads(x, w, g, key)
    exact_dx, exact_dw = g @ w.T, x.T @ g
    forward_only = _grads(x, w, g, key, nvfp4.FORWARD_ONLY)
    np.testing.assert_array_equal(np.asarray(forward_only[0]), np.asarray(full[0]))
    for got, exact in ((forward_only[1], exact_dx), (forward_only[2], exact_dw)):
        # float32 gradients, summed in another order
        scale = float(jnp.abs(exact).max())
        np.testing.assert_allclose(np.asarray(got), np.asarray(exact), atol=1e-5 * scale)
    for part in ("hadamard", "stochastic_rounding", "weight_tiles"):
        without = _grads(x, w, g, key, nvfp4.Recipe(**{part: False}))
        pairs = zip(without, full, strict=True)
        changed = [not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs]
        # The Hadamard transform is the weight gradient's; the weight's tiles change the forward
        # GEMM and the data gradient; the rounding both gradients.
        assert (
            changed
            == {
                "hadamard": [False, False, True],
                "stochastic_rounding": [False, True, True],
                "weight_tiles": [True, True, False],
            }[part]
        ), (part, changed)


def test_bad_input_is_named():
    x, w = jnp.ones((16, 32)), jnp.ones((32, 16))
    key = jax.random.key(0)
    with pytest.raises(TypeError, match="Recipe.hadamard"):
        nvfp4.Recipe(hadamard=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`recipe`"):
        nvfp4.nvfp4_matmul(x, w, key, recipe="full")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="implementation"):
        nvfp4.nvfp4_matmul(x, w, key, implementation="cudnn")
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.nvfp4_matmul(jnp.ones((16, 24)), jnp.ones((24, 16)), key)
    with pytest.raises(ValueError, match="tokens"):
        nvfp4.nvfp4_matmul(jnp.ones((8, 32)), w, key)
    # Forward only: the tokens are not contracted, any number goes.
    assert nvfp4.nvfp4_matmul(jnp.ones((8, 32)), w, key, recipe=nvfp4.FORWARD_ONLY).shape == (8, 16)
    with pytest.raises(ValueError, match=r"\(K, M\)"):
        nvfp4.nvfp4_matmul(x, jnp.ones((16, 16)), key)


def test_the_cuda_program_multiplies_nvfp4_in_all_three_gemms():
    """A train step's CUDA program (`jax.export` for `cuda`, read on this machine): three
    block-scaled GEMMs of float4_e2m1fn operands with float8_e4m3fn scales, and no other dot
    but the 16x16 Hadamard transforms; forward only, one, and the two gradients in float32."""
    x, w, _ = _case(32, 64, 32)

    def gemms(recipe):
        def loss(x, w):
            out = nvfp4.nvfp4_matmul(x, w, jax.random.key(0), recipe=recipe, implementation="jax")
            return jnp.sum(jnp.tanh(out))  # the forward GEMM's result is used

        text = export.export(
            jax.jit(jax.grad(loss, argnums=(0, 1))),
            platforms=["cuda"],
            disabled_checks=[export.DisabledSafetyCheck.custom_call("__op$block_scaled_dot")],
        )(x, w).mlir_module()
        lines = text.splitlines()
        calls = [line for line in lines if "custom_call @__op$block_scaled_dot" in line]
        assert all(c.count("xf4E2M1FN>") == 2 and c.count("xf8E4M3FN>") == 2 for c in calls)
        dots = [line for line in lines if "stablehlo.dot_general" in line]
        transforms = [d for d in dots if "tensor<16x16xf32>" in d]
        return len(calls), len(dots) - len(transforms), len(transforms)

    assert gemms(nvfp4.Recipe()) == (3, 0, 0)  # the transform is additions (no dot)
    assert gemms(nvfp4.Recipe(hadamard=False)) == (3, 0, 0)
    assert gemms(nvfp4.FORWARD_ONLY) == (1, 2, 0)


def test_rounding_to_nearest_is_ml_dtypes_on_every_value():
    """Every float32 in +-6 near the grid's midpoints and elsewhere: the recipe's rounding to
    nearest (ties to even) is ml_dtypes' conversion, under this suite's XLA flags too (where
    XLA's own conversion rounds twice)."""
    grid = np.concatenate([-E2M1_GRID[::-1], E2M1_GRID])
    middles = (grid[1:] + grid[:-1]) / 2
    below, above = np.nextafter(middles, -np.inf), np.nextafter(middles, np.inf)
    around = np.concatenate([below, middles, above])
    values = np.concatenate([around, np.random.default_rng(0).uniform(-6, 6, 100_000)]).astype(
        np.float32
    )
    got = np.asarray(jax.jit(lambda v: nvfp4._e2m1(v, None).astype(jnp.float32))(values))
    np.testing.assert_array_equal(got, values.astype(ml_dtypes.float4_e2m1fn).astype(np.float32))


def test_block_scales_round_to_e4m3_as_ml_dtypes_does():
    """Every float32 in [0, 448] near e4m3's midpoints (normal and subnormal) and elsewhere: the
    block scales' rounding equals ml_dtypes' conversion under this suite's XLA flags."""
    grid = np.unique(
        np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    )
    grid = grid[np.isfinite(grid) & (grid >= 0)]
    middles = (grid[1:] + grid[:-1]) / 2
    below, above = np.nextafter(middles, -np.inf), np.nextafter(middles, np.inf)
    values = np.concatenate(
        [grid, below, middles, above, np.random.default_rng(1).uniform(0, 448, 100_000)]
    ).astype(np.float32)
    got = np.asarray(jax.jit(nvfp4._e4m3)(values))
    np.testing.assert_array_equal(got, values.astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
