"""Tests for jmp_policy._loss_scaling.loss_scale: state round trips, the dynamic rule, bad input."""

import math
import warnings

import chex
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jmp_policy as jmp
from jmp_policy._loss_scaling.finite import leaf_finite_flags


def grad_scaler_reference(flags, init=2.0**16, growth=2.0, backoff=0.5, interval=2000):
    """torch.amp.GradScaler's documented update rule, in plain Python.

    Grow on the `interval`-th consecutive finite step, reset the counter on an
    overflow and on growth, never grow to inf; no floor and no cap.
    """
    scale, tracker, out = np.float32(init), 0, []
    for finite in flags:
        if finite:
            tracker += 1
            if tracker == interval:
                grown = np.float32(scale * np.float32(growth))
                if np.isfinite(grown):
                    scale = grown
                tracker = 0
        else:
            scale = np.float32(scale * np.float32(backoff))
            tracker = 0
        out.append(float(scale))
    return out


def torch_like(init=2.0**16, interval=2000):
    # GradScaler has no floor and no cap.
    return jmp.DynamicLossScale(init, period=interval, factor=2, min_loss_scale=0.0)


def run(loss_scale, flags, jit=True):
    adjust = jax.jit(lambda s, f: s.adjust(f)) if jit else (lambda s, f: s.adjust(f))
    scales = []
    for finite in flags:
        loss_scale = adjust(loss_scale, jnp.asarray(finite))
        scales.append(float(loss_scale.loss_scale))
    return loss_scale, scales


ALL_STATES = [
    jmp.NoOpLossScale(),
    jmp.StaticLossScale(2.0**7),
    jmp.DynamicLossScale(2.0**15),
    jmp.DynamicLossScale(
        2.0**10,
        3,
        period=7,
        factor=4,
        min_loss_scale=0.25,
        backoff_factor=0.5,
        max_loss_scale=2.0**24,
        hysteresis=3,
        warmup=True,
    ),
]


@pytest.mark.parametrize("state", ALL_STATES, ids=lambda s: type(s).__name__)
def test_state_round_trips_with_every_field(state):
    leaves, treedef = jax.tree.flatten(state)
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert rebuilt == state
    assert jax.tree.map(lambda x: x, state) == state
    through_jit = jax.jit(lambda s: s)(state)
    for field in state.__dataclass_fields__:
        assert np.array_equal(getattr(through_jit, field), getattr(state, field)), field
    restored = flax.serialization.from_bytes(state, flax.serialization.to_bytes(state))
    chex.assert_trees_all_equal(restored, state)
    assert restored == state
    # Maps that treat None as a leaf (orbax's) keep the structure they mapped.
    is_none = lambda x: x is None  # noqa: E731
    names = jax.tree.map(lambda x: "name", state, is_leaf=is_none)
    assert jax.tree.structure(names, is_leaf=is_none) == jax.tree.structure(state, is_leaf=is_none)
    # Placeholders JAX rebuilds trees with must not trip validation.
    jax.tree.unflatten(treedef, [object()] * len(leaves))
    jax.eval_shape(lambda s: s, state)
    jax.jit(lambda s: s).lower(state).compile()


def test_min_loss_scale_survives_jit():
    # jmp drops min_loss_scale in its hand-written flatten: after jit it is 1.0.
    state = jmp.DynamicLossScale(2.0**15, min_loss_scale=2.0**-10)
    out = jax.jit(lambda s: s)(state)
    assert out.min_loss_scale == 2.0**-10
    final, scales = run(state, [False] * 40)
    assert scales[-1] == 2.0**-10
    assert final.min_loss_scale == 2.0**-10


def test_default_leaves_match_jmp():
    scale, counter = jnp.ones([]), jnp.zeros([], jnp.int32)
    state = jmp.DynamicLossScale(scale, counter, 2000, 2)
    assert jax.tree.leaves(state) == [scale, counter]
    assert jax.tree.leaves(jmp.StaticLossScale(2)) == []
    assert jax.tree.leaves(jmp.NoOpLossScale()) == []


