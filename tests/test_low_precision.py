"""Tests for jmp_policy.low_precision: bfloat16 parameters and moments that keep small updates."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import jmp_policy as jmp
from jmp_policy.low_precision import join_float32, split_float32, stochastic_round

# These tests hand `update` gradients made outside `value_and_scaled_grad` (planted infs, a
# report's fields) with a DynamicLossScale: what the misuse check warns of, once per process
# (tests/test_misuse.py asserts that warning).
_MISUSE_SAID = pytest.mark.filterwarnings(
    "ignore:loss_scaling. the gradients given to `update` were computed in another function"
    ":jmp_policy.errors.LossScalingWarning"
)
pytestmark = [pytest.mark.standard_promotion, _MISUSE_SAID]  # optax's adam mixes int32 and float

BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)


def run(tx, params, grads_of, steps, compiler_options=None):
    """`steps` jitted train steps, as one `fori_loop` (one compile, one dispatch)."""

    def step(i, carry):
        params, state = carry
        updates, state = tx.update(grads_of(params, i), state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    loop = jax.jit(lambda p, s: jax.lax.fori_loop(0, steps, step, (p, s)))
    return loop.lower(params, state).compile(compiler_options)(params, state)


# Bit identity between two programs holds under XLA:CPU's default code generation. The suite's
# fast settings (conftest.py: LLVM at level 0 with the elemental emitter) round a few float32
# values of one program differently from the other's (86 of 2,048 after 100 AdamW steps), so
# the tests of bit identity compile with the default emitter.
DEFAULT_CODEGEN = {"xla_cpu_use_fusion_emitters": True}


@pytest.mark.parametrize(
    "rounding, expected, tolerance",
    [("stochastic", 1.1, 1e-3), ("kahan", 1.1015625, 0.0), ("split", 1.1015625, 0.0)],
)
def test_a_thousand_small_updates_survive(rounding, expected, tolerance):
    """Adding 1e-4 a thousand times to 1.0: round-to-nearest stays at 1.0."""
    params = {"w": jnp.ones(4096, BF16)}
    tx = jmp.low_precision_optimizer(optax.sgd(1e-4), rounding)
    params, state = run(tx, params, lambda p, i: {"w": -jnp.ones(4096)}, 1000)
    mean = float(params["w"].astype(F32).mean())
    print(f"\n{rounding}: mean {mean:.6f} (target 1.1)")
    assert params["w"].dtype == BF16
    assert abs(mean - expected) <= tolerance
    if rounding == "split":  # the float32 master is exact: 1 + 1000 float32 additions of 1e-4
        reference = np.float32(1.0)
        for _ in range(1000):
            reference = np.float32(reference + np.float32(1e-4))
        np.testing.assert_array_equal(
            jmp.low_precision.master_params(params, state)["w"], reference
        )
    nearest = jnp.ones(4096, BF16)
    for _ in range(1000):
        nearest = (nearest.astype(F32) + 1e-4).astype(BF16)
    assert float(nearest.astype(F32).mean()) == 1.0


def test_stochastic_rounding_is_unbiased():
    """Mean rounding error over 4096 draws against its standard error, per value, both signs."""
    x = jax.random.uniform(jax.random.key(0), (64,), minval=-3.0, maxval=3.0)
    draws = jax.vmap(lambda k: stochastic_round(x, k))(
        jax.random.split(jax.random.key(1), 4096)
    ).astype(F32)
    ulp = 2.0 ** (jnp.floor(jnp.log2(jnp.abs(x))) - 7)  # a bfloat16 step at |x|
    error = draws.mean(axis=0) - x
    # Each draw is off by less than one step: the mean's standard error is <= ulp / 2 / sqrt(n).
    z = jnp.abs(error) / (ulp / 2 / np.sqrt(4096))
    print(f"\nlargest |z| over 64 values: {float(z.max()):.2f}")
    assert float(z.max()) < 5.0
    # Only the two neighbours occur, and the nearer one more often.
    assert float(jnp.max(jnp.abs(draws - x) / ulp)) < 1.0
    assert len(np.unique(np.asarray(draws[:, 0]))) == 2
    # Exact values, inf and NaN are left alone.
    special = jnp.array([1.0, -2.5, jnp.inf, -jnp.inf, 0.0])
    np.testing.assert_array_equal(stochastic_round(special, jax.random.key(2)), special)
    assert jnp.isnan(stochastic_round(jnp.array([jnp.nan]), jax.random.key(2)))[0]


def test_split_is_bit_identical_to_float32_adamw_over_100_steps():
    key = jax.random.key(0)
    start = {"a": jax.random.normal(key, (64, 32)), "b": jnp.zeros(32)}
    start = jax.tree.map(lambda x: x.astype(BF16), start)

    def grads_of(params, i):
        return jax.tree.map(
            lambda p: jax.random.normal(jax.random.fold_in(key, i), p.shape), params
        )

    reference, _ = run(
        optax.adamw(1e-3), jax.tree.map(lambda x: x.astype(F32), start), grads_of, 100,
        DEFAULT_CODEGEN,
    )  # fmt: skip
    tx = jmp.low_precision_optimizer(optax.adamw(1e-3), "split")
    params, state = run(tx, start, grads_of, 100, DEFAULT_CODEGEN)
    master = jmp.low_precision.master_params(params, state)
    for got, want in zip(jax.tree.leaves(master), jax.tree.leaves(reference), strict=True):
        np.testing.assert_array_equal(got, want)
    assert {p.dtype for p in jax.tree.leaves(params)} == {BF16}
    x = jax.random.normal(key, (1000,)) * jnp.logspace(-30, 30, 1000)
    np.testing.assert_array_equal(join_float32(*split_float32(x)), x)


def test_moments_in_bfloat16_and_state_bytes():
    params = {"w": jnp.zeros((256, 256), BF16)}
    sizes = {}
    for rounding in ("stochastic", "kahan", "split"):
        state = jmp.low_precision_optimizer(optax.adam(1e-3), rounding).init(params)
        adam = state.inner_state[0]
        if rounding == "split":
            assert adam.mu["w"].dtype == F32  # exactness keeps the inner's moments by default
        elif rounding == "kahan":
            assert adam.mu["w"].dtype == BF16 and adam.nu["w"].dtype == F32  # nu would stall
        else:
            assert adam.mu["w"].dtype == BF16 and adam.nu["w"].dtype == BF16
        total = params["w"].nbytes + sum(x.nbytes for x in jax.tree.leaves(state))
        sizes[rounding] = round(total / params["w"].size, 3)
    print(f"\nbytes per parameter (parameter + optimizer state): {sizes}; float32 Adam: 12")
    assert sizes["stochastic"] <= 6.01 and sizes["kahan"] <= 10.01  # targets: 8 and 10
    assert sizes["split"] <= 12.01  # 2 + 2 remainder + float32 moments


def test_deterministic_for_a_seed():
    params = {"w": jnp.ones(512, BF16)}
    grads = lambda p, i: {"w": jnp.full(512, 1e-3)}  # noqa: E731
    a, _ = run(jmp.low_precision_optimizer(optax.adam(1e-3), seed=3), params, grads, 5)
    b, _ = run(jmp.low_precision_optimizer(optax.adam(1e-3), seed=3), params, grads, 5)
    c, _ = run(jmp.low_precision_optimizer(optax.adam(1e-3), seed=4), params, grads, 5)
    np.testing.assert_array_equal(a["w"], b["w"])
    assert not np.array_equal(np.asarray(a["w"]), np.asarray(c["w"]))


@pytest.mark.parametrize("rounding", ["stochastic", "kahan", "split"])
def test_skipped_step_changes_nothing_bit_for_bit(rounding):
    params = {"w": jnp.linspace(-1, 1, 300).astype(BF16), "b": jnp.ones(3)}
    inner = jmp.low_precision_optimizer(optax.adamw(1e-2), rounding)
    tx = jmp.loss_scaling(inner, jmp.DynamicLossScale(2.0**10))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no half-precision master-weights warning
        state = tx.init(params)
    step = jax.jit(tx.update)
    good = {"w": jnp.ones(300), "b": jnp.ones(3)}
    updates, state = step(good, state, params)
    params = optax.apply_updates(params, updates)
    bad = {"w": jnp.ones(300).at[7].set(jnp.inf), "b": jnp.ones(3)}
    updates, after = step(bad, state, params)
    assert bool(after.last_step_skipped)
    assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
    kept = zip(jax.tree.leaves(after.inner_state), jax.tree.leaves(state.inner_state), strict=True)
    for x, y in kept:
        np.testing.assert_array_equal(x, y)  # key, residuals and moments included


def test_train_state_and_nnx_optimizer():
    tx = jmp.low_precision_optimizer(optax.adam(1e-2), "kahan")
    ts = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones(4, BF16)}, tx=tx)
    ts = ts.apply_gradients(grads={"w": jnp.ones(4)})
    assert ts.params["w"].dtype == BF16 and float(ts.params["w"][0].astype(F32)) < 1.0
    assert jmp.low_precision.master_params(ts.params, ts).keys() == {"w"}

    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    before = np.asarray(model.kernel[...].astype(F32))
    grads = nnx.grad(lambda m: m(jnp.ones((1, 4))).astype(F32).sum())(model)
    optimizer.update(model, grads)
    assert model.kernel[...].dtype == BF16
    assert not np.array_equal(before, np.asarray(model.kernel[...].astype(F32)))
    master = jmp.low_precision.master_params(nnx.state(model, nnx.Param), optimizer)
    assert jax.tree.leaves(master)[0].dtype == F32


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(rounding="nearest"), ValueError, "`rounding`"),
        (dict(moment_dtypes={"mu": "int8"}), TypeError, r"`moment_dtypes\['mu'\]`"),
        (dict(moment_dtypes={"nu": "float16"}), ValueError, "flush to zero"),
        (dict(moment_dtypes=["mu"]), TypeError, "mapping"),
        (dict(seed=1.5), TypeError, "`seed`"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        jmp.low_precision_optimizer(optax.adam(1e-3), **kwargs)


def test_bad_state_names_and_parameters():
    with pytest.raises(ValueError, match=r"names \['m'\].*floating fields are \['mu', 'nu'\]"):
        jmp.low_precision_optimizer(optax.adam(1e-3), moment_dtypes={"m": "bfloat16"}).init(
            {"w": jnp.ones(2)}
        )
    with pytest.raises(TypeError, match=r"\['w'\] is float16"):
        jmp.low_precision_optimizer(optax.adam(1e-3)).init({"w": jnp.ones(2, jnp.float16)})
    with pytest.raises(TypeError, match="`inner`"):
        jmp.low_precision_optimizer("adam")


def test_half_master_weights_warning_points_here():
    with pytest.warns(UserWarning, match="low_precision_optimizer"):
        jmp.loss_scaling(optax.adam(1e-3), jmp.DynamicLossScale(2.0**15)).init(
            {"w": jnp.ones(2, BF16)}
        )


def test_with_a_bfloat16_param_policy_and_a_linen_model():
    """`params=bfloat16` end to end: no master-weights warning, LayerNorm still in float32."""

    class Small(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(nn.LayerNorm()(nn.Dense(16)(x)))

    policy = jmp.get_policy("params=bfloat16,compute=bfloat16,output=float32")
    model = jmp.linen.mixed_precision(Small(), policy)
    x = jax.random.normal(jax.random.key(0), (32, 8))
    y = jnp.arange(32) % 4
    params = policy.cast_to_param(model.init(jax.random.key(1), x)["params"])
    tx = jmp.loss_scaling(jmp.low_precision_optimizer(optax.adamw(3e-2)), jmp.NoOpLossScale())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = tx.init(params)

    def loss_fn(p):
        logits = model.apply({"params": p}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for _ in range(30):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert {p.dtype for p in jax.tree.leaves(params)} == {BF16}
    assert losses[-1] < 0.5 * losses[0], losses


def _nu_after_the_gradients_shrink(tx, dtype=BF16, steps_big=500, steps_small=2500):
    """Adam's nu (mean over 256 parameters) after gradients of scale 1 fall to scale 0.1."""
    params = {"w": jnp.zeros(256, dtype)}
    key = jax.random.key(0)

    def grads_of(p, i):
        scale = jnp.where(i < steps_big, 1.0, 0.1)
        return {"w": scale * jax.random.normal(jax.random.fold_in(key, i), (256,))}

    _, state = run(tx, params, grads_of, steps_big + steps_small)
    adam = (state.inner_state if hasattr(state, "inner_state") else state)[0]
    return float(jnp.mean(adam.nu["w"].astype(F32)))


