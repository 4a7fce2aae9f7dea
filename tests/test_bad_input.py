"""Every public entry point against arbitrary input (hypothesis, over 500 cases in all).

Each test's oracle is one of two outcomes, and nothing else: a clear `ValueError` or
`TypeError` raised where the value is given, whose message says "Expected ..." (or
"Unknown ...") and names the argument in backquotes; or a result that is right, checked
against what the argument means (a scale that float32 holds, limits that hold after a step,
the gradient JAX itself gives). A raw error from inside JAX or optax, or a silently wrong
result, fails the test.
"""

from __future__ import annotations

import math
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jmp_policy as jmp
from jmp_policy import fp8, scaling

# Anything a user might pass where a number, a flag, a dtype or a function is expected.
_NUMBERS = st.one_of(
    st.integers(min_value=-(2**40), max_value=2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e40, 1e-46, 1e-40, 2.0**127, 2.0**128, 3.5e38, 1.1e-38, 0.0, -0.0]),
)
_ANYTHING = st.one_of(
    st.none(),
    st.booleans(),
    _NUMBERS,
    st.text(max_size=8),
    st.sampled_from(["1024", "False", "float16", "f16", "bf16", "float128", "half", "int8"]),
    st.lists(st.integers(0, 3), max_size=2),
    st.builds(np.float32, st.floats(width=32, allow_nan=True, allow_infinity=True)),
    st.builds(np.int64, st.integers(-(2**40), 2**40)),
    st.sampled_from(
        [np.ones(2, np.float32), np.bool_(True), np.float16(2.0), jnp.float32(8.0), jnp.int32(3)]
    ),
    st.sampled_from([np.float32, jnp.bfloat16, np.longdouble, object(), print]),
)


def _clean(error: Exception, argument: str | None = None) -> bool:
    """A clear error: a ValueError/TypeError that says what was expected and names the argument."""
    message = str(error)
    if not isinstance(error, (ValueError, TypeError)):
        return False
    if not re.match(r"(Expected|Unknown)", message):
        return False
    return f"`{argument}`" in message if argument else re.search(r"`\w+`", message) is not None


def _outcome(build, argument: str | None = None):
    """`build()`'s result, or None after a clear error; any other error fails the test, but
    JAX's own answer to an axis name used outside `shard_map`/`pmap` (plain `lax.pmin` gives
    the same)."""
    try:
        return build()
    except (ValueError, TypeError) as error:
        assert _clean(error, argument), f"unclear error: {type(error).__name__}: {error}"
        return None
    except NameError as error:
        assert "unbound axis name" in str(error), error
        return None


def _fits_float32(x: float) -> bool:
    return float(np.finfo(np.float32).tiny) <= x <= float(np.finfo(np.float32).max)


@settings(max_examples=120, deadline=None)
@given(_ANYTHING)
def test_static_loss_scale_holds_exactly_what_it_was_given_or_says_why_not(value):
    scale = _outcome(lambda: jmp.StaticLossScale(value), "loss_scale")
    if scale is None:
        return
    s = np.float32(scale.loss_scale)
    assert np.isfinite(s) and s > 0 and _fits_float32(float(value))
    # jmp's semantics: a Python number is scaled, in float32 (a scale near float32's largest
    # value scales 2.0 to inf, as float32 arithmetic does).
    with np.errstate(over="ignore"):
        assert float(scale.scale(2.0)) == float(np.float32(2.0) * s)
    assert float(scale.unscale(scale.scale(jnp.float32(1.0)))) == pytest.approx(1.0, rel=1e-6)


