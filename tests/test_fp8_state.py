"""`mixed_float8` with delayed scaling through every integration: the state as model state
(its gradient its next value, written by `loss_scaling`), against the explicit route of
`fp8_dot_general_delayed`, kept on skipped steps, through `scan`, `cond`, `vmap` and orbax."""

from __future__ import annotations

import functools

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_policy as jmp
from jmp_policy.fp8 import DelayedScaling, Fp8DotState, fp8_dot_general_delayed, next_state

# optax.adam mixes float and int32 in its bias correction.
# Toy models whose last matmul is meant to multiply in float8: the warning that names such a
# head (the logits head, by structure) is asserted in tests/test_float8_reports.py.
_HEAD_IN_LOW_PRECISION = pytest.mark.filterwarnings(
    "ignore:jmp_policy. .* is the last matmul before the output:jmp_policy.errors.PrecisionWarning"
)
pytestmark = [pytest.mark.standard_promotion, _HEAD_IN_LOW_PRECISION]

RECIPE = DelayedScaling(history_length=8)
MATMUL = (((1,), (0,)), ((), ()))
BF16 = jnp.bfloat16


def _data(seed=0, batch=32):
    x = jax.random.normal(jax.random.key(100 + seed), (batch, 64))
    w = jax.random.normal(jax.random.key(200 + seed), (64, 16)) / 8
    return x, jnp.argmax(jnp.tanh(x) @ w, -1)  # a task the MLP can learn


def _states(tree):
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, Fp8DotState))


def _only_states(tree):
    return [s for s in _states(tree) if isinstance(s, Fp8DotState)]


# The four integrations, each: (make(scaling) -> (trainable, loss(trainable, x, y)), step).


def _linen(scaling, seed=0):
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(128)(x))
            x = nn.relu(nn.Dense(64)(x))
            return nn.Dense(16, name="head")(x)

    model = jmp.linen.mixed_precision(MLP(), "mixed_float8", fp8_scaling=scaling)
    variables = model.init(jax.random.key(seed), _data()[0])

    def loss(v, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(v, x), y).mean()

    return variables, loss