def test_default_moments_follow_gradients_that_shrink_under_a_0999_decay():
    # nu rises to 1 - 0.999**500 ~ 0.39, then falls to 0.39 * 0.999**2500 + 0.01 ~ 0.042;
    # rounded to nearest in bfloat16 it cannot move by 0.1% a step and stays far above.
    adam = optax.adam(1e-4, b2=0.999)
    reference = _nu_after_the_gradients_shrink(adam, F32)  # a float32 master
    found = {"float32": reference}
    for rounding in ("stochastic", "kahan", "split"):
        found[rounding] = _nu_after_the_gradients_shrink(
            jmp.low_precision_optimizer(adam, rounding)
        )
    with pytest.warns(UserWarning, match="nu"):
        stalling = jmp.low_precision_optimizer(
            adam, "kahan", moment_dtypes={"mu": "bfloat16", "nu": "bfloat16"}
        )
    found["kahan, nu bfloat16 to nearest"] = _nu_after_the_gradients_shrink(stalling)
    print({k: round(v, 4) for k, v in found.items()})
    assert 0.035 < reference < 0.05
    for rounding in ("stochastic", "kahan", "split"):
        assert abs(found[rounding] / reference - 1) < 0.1, (rounding, found)
    assert found["kahan, nu bfloat16 to nearest"] > 2 * reference  # what the defaults avoid