@settings(max_examples=150, deadline=None)
@given(
    loss_scale=_ANYTHING,
    counter=st.one_of(_ANYTHING, st.integers(0, 10)),
    period=st.one_of(_ANYTHING, st.integers(1, 5), st.just(2**31)),
    factor=st.one_of(_ANYTHING, st.sampled_from([2, 2.0, 1.5])),
    min_loss_scale=st.one_of(_ANYTHING, st.sampled_from([1.0, 0.0, 2.0**-10])),
    max_loss_scale=st.one_of(st.none(), _ANYTHING, st.sampled_from([2.0**24, 2.0**10])),
    hysteresis=st.one_of(_ANYTHING, st.integers(1, 3)),
    warmup=st.one_of(_ANYTHING, st.booleans()),
)
def test_dynamic_loss_scale_stays_within_its_limits_or_says_why_not(
    loss_scale, counter, period, factor, min_loss_scale, max_loss_scale, hysteresis, warmup
):
    scale = _outcome(
        lambda: jmp.DynamicLossScale(
            loss_scale,
            counter,
            period,
            factor,
            min_loss_scale,
            max_loss_scale=max_loss_scale,
            hysteresis=hysteresis,
            warmup=warmup,
        )
    )
    if scale is None:
        return
    cap = scale.max_loss_scale
    assert scale.floor <= float(scale.loss_scale) <= cap
    assert 0 <= int(scale.counter) < 2**31 and scale.period < 2**31
    # Every step keeps the scale finite, positive and within its limits: a back-off never
    # raises it, a growth step never lowers it.
    adjust = jax.jit(lambda s, f: s.adjust(f))
    for finite in (False, True, True, False, True):
        before = float(scale.loss_scale)
        scale = adjust(scale, jnp.asarray(finite))
        after = float(scale.loss_scale)
        assert math.isfinite(after) and scale.floor <= after <= cap
        assert (after >= before) if finite else (after <= before)


_DTYPES = st.one_of(
    _ANYTHING,
    st.sampled_from(["float32", "float16", "bfloat16", "float64", "f32", "bf16", "half"]),
    st.sampled_from(["float8_e4m3fn", "float8_e5m2", "complex64", "int32", "float128"]),
)


@settings(max_examples=100, deadline=None)
@given(_DTYPES, _DTYPES, _DTYPES)
def test_a_policy_holds_jax_floating_dtypes_that_cast_or_says_why_not(param, compute, output):
    policy = _outcome(lambda: jmp.Policy(param, compute, output))
    if policy is None:
        return
    x = {"w": jnp.ones(2, jnp.float32), "n": jnp.int32(1)}
    for dtype, cast in (
        (policy.param_dtype, policy.cast_to_param),
        (policy.compute_dtype, policy.cast_to_compute),
        (policy.output_dtype, policy.cast_to_output),
    ):
        assert jnp.issubdtype(dtype, jnp.floating) and dtype != np.longdouble
        with warnings.catch_warnings():  # JAX's own word on float64 without x64 mode
            warnings.filterwarnings("ignore", "Explicitly requested dtype float64", UserWarning)
            out = cast(x)
        # float64 is float32 unless JAX's x64 mode is on, as everywhere in JAX.
        assert out["w"].dtype == jax.dtypes.canonicalize_dtype(dtype)
        assert out["n"].dtype == jnp.int32
    assert jmp.get_policy(str(policy)) == policy  # str round-trips


@settings(max_examples=60, deadline=None)
@given(
    st.one_of(
        _ANYTHING,
        st.sampled_from(["float128", "f16", "mixed_float16", "p=f32,c=f16", "params=int8"]),
        st.text(alphabet="pcof0123456=,_abdelmtx", max_size=20),
    )
)
def test_get_policy_parses_or_says_why_not(name):
    policy = _outcome(lambda: jmp.get_policy(name), "policy_name")
    if policy is None:
        return
    # float64 computes in float32 unless JAX's x64 mode is on, as it does everywhere in JAX.
    expected = jax.dtypes.canonicalize_dtype(policy.compute_dtype)
    assert jnp.ones(1).astype(policy.compute_dtype).dtype == expected
    assert jmp.get_policy(str(policy)) == policy


@pytest.mark.parametrize("name", ["a", "params=a", "params=float32,compute=a,output=float32"])
def test_a_deprecated_numpy_alias_is_refused_without_numpys_warning(name):
    # Found by the property test above: NumPy 2 parses 'a' as bytes, with a
    # DeprecationWarning the user never asked for; a name is looked up, never parsed.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises((TypeError, ValueError), match="policy|dtype"):
            jmp.get_policy(name)


