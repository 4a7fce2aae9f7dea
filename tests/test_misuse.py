"""Newcomer mistakes, each caught at its first step with the fix named (docs/mistakes.md).

Each test asserts the exact class of the error or warning and that its text names the fix; the
correct code beside each mistake runs with every warning an error.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

import jmp_policy as jmp

eqx = pytest.importorskip("equinox")

pytestmark = pytest.mark.standard_promotion  # user code: optax's Adam mixes float and int

PARAMS = {"w": jnp.array([0.5, -1.0])}
X = jnp.array([1.0, 2.0])


def _loss(params, x):
    return jnp.sum((params["w"] * x) ** 2)


def _scaled_tx(inner=None):
    return jmp.loss_scaling(inner or optax.sgd(0.1), jmp.DynamicLossScale(2.0**15))


# --- 1. Plain gradients next to loss_scaling --------------------------------------------


def test_plain_gradients_next_to_loss_scaling_warn_at_the_first_step_on_the_users_line():
    tx = _scaled_tx()

    @jax.jit
    def train_step(params, opt_state, x):
        loss, grads = jax.value_and_grad(_loss)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)  # the line the warning names
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = tx.init(PARAMS)
    with pytest.warns(jmp.errors.LossScalingWarning, match="value_and_scaled_grad") as caught:
        params, opt_state, _ = train_step(PARAMS, opt_state, X)
    assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the later steps are quiet
        train_step(params, opt_state, X)


def _flax_layout(tx, value_and_grad):
    """Flax's Linen MNIST layout: gradients computed in one jitted function (`apply_model`),
    applied to a `TrainState` in another (`update_model`); the first epoch's two steps."""
    from flax.training import train_state

    @jax.jit
    def apply_model(state, x):
        return value_and_grad(state, x)

    @jax.jit
    def update_model(state, grads):
        return state.apply_gradients(grads=grads)  # the line the warning names

    def run():
        state = train_state.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
        for _ in range(2):
            _, grads = apply_model(state, X)
            state = update_model(state, grads)
        jax.effects_barrier()  # the first step's callback has run
        return state

    return run


@pytest.fixture
def fresh_process(monkeypatch):
    """What this process has read and said, as in a new one: a loss scale read by another
    test for a state of the same structure would silence the check (docs/mistakes.md)."""
    from jmp_policy._core import validation as _validation
    from jmp_policy._loss_scaling import misuse as _misuse

    monkeypatch.setattr(_misuse, "_SCALES_READ", set())
    monkeypatch.setattr(_validation, "_SAID", set())


@pytest.mark.usefixtures("fresh_process")
def test_plain_gradients_from_another_jitted_function_warn_when_the_first_step_runs():
    plain = lambda state, x: jax.value_and_grad(_loss)(state.params, x)  # noqa: E731
    run = _flax_layout(_scaled_tx(), plain)
    with pytest.warns(jmp.errors.LossScalingWarning, match="value_and_scaled_grad") as caught:
        run()
    assert [w.filename for w in caught] == [__file__]
    assert "computed in another function" in str(caught[0].message)
    # Lowering, eval_shape and make_jaxpr of such an update run nothing: nothing is said.
    tx = _scaled_tx(optax.adam(0.1))
    state = tx.init(PARAMS)
    _no_warning(lambda: jax.jit(tx.update).lower(PARAMS, state, PARAMS))
    _no_warning(lambda: jax.eval_shape(jax.jit(tx.update), PARAMS, state, PARAMS))


@pytest.mark.usefixtures("fresh_process")
def test_scaled_gradients_from_another_jitted_function_are_silent():
    scaled = lambda state, x: jmp.value_and_scaled_grad(_loss)(state, state.params, x)  # noqa: E731
    _no_warning(_flax_layout(_scaled_tx(optax.adam(0.05)), scaled))

    def by_hand(state, x):  # the loss scaled with the state's scale, by hand
        scale = jmp.get_loss_scale(state)
        return jax.value_and_grad(lambda p: scale.scale(_loss(p, x)))(state.params)

    _no_warning(_flax_layout(_scaled_tx(optax.adamw(0.05)), by_hand))


