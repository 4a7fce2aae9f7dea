"""Every state of the library is data: any tree_map rebuilds it, checkpoints restore it.

Equinox (`filter_jit` maps every leaf to a bool), sharding helpers (`PartitionSpec`),
checkpoint code (`ShapeDtypeStruct`, None) and users' own masks rebuild states from trees of
other things; only a user's construction is validated.
"""

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec

import jmp_policy as jmp
from jmp_policy.fp8 import DelayedScaling

PARAMS = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}


def _states():
    """One of each state class the library hands users, built as users build them."""
    scaled = jmp.loss_scaling(
        optax.adam(1e-3),
        jmp.DynamicLossScale(2.0**15),
        stats_every=5,
        skip_spikes=jmp.scaling.SkipSpikes(),
    )
    loss_scaling_state = scaled.init(PARAMS)
    with jax.numpy_dtype_promotion("standard"):
        low = jmp.low_precision_optimizer(optax.adamw(1e-3), "kahan").init(PARAMS)
    f = jmp.reports.value_and_grad_with_stats(lambda p: jnp.sum(p["w"] ** 2))
    _, _, precision_stats = jax.jit(f)(PARAMS)
    return {
        "NoOpLossScale": jmp.NoOpLossScale(),
        "StaticLossScale": jmp.StaticLossScale(2.0**10),
        "DynamicLossScale": jmp.DynamicLossScale(2.0**15),
        "DynamicLossScale(hysteresis, warmup)": jmp.DynamicLossScale(
            2.0**8, hysteresis=2, warmup=True
        ),
        "LossScalingState": loss_scaling_state,
        "LeafFlags": loss_scaling_state.nonfinite_leaves,
        "GradientStats": loss_scaling_state.gradient_stats,
        "SpikeStats": loss_scaling_state.spike_stats,
        "LowPrecisionState": low,
        "Fp8DotState": DelayedScaling(history_length=4).init(),
        "Fp8Meta": DelayedScaling(history_length=4).init().lhs,
        "PrecisionStats": precision_stats,
    }


STATES = _states()
NAMES = sorted(STATES)

LEAF_VALUES = st.one_of(
    st.booleans(),
    st.none(),
    st.integers(-5, 5),
    st.text(max_size=3),
    st.just(PartitionSpec()),
    st.just(PartitionSpec("data")),
    st.builds(object),
    st.just(jax.ShapeDtypeStruct((2,), jnp.float32)),
)


def test_every_state_class_is_covered():
    # A new state class must be added here: the list names what is promised.
    covered = {type(s).__name__ for s in STATES.values()}
    for name in ("LeafFlags", "Fp8Meta", "Fp8DotState", "PrecisionStats", "GradientStats"):
        assert name in covered
    assert type(STATES["LowPrecisionState"]).__name__ == "LowPrecisionState"


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(NAMES), values=st.lists(LEAF_VALUES, min_size=1, max_size=4))
def test_any_tree_map_rebuilds_every_state(name, values):
    state = STATES[name]
    picks = iter(values * 1000)
    mapped = jax.tree.map(lambda _: next(picks), state)
    assert type(mapped) is type(state)
    if not any(v is None for v in values):
        assert jax.tree.structure(mapped) == jax.tree.structure(state)
        # Back again: the mapped tree's structure takes the arrays as well.
        restored = jax.tree.map(lambda _, x: x, mapped, state)
        assert jax.tree.structure(restored) == jax.tree.structure(state)


@pytest.mark.parametrize("name", NAMES)
def test_every_state_maps_to_bools_specs_and_partition_specs(name):
    state = STATES[name]
    treedef = jax.tree.structure(state)
    for f in (
        lambda x: isinstance(x, jax.Array),
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
        lambda x: PartitionSpec(),
        lambda x: object(),
    ):
        assert jax.tree.structure(jax.tree.map(f, state)) == treedef
    assert type(jax.tree.map(lambda x: None, state)) is type(state)
    jax.eval_shape(lambda s: s, state)
    # Batched and stacked, as ensembles use them.
    stacked = jax.tree.map(lambda *x: jnp.stack(x), state, state)
    assert jax.tree.structure(stacked) == treedef


def test_construction_is_still_validated():
    with pytest.raises(TypeError, match="loss_scale"):
        jmp.DynamicLossScale(True)
    with pytest.raises(ValueError, match="factor"):
        jmp.DynamicLossScale(2.0**15, factor=0.5)
    # ... but a rebuilt state is not: bools in every leaf.
    bools = jax.tree.map(lambda x: True, jmp.DynamicLossScale(2.0**15))
    assert bools.loss_scale is True and bools.counter is True


def _bumped(state):
    """The state with every numeric leaf changed, so a round trip cannot pass by accident."""

    def bump(x):
        if jnp.issubdtype(x.dtype, jnp.bool_):
            return ~x
        if jnp.issubdtype(x.dtype, jnp.number):
            return x + jnp.ones_like(x)
        return x  # PRNG keys

    return jax.tree.map(bump, state)


@pytest.mark.parametrize("name", NAMES)
def test_every_state_round_trips_through_flax_serialization(name):
    state = STATES[name]
    changed = _bumped(state)
    restored = flax.serialization.from_bytes(state, flax.serialization.to_bytes(changed))
    assert type(restored) is type(state)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(changed), strict=True):
        np.testing.assert_array_equal(
            np.asarray(jax.random.key_data(a) if _is_key(a) else a),
            np.asarray(jax.random.key_data(b) if _is_key(b) else b),
        )


def _is_key(x):
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def test_every_state_round_trips_through_an_orbax_checkpoint(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    # One checkpoint holds them all; the states without leaves ride along.
    tree = {name.replace(" ", "_").replace(",", ""): _bumped(s) for name, s in STATES.items()}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "states", tree)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(tmp_path / "states", abstract)
    for key, state in tree.items():
        assert type(restored[key]) is type(state), key
        assert jax.tree.structure(restored[key]) == jax.tree.structure(state), key
        for a, b in zip(jax.tree.leaves(restored[key]), jax.tree.leaves(state), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