@settings(max_examples=60, deadline=None)
@given(
    threshold=st.one_of(_ANYTHING, st.just(10.0)),
    warmup=st.one_of(_ANYTHING, st.just(3)),
    max_run=st.one_of(_ANYTHING, st.just(2)),
    mean_decay=st.one_of(_ANYTHING, st.just(0.9)),
)
def test_skip_spikes_settings_are_checked(threshold, warmup, max_run, mean_decay):
    spikes = _outcome(
        lambda: scaling.SkipSpikes(
            threshold=threshold, warmup=warmup, max_run=max_run, mean_decay=mean_decay
        )
    )
    if spikes is None:
        return
    assert spikes.threshold > 0 and 1 <= spikes.warmup < 2**31 and 1 <= spikes.max_run < 2**31
    assert 0 < spikes.mean_decay < 1


@settings(max_examples=60, deadline=None)
@given(
    history_length=st.one_of(_ANYTHING, st.integers(1, 8)),
    margin=st.one_of(_ANYTHING, st.integers(0, 40)),
    power_of_two=_ANYTHING,
    amax_from=st.one_of(_ANYTHING, st.sampled_from(["max", "most_recent"])),
)
def test_delayed_scaling_gives_finite_scales_or_says_why_not(
    history_length, margin, power_of_two, amax_from
):
    recipe = _outcome(
        lambda: fp8.DelayedScaling(
            history_length=history_length,
            margin=margin,
            power_of_two=power_of_two,
            amax_from=amax_from,
        )
    )
    if recipe is None:
        return
    assert isinstance(recipe.power_of_two, bool)
    meta = recipe.init().lhs
    for amax in (1.0, 3.0, 1e-3):
        history = np.asarray(meta.amax_history)
        seen = history.max() if recipe.amax_from == "max" else history[0]
        meta = recipe.advance(meta, jnp.float32(amax), jnp.float8_e4m3fn)
        assert np.isfinite(float(meta.scale)) and float(meta.scale) > 0
        # The amax the scale is taken from (the history so far: a later, smaller amax may
        # fall below it, as delayed scaling does) stays a normal float8 value.
        if seen > 0:
            scaled = float(meta.scale) * float(seen)
            assert float(jnp.finfo(jnp.float8_e4m3fn).smallest_normal) <= scaled <= 448.0


_INNERS = st.one_of(
    _ANYTHING, st.sampled_from([optax.sgd(0.5), optax.adam(0.1), optax.chain(optax.sgd(1.0))])
)


@pytest.mark.standard_promotion  # optax's chain and adam mix float and int32 themselves
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    inner=_INNERS,
    stats_every=st.one_of(st.none(), _ANYTHING, st.integers(1, 3)),
    stats_dtype=st.one_of(_DTYPES, st.just("float16")),
    skip_spikes=st.one_of(st.none(), _ANYTHING, st.just(scaling.SkipSpikes(warmup=1))),
)
def test_loss_scaling_builds_and_steps_or_says_why_not(
    inner, stats_every, stats_dtype, skip_spikes
):
    tx = _outcome(
        lambda: jmp.loss_scaling(
            inner,
            jmp.StaticLossScale(4.0),
            stats_every=stats_every,
            stats_dtype=stats_dtype,
            skip_spikes=skip_spikes,
        )
    )
    if tx is None:
        return
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    with warnings.catch_warnings():  # gradients made here, not from a scaled loss: said so
        warnings.simplefilter("ignore", jmp.errors.LossScalingWarning)
        updates, state = tx.update({"w": jnp.full(2, 4.0)}, state, params, value=jnp.float32(1))
    assert bool(state.applied_steps == 1)
    assert float(updates["w"][0]) < 0  # the unscaled gradient 1, applied