def test_python_numbers_become_float32():
    for state in (jmp.DynamicLossScale(2**15), jmp.DynamicLossScale(3.0)):
        assert state.loss_scale.dtype == np.float32
        assert state.counter.dtype == np.int32
    half = jmp.DynamicLossScale(jnp.asarray(2.0**15, jnp.float16))  # jmp's README example
    assert half.loss_scale.dtype == jnp.float32
    assert float(half.adjust(jnp.asarray(False)).loss_scale) == 2.0**14
    assert jmp.StaticLossScale(2).loss_scale == 2.0


def test_guide_example_interval_3():
    flags = [True, True, True, False, True, True, True, True]
    expected = [8, 8, 16, 8, 8, 8, 16, 16]
    _, scales = run(torch_like(8.0, interval=3), flags)
    assert scales == expected
    assert grad_scaler_reference(flags, init=8.0, interval=3) == expected


def test_eager_and_jit_trajectories_equal():
    rng = np.random.default_rng(0)
    flags = list(rng.random(200) > 0.2)
    state = ALL_STATES[-1]
    eager_final, eager = run(state, flags, jit=False)
    jit_final, jitted = run(state, flags, jit=True)
    assert eager == jitted
    chex.assert_trees_all_equal(eager_final, jit_final)


def test_changing_scale_never_recompiles():
    @jax.jit
    def step(state, finite):
        return state.adjust(finite)

    state = jmp.DynamicLossScale(2.0**15, period=2)
    for finite in [True, True, False, True, True, True]:
        state = step(state, jnp.asarray(finite))
    assert step._cache_size() == 1
    step(jmp.DynamicLossScale(2.0**3, period=2), jnp.asarray(True))  # new value, same program
    assert step._cache_size() == 1


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.booleans(), min_size=1, max_size=120),
    st.integers(1, 6),
    st.sampled_from([2.0**16, 2.0**15, 8.0, 3.0]),
)
def test_matches_grad_scaler_rule(flags, interval, init):
    _, scales = run(torch_like(init, interval), flags)
    assert scales == grad_scaler_reference(flags, init=init, interval=interval)


def test_never_grows_to_inf_and_respects_cap():
    _, scales = run(torch_like(2.0**126, interval=1), [True] * 5)
    assert scales == [2.0**127] * 5
    capped = jmp.DynamicLossScale(2.0**20, period=1, max_loss_scale=2.0**24)
    _, scales = run(capped, [True] * 8)
    assert scales == [2.0**21, 2.0**22, 2.0**23] + [2.0**24] * 5
    odd_cap = jmp.DynamicLossScale(4.0, period=1, max_loss_scale=10.0)
    _, scales = run(odd_cap, [True] * 3)
    assert scales == [8.0, 10.0, 10.0]


def test_floor_and_backoff_factor():
    state = jmp.DynamicLossScale(
        2.0**4, period=5, factor=2, min_loss_scale=0.5, backoff_factor=0.25
    )
    _, scales = run(state, [False] * 5)
    assert scales == [4.0, 1.0, 0.5, 0.5, 0.5]
    # A zero floor still never reaches zero.
    _, scales = run(torch_like(1.0), [False] * 200)
    assert scales[-1] > 0


def test_hysteresis():
    state = jmp.DynamicLossScale(2.0**10, period=3, hysteresis=2)
    flags = [False, True, False, False, False, True, True, True]
    _, scales = run(state, flags)
    # Back off on the 2nd and later consecutive non-finite step only; a finite
    # step resets the run.
    assert scales == [2.0**10, 2.0**10, 2.0**10, 2.0**9, 2.0**8, 2.0**8, 2.0**8, 2.0**9]


def _steps_to_safe(state, safe, max_steps=100):
    """Closed loop: a step overflows exactly when S > safe."""
    skipped = 0
    adjust = jax.jit(lambda s, f: s.adjust(f))
    for step in range(max_steps):
        finite = float(state.loss_scale) <= safe
        if not finite:
            skipped += 1
        state = adjust(state, jnp.asarray(finite))
        if finite and float(state.loss_scale) == safe and skipped:
            return step + 1, skipped, state
    raise AssertionError("never settled")