def test_a_16_bit_field_whose_updates_round_away_is_warned_about():
    with pytest.warns(UserWarning, match=r"'nu'.* decays it by 0\.999 a step.*float32"):
        jmp.low_precision_optimizer(optax.adamw(1e-3), "kahan", moment_dtypes={"nu": BF16})
    # float16 has 3 more bits: 0.999 is fine there, a momentum of 0.9999 is not.
    with pytest.warns(UserWarning, match=r"'trace'.* 0\.9999"):
        jmp.low_precision_optimizer(
            optax.sgd(1e-3, momentum=0.9999), "split", moment_dtypes={"trace": "float16"}
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for rounding in ("stochastic", "kahan", "split"):  # every default
            jmp.low_precision_optimizer(optax.adamw(1e-3), rounding)
        # Stochastic rounding keeps a 16-bit nu unbiased; a 0.9 decay is far from an ulp.
        jmp.low_precision_optimizer(optax.adamw(1e-3), "stochastic", moment_dtypes={"nu": BF16})
        jmp.low_precision_optimizer(optax.sgd(1e-3, momentum=0.9), "kahan",
                                    moment_dtypes={"trace": BF16})  # fmt: skip


def test_the_stall_check_of_an_optimizer_that_needs_the_parameters_runs_at_init():
    """`optax.masked` cannot run on a one-element probe (its mask is a tree): the check runs at
    `init`, on a probe of the parameters' structure, and still finds a stalling 16-bit `nu`;
    an optimizer that runs on neither probe is said to be unchecked, not passed over."""
    params = {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}
    masked = optax.masked(optax.adam(1e-3), {"w": True, "b": False})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing said at construction
        tx = jmp.low_precision_optimizer(masked, "kahan", moment_dtypes={"nu": BF16})
    with pytest.warns(UserWarning, match=r"'nu'.* decays it by 0\.999 a step"):
        tx.init(params)

    def needs_three_rows(params):  # an optimizer that refuses any other shape
        if any(p.shape[0] != 4 for p in jax.tree.leaves(params)):
            raise ValueError("expected parameters of 4 rows")
        return optax.adam(1e-3).init(params)

    picky = optax.GradientTransformation(needs_three_rows, optax.adam(1e-3).update)
    tx = jmp.low_precision_optimizer(picky, "kahan", moment_dtypes={"nu": BF16})
    with pytest.warns(UserWarning, match=r"could not check.*ValueError: expected parameters"):
        tx.init({"w": jnp.ones((4, 3))})