def _no_warning(run):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return run()


def _first_step(tx):
    """The first step of a correct train step with `tx`, as a function to run."""

    @jax.jit
    def step(params, opt_state, x):
        _, grads = jmp.value_and_scaled_grad(_loss)(opt_state, params, x)
        return tx.update(grads, opt_state, params)

    return lambda: step(PARAMS, tx.init(PARAMS), X)


def test_correct_gradients_never_warn_inside_or_outside_the_step():
    # value_and_scaled_grad in the step; in a separate jitted function; jmp-style scaling.
    _no_warning(_first_step(_scaled_tx()))

    tx = _scaled_tx()
    opt_state = tx.init(PARAMS)
    grads = jax.jit(lambda s, p, x: jmp.value_and_scaled_grad(_loss)(s, p, x)[1])(
        opt_state, PARAMS, X
    )
    _no_warning(lambda: jax.jit(tx.update)(grads, opt_state, PARAMS))

    tx = _scaled_tx()
    opt_state = tx.init(PARAMS)
    scaled = lambda p: jmp.get_loss_scale(opt_state).scale(_loss(p, X))  # noqa: E731
    updates, _ = _no_warning(lambda: tx.update(jax.grad(scaled)(PARAMS), opt_state, PARAMS))
    assert np.allclose(updates["w"], -0.1 * jax.grad(_loss)(PARAMS, X)["w"])

    # NoOpLossScale (bfloat16) takes plain gradients: nothing to warn about.
    tx = jmp.loss_scaling(optax.sgd(0.1), jmp.NoOpLossScale())
    _no_warning(lambda: tx.update(jax.grad(_loss)(PARAMS, X), tx.init(PARAMS), PARAMS))


def test_correct_gradients_do_not_warn_under_multisteps_and_shard_map():
    _no_warning(_first_step(optax.MultiSteps(_scaled_tx(), every_k_schedule=2)))

    tx = jmp.loss_scaling(optax.sgd(0.1), jmp.DynamicLossScale(2.0**15), axis_name="data")
    opt_state = tx.init(PARAMS)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))

    def sharded(params, opt_state, x):
        _, grads = jmp.value_and_scaled_grad(_loss)(opt_state, params, x)
        grads = jax.lax.pmean(grads, "data")
        return tx.update(grads, opt_state, params)

    spec = PartitionSpec()
    run = jax.jit(
        jax.shard_map(sharded, mesh=mesh, in_specs=(spec, spec, spec), out_specs=(spec, spec))
    )
    _no_warning(lambda: run(PARAMS, opt_state, X))


def test_equinox_and_nnx_train_steps_do_not_warn_and_their_plain_grads_do():
    model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    loss_fn = lambda m, x: jnp.sum(m(x) ** 2)  # noqa: E731

    def eqx_step(grad):
        tx = _scaled_tx()
        opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))

        @eqx.filter_jit
        def step(model, opt_state, x):
            grads = grad(opt_state, model, x)
            updates, opt_state = tx.update(
                grads, opt_state, eqx.filter(model, eqx.is_inexact_array)
            )
            return eqx.apply_updates(model, updates), opt_state

        return lambda: step(model, opt_state, X)

    _no_warning(eqx_step(lambda s, m, x: jmp.eqx.filter_value_and_scaled_grad(loss_fn)(s, m, x)[1]))
    with pytest.warns(jmp.errors.LossScalingWarning, match="filter_value_and_scaled_grad"):
        eqx_step(lambda s, m, x: eqx.filter_grad(loss_fn)(m, x))()

    def nnx_step(scaled):
        net = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(net, _scaled_tx(), wrt=nnx.Param)

        @nnx.jit
        def step(net, optimizer, x):
            _, grads = _nnx_value_and_grad(loss_fn, scaled)(optimizer, net, x)
            optimizer.update(net, grads)

        return lambda: step(net, optimizer, X)

    _no_warning(nnx_step(scaled=True))
    with pytest.warns(jmp.errors.LossScalingWarning, match="nnx.value_and_grad"):
        nnx_step(scaled=False)()