def test_warmup_finds_safe_scale_faster():
    safe = 2.0**5
    plain_steps, plain_skipped, _ = _steps_to_safe(jmp.DynamicLossScale(2.0**16), safe)
    warm_steps, warm_skipped, warm = _steps_to_safe(jmp.DynamicLossScale(1.0, warmup=True), safe)
    print(
        f"\nsafe scale 2^5: plain backoff from 2^16 skips {plain_skipped} steps "
        f"({plain_steps} steps to settle); warm-up from 1 skips {warm_skipped} "
        f"({warm_steps} steps, the others all applied)"
    )
    assert plain_skipped == 11
    assert warm_skipped == 1
    assert plain_skipped - warm_skipped == 10
    # After warm-up the normal period applies: no growth for period-1 steps.
    assert not bool(warm.warming_up)
    _, scales = run(warm, [True] * 10)
    assert scales == [safe] * 10


def test_scale_and_unscale_in_float32():
    state = jmp.DynamicLossScale(2.0**16)
    loss = jnp.float16(60000.0)
    scaled = state.scale(loss)
    assert scaled.dtype == jnp.float32 and float(scaled) == 60000.0 * 2**16
    # float16 gradients of the scaled loss: 2**-20 * 2**16, where 2**-20 alone
    # would be a float16 subnormal.
    tiny_grads = {"g": jnp.full((3,), 2.0**-4, jnp.float16), "i": jnp.int32(4)}
    unscaled = state.unscale(tiny_grads)
    assert unscaled["g"].dtype == jnp.float32 and float(unscaled["g"][0]) == 2.0**-20
    assert unscaled["i"] is tiny_grads["i"]
    static = jmp.StaticLossScale(2**16)
    assert static.unscale(static.scale(jnp.float16(3.0))) == 3.0


def test_all_finite():
    assert bool(jmp.all_finite(None)) and bool(jmp.all_finite({}))
    assert bool(jmp.all_finite({"i": jnp.int32(2**31 - 1), "k": jax.random.key(0), "s": "x"}))
    f = jax.jit(jmp.all_finite)
    for bad in (jnp.inf, -jnp.inf, jnp.nan):
        for dtype in (jnp.float16, jnp.bfloat16, jnp.float32):
            tree = {"a": jnp.ones((3, 4), dtype), "b": jnp.ones(5).at[2].set(bad).astype(dtype)}
            assert not bool(f(tree))
    # Large finite values whose plain sum would overflow are still finite.
    assert bool(f({"big": jnp.full((1000,), 6e4, jnp.float16), "f": jnp.full((10,), 3e38)}))
    assert bool(f([jnp.ones(3), np.ones(2, np.float32)]))


@pytest.mark.parametrize("size", [3, 2**17])  # grouped and reduced one by one
def test_finite_checks_see_overflow_of_a_scaled_value(size):
    # Under jit XLA folds `(y * 4) * 0` into `y * 0`: a check built on `x * 0`
    # called 3e38 * 4 (= inf) finite. Unscaling by a static 0.25 is that `* 4`.
    y = jnp.full((size,), 3e38)

    def checks(y):
        x = jmp.StaticLossScale(0.25).unscale(y)
        return jmp.all_finite([x, jnp.ones(3)]), leaf_finite_flags([x, jnp.ones(3)])

    finite, flags = jax.jit(checks)(y)
    assert not bool(finite) and [bool(f) for f in flags] == [False, True]
    finite, flags = jax.jit(checks)(y / 8)
    assert bool(finite) and [bool(f) for f in flags] == [True, True]


def test_all_finite_axis_name():
    def per_device(x):
        return jmp.all_finite(x), jmp.all_finite(x, axis_name="i")

    x = jnp.ones((2, 3)).at[1, 0].set(jnp.nan)
    local, agreed = jax.vmap(per_device, axis_name="i")(x)
    assert local.tolist() == [True, False]
    assert agreed.tolist() == [False, False]