def _autocast(scaling, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    params = {
        "w1": jax.random.normal(keys[0], (64, 128)) / 8,
        "w2": jax.random.normal(keys[1], (128, 64)) / 11,
        "head": jax.random.normal(keys[2], (64, 16)) / 8,
    }

    def mlp(p, x):
        h = jax.nn.relu(jax.nn.relu(x @ p["w1"]) @ p["w2"])
        return h @ p["head"]

    f = jmp.autocast(mlp, "mixed_float8", fp8_scaling=scaling, fp8_exclude=())
    if not isinstance(scaling, DelayedScaling):
        trainable = {"params": params}
        call = lambda t, x: f(t["params"], x)  # noqa: E731
    else:
        trainable = {"params": params, "fp8_state": f.init_fp8_state(params, _data()[0])}
        call = lambda t, x: f(t["params"], x, fp8_state=t["fp8_state"])  # noqa: E731

    def loss(t, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(call(t, x), y).mean()

    return trainable, loss


class _Tokens(eqx.Module):
    """Equinox's way: a layer written for one example, mapped over the batch inside."""

    mlp: eqx.nn.MLP

    def __call__(self, x):
        return jax.vmap(self.mlp)(x)


def _equinox(scaling, seed=0):
    net = _Tokens(eqx.nn.MLP(64, 16, 128, 2, key=jax.random.key(seed)))
    model = jmp.eqx.mixed_precision(net, "mixed_float8", fp8_scaling=scaling)
    if isinstance(scaling, DelayedScaling):
        model = model.init_fp8_state(_data()[0])

    def loss(m, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

    return model, loss


def _train(make, scaling, steps=30, seed=0, scale=None, batches=None):
    trainable, loss = make(scaling, seed)
    tx = jmp.loss_scaling(optax.adam(3e-3), scale or jmp.NoOpLossScale())
    params = eqx.filter(trainable, eqx.is_array)
    opt_state = tx.init(params)

    @eqx.filter_jit
    def step(trainable, opt_state, x, y):
        s = jmp.get_loss_scale(opt_state)
        value, grads = eqx.filter_value_and_grad(lambda t: s.scale(loss(t, x, y)))(trainable)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(trainable, eqx.is_array))
        return eqx.apply_updates(trainable, updates), opt_state, s.unscale(value)

    losses, states = [], []
    for i in range(steps):
        x, y = _data(seed) if batches is None else batches(i)
        trainable, opt_state, value = step(trainable, opt_state, x, y)
        losses.append(float(value))
        states.append(trainable)
    return losses, states, opt_state


def _nnx_train(scaling, steps=30, seed=0):
    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(64, 128, rngs=rngs)
            self.l2 = nnx.Linear(128, 64, rngs=rngs)
            self.head = nnx.Linear(64, 16, rngs=rngs)

        def __call__(self, x):
            return self.head(nnx.relu(self.l2(nnx.relu(self.l1(x)))))

    model = jmp.nnx.mixed_precision(MLP(nnx.Rngs(seed)), "mixed_float8", fp8_scaling=scaling)
    optimizer = nnx.Optimizer(
        model, jmp.loss_scaling(optax.adam(3e-3), jmp.NoOpLossScale()), wrt=nnx.Param
    )

    @nnx.jit
    def step(model, optimizer, x, y):
        def loss(m):
            return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value

    x, y = _data(seed)
    losses = [float(step(model, optimizer, x, y)) for _ in range(steps)]
    return losses, model


@pytest.mark.parametrize("integration", ["autocast", "linen", "nnx", "equinox"])
def test_every_integration_trains_with_delayed_scaling(integration):
    """30 steps of the same model under `mixed_float8`, current and delayed scaling: the
    delayed run learns as the current one does (final losses within 2% of the first), and
    every float8 layer's state moved (scales from its amaxes, histories filled)."""
    finals, first = {}, {}
    for name, scaling in (("current", "tensorwise"), ("delayed", RECIPE)):
        if integration == "nnx":
            losses, model = _nnx_train(scaling)
            states = [v.get_value() for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)]
            states = [s for s in states if isinstance(s, Fp8DotState)]
        else:
            make = {"autocast": _autocast, "linen": _linen, "equinox": _equinox}[integration]
            losses, trained, _ = _train(make, scaling)
            states = _only_states(trained[-1])
        finals[name], first[name] = losses[-1], losses[0]
        assert losses[-1] < 0.5 * losses[0], (name, losses[0], losses[-1])
        if name == "delayed":
            assert len(states) >= 2  # the two hidden layers (the head: N = 16, eligible too)
            for s in states:
                for meta in (s.lhs, s.rhs, s.grad):
                    assert np.all(np.isfinite(meta.scale)) and np.all(meta.scale > 1.0)
                    assert np.all(meta.amax_history.max(-1) > 0)
                assert np.all(s.grad_amax == 0)  # the count slot is reset on every write
        else:
            assert not states
    # The same curve to within 2% of where it started (both end near 0).
    assert abs(finals["delayed"] - finals["current"]) < 0.02 * first["current"], finals


def test_the_written_state_is_the_explicit_routes_next_state():
    """autocast's state after one step equals `fp8_dot_general_delayed` + `next_state` on the
    same operands (to within float32 rounding of `apply_updates`), three steps."""
    keys = jax.random.split(jax.random.key(3), 3)
    w1 = jax.random.normal(keys[0], (64, 64)) / 8
    w2 = jax.random.normal(keys[1], (64, 32)) / 8
    x = jax.random.normal(keys[2], (16, 64)) * 3

    def f(params, x):
        return jnp.sum((jnp.tanh(x @ params[0]) @ params[1]) ** 2)

    g = jmp.autocast(f, "mixed_float8", fp8_scaling=RECIPE, fp8_exclude=())
    trainable = {"params": (w1, w2), "fp8_state": g.init_fp8_state((w1, w2), x)}
    explicit = (RECIPE.init(), RECIPE.init())
    tx = jmp.loss_scaling(optax.sgd(0.0), jmp.NoOpLossScale())
    opt_state = tx.init(trainable)

    def by_hand(states, x):
        # A float8 matmul takes its operands in the dtypes they come in (quantized from them).
        h, s1 = fp8_dot_general_delayed(x, w1, MATMUL, states[0], RECIPE, out_dtype=BF16)
        out, s2 = fp8_dot_general_delayed(
            jnp.tanh(h), w2, MATMUL, states[1], RECIPE, out_dtype=BF16
        )
        return jnp.sum(out.astype(jnp.float32) ** 2), (s1, s2)

    for step in range(3):
        xs = x * (step + 1)
        grads = jax.grad(lambda t, xs=xs: g(t["params"], xs, fp8_state=t["fp8_state"]))(trainable)
        updates, opt_state = tx.update(grads, opt_state, trainable)
        trainable = optax.apply_updates(trainable, updates)
        state_grads, new = jax.grad(by_hand, has_aux=True)(explicit, xs)
        explicit = next_state(new, state_grads, RECIPE)
        for ours, theirs in zip(trainable["fp8_state"], explicit, strict=True):
            for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-6)
    assert float(explicit[0].lhs.amax_history.max()) > 0


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_a_skipped_step_keeps_every_fp8_state_bit_for_bit(bad):
    """A NaN or inf batch under a dynamic loss scale: the step is skipped and the Linen
    model's float8 state is what it was, bit for bit; the next clean step writes it again."""
    x, y = _data()

    def batches(i):
        return (x.at[0, 0].set(bad), y) if i == 3 else (x, y)

    _, states, opt_state = _train(
        _linen, RECIPE, steps=5, scale=jmp.DynamicLossScale(2.0**10), batches=batches
    )
    assert int(jmp.scaling.find_loss_scaling_state(opt_state).skipped_steps) == 1
    before, skipped, after = (_only_states(states[i]["fp8_state"]) for i in (2, 3, 4))
    for b, s in zip(before, skipped, strict=True):
        jax.tree.map(np.testing.assert_array_equal, b, s)
    assert any(
        not np.array_equal(b.lhs.amax_history, a.lhs.amax_history)
        for b, a in zip(before, after, strict=True)
    )