def _nnx_value_and_grad(loss_fn, scaled):
    """`(optimizer, model, x) -> (loss, grads)`: the scaled-gradient helper's, or (the
    mistake) plain `nnx.value_and_grad`'s."""
    if scaled:
        return jmp.value_and_scaled_grad(loss_fn, grad_fn=nnx.value_and_grad)
    return lambda optimizer, model, x: nnx.value_and_grad(loss_fn)(model, x)


def _plain_step(tx):
    @jax.jit
    def step(params, opt_state, x):
        grads = jax.grad(_loss)(params, x)  # the mistake: the plain loss's gradients
        return tx.update(grads, opt_state, params)

    return step


def test_every_correct_way_to_scale_the_loss_stays_silent():
    # The check reads the traced step: are the gradients computed without the state's scale?
    tx = _scaled_tx()
    opt_state = tx.init(PARAMS)

    @jax.jit
    def by_vjp(params, opt_state, x):  # the loss scale as the cotangent
        loss, pullback = jax.vjp(lambda p: _loss(p, x), params)
        (grads,) = pullback(jmp.get_loss_scale(opt_state).loss_scale)
        return tx.update(grads, opt_state, params)

    @jax.jit
    def by_hand(params, opt_state, x):  # loss times the scale, no `scale()` call
        scale = jmp.get_loss_scale(opt_state).loss_scale
        return tx.update(jax.grad(lambda p: _loss(p, x) * scale)(params), opt_state, params)

    _no_warning(lambda: by_vjp(PARAMS, opt_state, X))
    _no_warning(lambda: by_hand(PARAMS, opt_state, X))

    # inject_hyperparams around a factory that builds loss_scaling (traced again and again).
    factory = optax.inject_hyperparams(
        lambda learning_rate: jmp.loss_scaling(
            optax.sgd(learning_rate), jmp.DynamicLossScale(2.0**15)
        )
    )
    for rate in (0.1, 0.05):
        _no_warning(_first_step(factory(learning_rate=rate)))

    # A compiled scaled-gradient function used by a second optimizer.
    scaled_grads = jax.jit(lambda s, p, x: jmp.value_and_scaled_grad(_loss)(s, p, x)[1])
    for _ in range(2):
        second = _scaled_tx()

        @jax.jit
        def step(params, opt_state, x, tx=second):
            return tx.update(scaled_grads(opt_state, params, x), opt_state, params)

        _no_warning(lambda step=step, tx=second: step(PARAMS, tx.init(PARAMS), X))


def test_tracing_update_alone_is_silent_and_does_not_use_up_the_check():
    tx = _scaled_tx()
    opt_state = tx.init(PARAMS)
    _no_warning(lambda: jax.make_jaxpr(tx.update)(PARAMS, opt_state, PARAMS))
    _no_warning(lambda: jax.jit(tx.update).lower(PARAMS, opt_state, PARAMS))
    _no_warning(lambda: jax.eval_shape(tx.update, PARAMS, opt_state, PARAMS))
    with pytest.warns(jmp.errors.LossScalingWarning, match="value_and_scaled_grad"):
        _plain_step(tx)(PARAMS, opt_state, X)  # the real first step is still checked


def test_plain_gradients_warn_also_after_another_optimizers_correct_steps():
    tx = _scaled_tx()  # built first; then another optimizer scales a loss correctly
    _no_warning(_first_step(_scaled_tx()))
    with pytest.warns(jmp.errors.LossScalingWarning, match="value_and_scaled_grad"):
        _plain_step(tx)(PARAMS, tx.init(PARAMS), X)