@settings(max_examples=40, deadline=None)
@given(_ANYTHING)
def test_update_checks_the_loss_it_is_given(value):
    tx = jmp.loss_scaling(optax.sgd(1.0), jmp.StaticLossScale(4.0))
    params = {"w": jnp.ones(2)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jmp.errors.LossScalingWarning)
        out = _outcome(lambda: tx.update({"w": jnp.ones(2)}, tx.init(params), params, value=value))
    if out is None:
        assert value is not None and (
            not isinstance(value, (int, float)) or value is True or value is False
        )
        return
    # No loss (None) is the plain step; a loss is judged by whether it is finite in float32,
    # as JAX reads a Python number (1e40 is inf).
    with np.errstate(over="ignore"):
        finite = value is None or bool(np.all(np.isfinite(np.asarray(value, np.float32))))
    assert bool(out[1].last_step_skipped) == (not finite)


def _loss(a, b, c):
    return jnp.sum(a) + 2 * jnp.sum(b**2) + 3 * jnp.sum(c)


@settings(max_examples=40, deadline=None)
@given(
    st.one_of(
        _ANYTHING,
        st.integers(-4, 3),
        st.lists(st.integers(-4, 3), min_size=1, max_size=2).map(tuple),
    )
)
def test_value_and_scaled_grad_takes_argnums_as_jax_does(argnums):
    args = (jnp.ones(2), jnp.full(2, 2.0), jnp.ones(2))
    tx = jmp.loss_scaling(optax.sgd(1.0), jmp.StaticLossScale(8.0))
    state = tx.init(args)
    try:
        expected = jax.value_and_grad(_loss, argnums=argnums)(*args)
    except (TypeError, ValueError, StopIteration):  # jax 0.8.3: StopIteration for [0, 0]
        expected = None
    got = _outcome(lambda: jmp.value_and_scaled_grad(_loss, argnums=argnums)(state, *args))
    if got is None:
        # Refused where JAX refuses, and stricter on purpose: a bool (JAX reads False as 0) and
        # a list (JAX wants a tuple to hash; we take either) are refused alike.
        assert expected is None or isinstance(argnums, (bool, list)), argnums
        return
    assert expected is not None, f"argnums={argnums!r} accepted where JAX refuses it"
    assert float(got[0]) == float(expected[0])
    scaled = jax.tree.map(lambda g: g / 8.0, got[1])
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), scaled, expected[1]))


@settings(max_examples=20, deadline=None)
@given(st.one_of(_ANYTHING, st.sampled_from([jnp.float32(1024.0), np.float32(8.0), 2.0**15])))
def test_debug_precision_takes_any_concrete_positive_scale(loss_scale):
    report = _outcome(
        lambda: jmp.debug_precision(lambda w: jnp.sum(w * w), jnp.ones(3), loss_scale=loss_scale),
        "loss_scale",
    )
    if report is None:
        return
    assert report.loss_scale == float(loss_scale) and _fits_float32(float(loss_scale))


# The cases found by hand, each a silent wrong answer or a raw error before (issue 72).


def test_a_state_of_another_configuration_is_refused_not_silently_read():
    params = {"w": jnp.ones(2)}
    plain = jmp.loss_scaling(optax.sgd(1.0), jmp.StaticLossScale(4.0))
    spiky = jmp.loss_scaling(
        optax.sgd(1.0), jmp.StaticLossScale(4.0), skip_spikes=scaling.SkipSpikes()
    )
    with pytest.raises(
        TypeError, match=r"parts \('SkipRecords', 'SpikeStats'\).*\('SkipRecords',\)"
    ):
        spiky.update(params, plain.init(params), params, value=1.0)
    with pytest.raises(ValueError, match="the inner state"):
        jmp.loss_scaling(optax.adam(1.0), jmp.StaticLossScale(4.0)).update(
            params, plain.init(params), params
        )
    with pytest.raises(
        ValueError, match=r"gradients \(`updates`\).*structure of `init`'s params.*'v'.*'w'"
    ):
        plain.update({"v": jnp.ones(2)}, plain.init(params), params)