def test_stacked_states_under_scan_and_an_untaken_branch_is_kept():
    """A `lax.scan` over 3 layers has one state per layer (stacked); a matmul in a `cond`
    branch that does not run this step keeps its state (count 0)."""

    def f(params, x, use_extra):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, params["stack"])
        return jnp.sum(
            jax.lax.cond(use_extra, lambda h: h @ params["extra"], lambda h: h * 2.0, h) ** 2
        )

    keys = jax.random.split(jax.random.key(0), 3)
    params = {
        "stack": jax.random.normal(keys[0], (3, 64, 64)) / 8 * jnp.arange(1, 4)[:, None, None],
        "extra": jax.random.normal(keys[1], (64, 64)) / 8,
    }
    x = jax.random.normal(keys[2], (16, 64))
    g = jmp.autocast(f, "mixed_float8", fp8_scaling=RECIPE)
    state = g.init_fp8_state(params, x, True)
    assert state[0][0].rhs.scale.shape == (3,) and isinstance(state[1], Fp8DotState)
    trainable = {"params": params, "fp8_state": state}
    tx = jmp.loss_scaling(optax.sgd(1e-3), jmp.NoOpLossScale())
    opt_state = tx.init(trainable)

    @jax.jit
    def step(trainable, opt_state, use_extra):
        grads = jax.grad(lambda t: g(t["params"], x, use_extra, fp8_state=t["fp8_state"]))(
            trainable
        )
        updates, opt_state = tx.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state

    trainable, opt_state = step(trainable, opt_state, False)
    stacked, extra = trainable["fp8_state"]
    kernels = stacked[0].rhs.amax_history[:, 0]
    assert len(set(np.asarray(kernels).tolist())) == 3  # each layer its own amax
    jax.tree.map(np.testing.assert_array_equal, extra, RECIPE.init())  # not run: kept
    trainable, opt_state = step(trainable, opt_state, True)
    assert float(trainable["fp8_state"][1].rhs.amax_history[0]) > 0


def test_under_vmap_a_shared_state_records_the_mean_of_the_examples_amaxes():
    """Documented: a model mapped over examples with `jax.vmap` shares one state; its
    history records the mean of the examples' amaxes (JAX sums the state's gradient over
    the examples, and the count divides it), not their max."""
    w = jax.random.normal(jax.random.key(0), (64, 32)) / 8
    xs = (
        jax.random.normal(jax.random.key(1), (4, 16, 64))
        * jnp.array([1.0, 2.0, 3.0, 4.0])[:, None, None]
    )
    g = jmp.autocast(lambda w, x: x @ w, "mixed_float8", fp8_scaling=RECIPE, fp8_exclude=())
    state = g.init_fp8_state(w, xs[0])
    tx = jmp.loss_scaling(optax.sgd(0.0), jmp.NoOpLossScale())
    trainable = {"w": w, "fp8_state": state}

    def loss(t):
        return jnp.sum(jax.vmap(lambda x: g(t["w"], x, fp8_state=t["fp8_state"]))(xs) ** 2)

    grads = jax.grad(loss)(trainable)
    updates, _ = tx.update(grads, tx.init(trainable), trainable)
    written = optax.apply_updates(trainable, updates)["fp8_state"][0]
    amaxes = jnp.abs(xs).max(axis=(1, 2))
    np.testing.assert_allclose(written.lhs.amax_history[0], amaxes.mean(), rtol=1e-6)
    assert float(written.lhs.amax_history[0]) < 0.7 * float(amaxes.max())
    np.testing.assert_allclose(written.rhs.amax_history[0], jnp.abs(w).max(), rtol=1e-6)