# --- 2. The wrong state to tx.update ----------------------------------------------------


def test_the_wrong_state_to_update_is_a_type_error_that_names_the_fix():
    tx = _scaled_tx(optax.adam(1e-3))
    grads = jax.grad(_loss)(PARAMS, X)
    with pytest.raises(TypeError, match=r"inner optimizer's state.*tx\.init\(params\)"):
        tx.update(grads, optax.adam(1e-3).init(PARAMS), PARAMS)
    with pytest.raises(TypeError, match=r"DynamicLossScale \(the loss scale alone.*tx\.init"):
        tx.update(grads, jmp.DynamicLossScale(2.0**15), PARAMS)


# --- 3. The optimizer state left out of value_and_scaled_grad ---------------------------


def test_leaving_out_the_optimizer_state_names_the_missing_argument():
    grad = jmp.value_and_scaled_grad(_loss)
    with pytest.raises(TypeError, match=r"opt_state.*left out"):
        grad(PARAMS, X)


# --- 4. Names that lead somewhere good --------------------------------------------------


@pytest.mark.parametrize("name", ["fp16", "FP16", "bf16_"])
def test_half_precision_names_suggest_the_mixed_policy_first(name):
    with pytest.raises(ValueError, match=r"Did you mean 'mixed_b?float16'\? \(mixed_"):
        jmp.get_policy(name)


@pytest.mark.parametrize("apply", ["linen", "nnx", "eqx"])
def test_a_policy_with_16_bit_parameters_on_a_model_warns_at_the_users_line(apply):
    import flax.linen as nn

    with pytest.warns(UserWarning, match="Did you mean 'mixed_float16'") as caught:
        if apply == "linen":
            jmp.linen.mixed_precision(nn.Dense(2), "f16")
        elif apply == "nnx":
            jmp.nnx.mixed_precision(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "half")
        else:
            jmp.eqx.mixed_precision(eqx.nn.Linear(2, 2, key=jax.random.key(0)), "float16")
    assert caught[0].filename == __file__


@pytest.mark.filterwarnings("ignore::jmp_policy.errors.LossScalingWarning")  # hand-made gradients
def test_the_report_says_when_the_scale_sits_at_its_floor():
    tx = jmp.loss_scaling(optax.sgd(0.1), jmp.DynamicLossScale(4.0, min_loss_scale=1.0))
    opt_state = tx.init(PARAMS)
    bad = {"w": jnp.array([jnp.inf, 1.0])}
    for _ in range(4):
        _, opt_state = tx.update(bad, opt_state, PARAMS)
    report = jmp.loss_scaling_report(opt_state)
    assert report.at_floor and report.skipped_steps == 4
    assert "sits at its floor" in str(report) and "mixed_float16" in str(report)


def test_the_half_master_weights_warning_names_the_users_line():
    half = jax.tree.map(lambda x: x.astype(jnp.float16), PARAMS)
    with pytest.warns(UserWarning, match="half precision") as caught:
        _scaled_tx().init(half)
    assert caught[0].filename == __file__


# --- 5. Equinox -------------------------------------------------------------------------


def test_the_equinox_wrapper_reads_the_models_attributes_and_rewraps_with_the_new_policy():
    mlp = eqx.nn.MLP(2, 1, 8, 2, key=jax.random.key(0))
    model = jmp.eqx.mixed_precision(mlp, "mixed_float16")
    assert model.layers is model.model.layers and model.depth == 2
    with pytest.raises(AttributeError):
        model.no_such_field  # noqa: B018
    again = jmp.eqx.mixed_precision(model, "mixed_bfloat16")
    assert type(again.model) is eqx.nn.MLP  # one wrapper, not two
    assert again.policy == jmp.get_policy("mixed_bfloat16")
    assert jmp.precision_report(again, jnp.ones(2)).counts["dot_general"] == {"bfloat16": 3}