def test_complex_parameters_and_gradients_are_refused_with_the_fix():
    tx = jmp.loss_scaling(optax.sgd(1.0), jmp.StaticLossScale(4.0))
    z = {"w": jnp.ones(2, jnp.complex64)}
    with pytest.raises(TypeError, match=r"complex64 at \['w'\].*real and imaginary"):
        tx.init(z)
    state = tx.init({"w": jnp.ones(2)})
    with pytest.raises(TypeError, match=r"`updates`.*complex64"):
        tx.update(z, state)


def test_the_reports_read_a_batched_state_and_say_what_they_need_under_jit():
    tx = jmp.loss_scaling(optax.sgd(1.0), jmp.DynamicLossScale(4.0))
    params = {"w": jnp.ones((3, 2))}
    states = jax.vmap(tx.init)(params)
    grads = {"w": jnp.array([[1.0, 1.0], [jnp.inf, 1.0], [1.0, 1.0]])}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jmp.errors.LossScalingWarning)
        _, states = jax.vmap(tx.update)(grads, states, params)
    reports = jmp.loss_scaling_report(states)
    assert [r.last_step_skipped for r in reports] == [False, True, False]
    assert [r.loss_scale for r in reports] == [4.0, 2.0, 4.0]
    assert reports[1].nonfinite_paths == ("['w']",)
    assert len(scaling.check_loss_scaling(states)) == 3
    with pytest.raises(TypeError, match="cannot run inside `jit`"):
        jax.jit(lambda s: jmp.loss_scaling_report(s).loss_scale)(tx.init({"w": jnp.ones(2)}))
    with pytest.raises(TypeError, match="cannot run inside `jit`"):
        jax.jit(lambda x: jmp.debug_precision(lambda w: jnp.sum(w), x).loss_scale)(jnp.ones(2))


def _linen_model():
    return nn.Dense(2)


def _nnx_model():
    return nnx.Linear(2, 2, rngs=nnx.Rngs(0))


def _eqx_model():
    eqx = pytest.importorskip("equinox")
    return eqx.nn.Linear(2, 2, key=jax.random.key(0))