def test_select_tree():
    a = {"a": jnp.ones([]), "b": jnp.zeros([])}
    b = {"a": jnp.zeros([]), "b": jnp.ones([])}
    assert jmp.select_tree(jnp.bool_(True), None, None) is None
    chex.assert_trees_all_equal(jax.jit(jmp.select_tree)(jnp.asarray(False), a, b), b)
    chex.assert_trees_all_equal(jmp.select_tree(True, a, b), a)
    with pytest.raises(TypeError, match=r"scalar boolean .* `pred`"):
        jmp.select_tree(jnp.ones([1]), None, None)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: jmp.StaticLossScale(0), ValueError, r"> 0 for `loss_scale`"),
        (lambda: jmp.StaticLossScale(-2.0), ValueError, "`loss_scale`"),
        (lambda: jmp.StaticLossScale(math.inf), ValueError, "finite"),
        (lambda: jmp.StaticLossScale("2"), TypeError, "`loss_scale`"),
        (lambda: jmp.DynamicLossScale(0.0), ValueError, "`loss_scale`"),
        (lambda: jmp.DynamicLossScale(np.float32(np.nan)), ValueError, "`loss_scale`"),
        (lambda: jmp.DynamicLossScale(-1), ValueError, "`loss_scale`"),
        (
            lambda: jmp.DynamicLossScale(jnp.asarray(1, jnp.int32)),
            TypeError,
            r"floating .* `loss_scale`",
        ),
        (
            lambda: jmp.DynamicLossScale(np.asarray(1, np.int32)),
            TypeError,
            r"floating .* `loss_scale`",
        ),
        # A user's NumPy array must be a scalar; a JAX array may be a batched state.
        (lambda: jmp.DynamicLossScale(np.ones(2)), TypeError, "scalar"),
        (lambda: jmp.DynamicLossScale(True), TypeError, "`loss_scale`"),
        (lambda: jmp.DynamicLossScale(2.0, factor=1), ValueError, r"> 1 for `factor`"),
        (lambda: jmp.DynamicLossScale(2.0, factor=0.5), ValueError, "`factor`"),
        (
            lambda: jmp.DynamicLossScale(2.0, backoff_factor=1.0),
            ValueError,
            r"\(0, 1\) for `backoff_factor`",
        ),
        (lambda: jmp.DynamicLossScale(2.0, backoff_factor=0), ValueError, "`backoff_factor`"),
        (lambda: jmp.DynamicLossScale(2.0, period=0), ValueError, r">= 1 for `period`"),
        (lambda: jmp.DynamicLossScale(2.0, period=2.5), TypeError, "`period`"),
        (
            lambda: jmp.DynamicLossScale(2.0, min_loss_scale=4, max_loss_scale=2),
            ValueError,
            "`min_loss_scale` <= `max_loss_scale`",
        ),
        (lambda: jmp.DynamicLossScale(2.0, min_loss_scale=-1), ValueError, "`min_loss_scale`"),
        (
            lambda: jmp.DynamicLossScale(2.0, min_loss_scale=jnp.asarray(1, jnp.int32)),
            TypeError,
            "`min_loss_scale`",
        ),
        (lambda: jmp.DynamicLossScale(2.0, hysteresis=0), ValueError, "`hysteresis`"),
        (lambda: jmp.DynamicLossScale(2.0, counter=1.5), TypeError, "`counter`"),
        (lambda: jmp.DynamicLossScale(2.0, counter=jnp.float32(1)), TypeError, "`counter`"),
        (lambda: jmp.DynamicLossScale(2.0, warmup=1), TypeError, "`warmup`"),
        (
            lambda: jmp.DynamicLossScale(2.0).adjust(jnp.ones([2], bool)),
            TypeError,
            "`grads_finite`",
        ),
        (lambda: jmp.DynamicLossScale(2.0).adjust(jnp.float32(1)), TypeError, "`grads_finite`"),
        (lambda: jmp.StaticLossScale(2.0).adjust(1), TypeError, "`grads_finite`"),
        (lambda: jmp.NoOpLossScale().adjust(jnp.ones(3) > 0), TypeError, "`grads_finite`"),
    ],
)
def test_bad_input(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_no_warnings_and_jmp_style_arguments():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = jmp.DynamicLossScale(2**15, 0, 5.0, 2.0, np.float32(0.5))
    assert state.period == 5 and state.min_loss_scale == 0.5


@pytest.mark.parametrize("count", [1, 2, 7, 64])
@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
def test_all_finite_grouped_leaves(count, bad):
    f = jax.jit(jmp.all_finite)
    small = [jnp.ones((3, 5)) * i for i in range(count)]
    large = [jnp.ones((300, 300)), jnp.ones((2**16,), jnp.bfloat16)]
    assert bool(f(small + large))
    for position in {0, count // 2, count - 1}:
        poisoned = list(small)
        poisoned[position] = poisoned[position].at[2, 4].set(bad)
        assert not bool(f(poisoned + large))
    assert not bool(f(small + [large[0].at[299, 299].set(bad), large[1]]))
    assert not bool(f(small + [large[0], large[1].at[0].set(bad)]))