def test_linen_fp8_state_and_optimizer_state_round_trip_through_orbax(tmp_path):
    """The Linen variables (params and `"fp8_state"`) and the optimizer state saved after 3
    steps (of a jitted step that donates them), restored, and trained 2 more steps: the same as
    training on without a restore."""
    import orbax.checkpoint as ocp

    x, y = _data()
    variables, loss = _linen(RECIPE)
    tx = jmp.loss_scaling(optax.adam(3e-3), jmp.DynamicLossScale(2.0**8))
    opt_state = tx.init(variables)

    @functools.partial(jax.jit, donate_argnums=(0, 1))  # the state's buffers donated too
    def step(variables, opt_state):
        s = jmp.get_loss_scale(opt_state)
        grads = jax.grad(lambda v: s.scale(loss(v, x, y)))(variables)
        updates, opt_state = tx.update(grads, opt_state, variables)
        return optax.apply_updates(variables, updates), opt_state

    for _ in range(3):
        variables, opt_state = step(variables, opt_state)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "run", {"variables": variables, "opt_state": opt_state})
    target = jax.tree.map(
        ocp.utils.to_shape_dtype_struct, {"variables": variables, "opt_state": opt_state}
    )
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(tmp_path / "run", target)
    assert isinstance(restored["variables"]["fp8_state"]["Dense_0"]["matmul"], Fp8DotState)
    resumed = (restored["variables"], restored["opt_state"])
    for _ in range(2):
        variables, opt_state = step(variables, opt_state)
        resumed = step(*resumed)
    jax.tree.map(np.testing.assert_array_equal, resumed[0], variables)


def test_delayed_scaling_is_checked_when_built_and_called():
    x = jnp.ones((8, 64))
    with pytest.raises(ValueError, match="fp8_scaling.*'delayed'"):
        jmp.autocast(lambda a: a, "mixed_float8", fp8_scaling="later")
    with pytest.raises(ValueError, match="block-scaled"):
        jmp.autocast(lambda a: a, "mixed_mxfp8", fp8_scaling=RECIPE)
    with pytest.raises(ValueError, match="rowwise"):
        jmp.linen.mixed_precision(nn.Dense(64), "mixed_float8", fp8_scaling="rowwise")
    g = jmp.autocast(lambda w, x: x @ w, "mixed_float8", fp8_scaling="delayed", fp8_exclude=())
    w = jnp.ones((64, 64))
    with pytest.raises(ValueError, match="fp8_state.*init_fp8_state"):
        g(w, x)
    state = g.init_fp8_state(w, x)
    with pytest.raises(ValueError, match="fp8_state.*holds 2 entries.*1"):
        g(w, x, fp8_state=(*state, *state))
    with pytest.raises(ValueError, match="no state"):
        jmp.autocast(lambda a: a, "mixed_float8").init_fp8_state(x)  # pyright: ignore
    model = jmp.linen.mixed_precision(nn.Dense(64), "mixed_float8", fp8_scaling="delayed")
    variables = model.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="'fp8_state' collection"):
        model.apply({"params": variables["params"]}, x)
    unstated = jmp.eqx.mixed_precision(
        _Tokens(eqx.nn.MLP(64, 16, 64, 1, key=jax.random.key(0))), "mixed_float8",
        fp8_scaling="delayed",
    )  # fmt: skip
    with pytest.raises(ValueError, match="init_fp8_state"):
        unstated(x)
    tx = jmp.loss_scaling(optax.sgd(0.1), jmp.NoOpLossScale())
    grads = jax.grad(lambda v: jnp.sum(model.apply(v, x)))(variables)
    with pytest.raises(ValueError, match="`params`"):
        tx.update(grads, tx.init(variables))


def test_linen_nn_scan_stacks_the_state_with_the_parameters():
    """Under `nn.scan` with `variable_axes={"params": 0, "fp8_state": 0}` (docs/fp8.md) each
    scanned layer keeps its own state, and each is written from its own layer's amaxes."""

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return x + nn.Dense(64)(jax.nn.relu(nn.Dense(128)(x))), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            scanned = nn.scan(
                Block,
                variable_axes={"params": 0, "fp8_state": 0},
                split_rngs={"params": True},
                length=3,
            )
            x, _ = scanned()(x, None)
            return nn.Dense(16, name="head")(x)

    x, y = _data()
    model = jmp.linen.mixed_precision(Stack(), "mixed_float8", fp8_scaling=RECIPE)
    variables = model.init(jax.random.key(0), x)
    tx = jmp.loss_scaling(optax.adam(1e-3), jmp.NoOpLossScale())
    opt_state = tx.init(variables)

    def loss(v):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(v, x), y).mean()

    @jax.jit  # one program, not each operation compiled on its own
    def step(variables, opt_state):
        updates, _ = tx.update(jax.grad(loss)(variables), opt_state, variables)
        return optax.apply_updates(variables, updates)

    variables = step(variables, opt_state)
    stacked = _only_states(variables["fp8_state"]["ScanBlock_0"])
    assert len(stacked) == 2 and stacked[0].lhs.scale.shape == (3,)
    for state in stacked:
        activations = np.asarray(state.lhs.amax_history[:, 0])
        assert np.all(activations > 0) and len(set(activations.tolist())) == 3  # per layer