# Every other public entry point, with the argument a user gets wrong, and what a right
# answer must satisfy (None: any answer, once it is not a raw error, is checked by the
# entry point's own tests).
_ENTRY_POINTS = {
    "autocast(policy=)": ("policy", lambda v: jmp.autocast(jnp.sin, policy=v), None),
    "autocast(fun)": ("fun", lambda v: jmp.autocast(v), None),
    "autocast(allow=)": ("allow", lambda v: jmp.autocast(jnp.sin, allow=v), None),
    "autocast(fp8_scaling=)": ("fp8_scaling", lambda v: jmp.autocast(jnp.sin, fp8_scaling=v), None),
    "full_precision": ("fun", lambda v: jmp.full_precision(v), None),
    "linen.mixed_precision": (
        "policy",
        lambda v: jmp.linen.mixed_precision(_linen_model(), v),
        None,
    ),
    "nnx.mixed_precision": ("policy", lambda v: jmp.nnx.mixed_precision(_nnx_model(), v), None),
    "eqx.mixed_precision": ("policy", lambda v: jmp.eqx.mixed_precision(_eqx_model(), v), None),
    "linen.mixed_precision(overrides=)": (
        "overrides",
        lambda v: jmp.linen.mixed_precision(_linen_model(), "mixed_float16", overrides=v),
        None,
    ),
    "low_precision_optimizer(rounding=)": (
        "rounding",
        lambda v: jmp.low_precision_optimizer(optax.sgd(1.0), v),
        None,
    ),
    "low_precision_optimizer(seed=)": (
        "seed",
        lambda v: jmp.low_precision_optimizer(optax.sgd(1.0), seed=v),
        lambda tx: tx.init({"w": jnp.ones(2, jnp.bfloat16)}) is not None,
    ),
    "check_loss_scaling(max_nonfinite_run=)": (
        "max_nonfinite_run",
        lambda v: scaling.check_loss_scaling(
            jmp.loss_scaling(optax.sgd(1.0), jmp.NoOpLossScale()).init({"w": jnp.ones(1)}), v
        ),
        lambda report: report.applied_steps == 0,
    ),
    "get_loss_scale": ("opt_state", lambda v: jmp.get_loss_scale(v), None),
    "loss_scaling_report": ("opt_state", lambda v: jmp.loss_scaling_report(v), None),
    "value_and_scaled_grad(fun)": ("fun", lambda v: jmp.value_and_scaled_grad(v), None),
    "debug_precision(dtype=)": (
        "dtype",
        lambda v: jmp.debug_precision(lambda w: jnp.sum(w * w), jnp.ones(2), dtype=v),
        lambda report: (
            report.dtype in ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float32")
        ),
    ),
    "select_tree(pred)": (
        "pred",
        lambda v: jmp.select_tree(v, {"a": jnp.ones(1)}, {"a": jnp.zeros(1)}),
        None,
    ),
    "all_finite(axis_name=)": (
        "axis_name",
        lambda v: jmp.all_finite({"a": jnp.ones(2)}, axis_name=v),
        lambda finite: bool(finite),
    ),
    "unless_skipped(opt_state)": ("opt_state", lambda v: jmp.unless_skipped(v, 1.0, 0.0), None),
    "find_loss_scaling_state": ("opt_state", lambda v: scaling.find_loss_scaling_state(v), None),
    "fp8.compute_scale(dtype)": (
        "dtype",
        lambda v: fp8.compute_scale(jnp.float32(2.0), jnp.float32(1.0), v),
        lambda scale: bool(jnp.isfinite(scale)) and float(scale) > 0,
    ),
    "fp8.compute_scale(margin=)": (
        "margin",
        lambda v: fp8.compute_scale(jnp.float32(2.0), jnp.float32(1.0), fp8.E4M3, margin=v),
        lambda scale: bool(jnp.isfinite(scale)) and float(scale) > 0,
    ),
    "fp8.quantize(dtype)": ("dtype", lambda v: fp8.quantize(jnp.ones(4), v, 1.0), None),
    "block_scaled.fake_quantize(mode)": (
        "mode",
        lambda v: jmp.block_scaled.fake_quantize(jnp.ones((4, 32)), (1,), v),
        None,
    ),
    "matmul.dot_general(compute_dtype)": (
        "compute_dtype",
        lambda v: jmp.matmul.dot_general(v),
        None,
    ),
    "low_precision.master_params(opt_state)": (
        "opt_state",
        lambda v: jmp.low_precision.master_params({"w": jnp.ones(2)}, v),
        None,
    ),
    "reports.value_and_grad_with_stats(dtype=)": (
        "dtype",
        lambda v: jmp.reports.value_and_grad_with_stats(jnp.sum, dtype=v),
        None,
    ),
    "eqx.filter_value_and_scaled_grad(fun)": (
        "fun",
        lambda v: jmp.eqx.filter_value_and_scaled_grad(v),
        None,
    ),
    "cast_to_half": (
        None,
        lambda v: jmp.cast_to_half({"v": v}),
        lambda out: True,
    ),
    "DynamicLossScale.adjust": (
        "grads_finite",
        lambda v: jmp.DynamicLossScale(2.0).adjust(v),
        lambda s: float(s.loss_scale) in (1.0, 2.0),
    ),
}


@pytest.mark.parametrize("entry", sorted(_ENTRY_POINTS))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=st.one_of(_ANYTHING, st.just("nonsense")))
def test_every_entry_point_refuses_what_it_cannot_take_by_name(entry, value):
    argument, call, right = _ENTRY_POINTS[entry]
    with warnings.catch_warnings():  # a policy string such as "float16" warns (master weights)
        warnings.simplefilter("ignore", UserWarning)
        result = _outcome(lambda: call(value), argument)
    if result is not None and right is not None:
        assert right(result), (entry, value, result)