def test_one_mistake_one_message():
    """The policy 'float16' given to a model, then its float16 parameters to `tx.init`: one
    warning, in `get_policy`'s form, not one from each place that sees it."""
    import flax.linen as nn

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = jmp.linen.mixed_precision(nn.Dense(4), "float16")
        params = model.init(jax.random.key(0), jnp.ones((2, 3)))["params"]
        jmp.loss_scaling(optax.adam(1e-3), jmp.DynamicLossScale(2.0**15)).init(params)
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(said) == 1, said
    assert said[0].startswith("Expected float32 parameters (master weights)")
    assert "Did you mean 'mixed_float16'?" in said[0]
    assert "skips most steps" not in said[0]  # no prediction of skips that do not come


@pytest.mark.standard_promotion  # optax's Adam mixes float and int
@pytest.mark.parametrize("layout", ["optax step", "TrainState"])
def test_half_parameters_at_update_warn_once_at_the_first_step(layout):
    """Parameters cast to float16 after `tx.init` (the whole tree cast to the compute dtype):
    the first `update` says so, once; the master weights would be float16 from then on."""
    from flax.training import train_state

    tx = jmp.loss_scaling(optax.adam(1e-3), jmp.DynamicLossScale(2.0**15))
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    half = jax.tree.map(lambda p: p.astype(jnp.float16), params)
    scale = jmp.get_loss_scale(tx.init(params)).loss_scale  # gradients of the scaled loss
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.5 * scale, p.dtype), params)
    if layout == "optax step":
        opt_state = tx.init(params)

        @jax.jit
        def step(params, opt_state, grads):
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        run = lambda: step(half, opt_state, grads)  # noqa: E731
    else:
        state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
        state = state.replace(params=half)
        run = lambda: jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, grads)  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
        run()
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(said) == 1, said
    assert "Expected float32 parameters (master weights) for loss_scaling's `update`" in said[0]
    assert "['w'] (float16)" in said[0] and "cast_to_compute" in said[0]


def test_half_parameters_with_low_precision_optimizer_are_meant():
    tx = jmp.loss_scaling(
        jmp.low_precision_optimizer(optax.sgd(0.1), "stochastic"), jmp.DynamicLossScale(2.0**15)
    )
    params = {"w": jnp.ones(4, jnp.bfloat16)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt_state = tx.init(params)
        tx.update({"w": jnp.full(4, 2.0**14, jnp.bfloat16)}, opt_state, params)


@pytest.mark.usefixtures("fresh_process")
def test_nnx_gradients_from_another_nnx_jit_warn_unless_scaled():
    """NNX in the same layout: gradients from one `nnx.jit`, `optimizer.update` in another."""

    def loss_fn(model, x):
        return jnp.mean(model(x) ** 2)

    def run(scaled):
        model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, _scaled_tx(), wrt=nnx.Param)

        @nnx.jit
        def grads_of(optimizer, model, x):
            return _nnx_value_and_grad(loss_fn, scaled)(optimizer, model, x)

        @nnx.jit
        def apply(optimizer, model, grads):
            optimizer.update(model, grads)  # the line the warning names

        for _ in range(2):
            apply(optimizer, model, grads_of(optimizer, model, X[None])[1])
        jax.effects_barrier()

    from jmp_policy._core import validation as _validation
    from jmp_policy._loss_scaling import misuse as _misuse

    _no_warning(lambda: run(scaled=True))
    # A new process: in this one the helper has read a scale of a state of this structure,
    # and the check would take plain gradients for scaled ones (docs/mistakes.md says so).
    _misuse._SCALES_READ.clear()
    _validation._SAID.clear()
    with pytest.warns(
        jmp.errors.LossScalingWarning, match="computed in another function"
    ) as caught:
        run(scaled=False)
    assert [w.filename for w in caught] == [__file__]
