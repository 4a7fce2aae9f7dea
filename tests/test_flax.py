"""Tests for jmp_policy.linen and jmp_policy.nnx on unmodified Flax models."""

import re

import chex
import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from models import CNN, Classifier, NNXClassifier, widened_on_cpu

import jmp_policy as jmp
from jmp_policy._core.compat import jaxprs_in_params
from jmp_policy._reports.census import MATMULS, compute_dtype, iter_equations, report_of_jaxpr

# Third-party code that mixes dtypes internally runs under JAX's standard
# promotion (conftest.py): optax's Adam bias correction (int32 and float), and
# Flax's LayerNorm in bfloat16, BatchNorm in inference mode and lifted
# transforms (weak and strong types).
third_party_promotion = pytest.mark.standard_promotion

HALF_POLICIES = ["mixed_float16", "mixed_bfloat16"]
F32 = jnp.dtype("float32")


def _floating_outputs(eqn):
    return [v.aval.dtype for v in eqn.outvars if jnp.issubdtype(v.aval.dtype, jnp.floating)]


def check_program(forward, backward, half, in_island, label):
    """Every matmul outside the islands in `half`, forward and backward; every
    forward op inside an island in float32.

    (Backward ops carry the name of the forward op they differentiate, so the
    backward pass is checked by its matmuls only.)
    """
    matmuls = island_ops = 0
    for jaxpr, is_forward in ((forward, True), (backward, False)):
        for eqn in iter_equations(jaxpr):
            island = in_island(eqn)
            if eqn.primitive.name in MATMULS:
                operands = {v.aval.dtype for v in eqn.invars}
                if not is_forward and not island and widened_on_cpu(eqn, half):
                    operands = {half}  # exact bfloat16 values, widened for XLA:CPU
                assert operands == ({F32} if island else {half}), (label, eqn)
                matmuls += 1
            floating = compute_dtype(eqn) is not None
            if is_forward and island and floating and eqn.primitive.name != "convert_element_type":
                assert set(_floating_outputs(eqn)) <= {F32}, (label, eqn)
                island_ops += 1
    print(f"\n{label} forward: {report_of_jaxpr(forward)}")
    print(f"{label} forward+backward: {report_of_jaxpr(backward)}")
    assert matmuls and island_ops


def linen_island(names):
    pattern = re.compile("|".join(names))
    return lambda eqn: bool(pattern.search(str(eqn.source_info.name_stack)))


def nnx_island(eqn):
    # NNX pushes no name scopes: attribute by the source file of the layer.
    tb = eqn.source_info.traceback
    return tb is not None and any(
        f.file_name.endswith("nnx/nn/normalization.py") for f in tb.frames
    )


LINEN_CASES = {
    "cnn": (CNN(), lambda: jnp.ones((2, 8, 8, 3)), ["BatchNorm_"]),
    "block": (Classifier(), lambda: jnp.ones((2, 5, 16)), ["LayerNorm_"]),
}


@pytest.mark.parametrize("name", HALF_POLICIES)
@pytest.mark.parametrize("case", sorted(LINEN_CASES))
def test_linen_program(case, name):
    model, make_x, islands = LINEN_CASES[case]
    policy = jmp.get_policy(name)
    overrides = {**jmp.linen.NORMS_IN_FLOAT32, "head": jmp.get_policy("float32")}
    mixed = jmp.linen.mixed_precision(model, policy, overrides)
    x = make_x()
    variables = mixed.init(jax.random.key(0), x)
    mutable = ["batch_stats"] if "batch_stats" in variables else False

    def loss(params, x):
        out = mixed.apply({**variables, "params": params}, x, mutable=mutable)
        logits = out[0] if mutable else out
        assert logits.dtype == policy.output_dtype
        return logits.sum()

    forward = jax.make_jaxpr(loss)(variables["params"], x)
    backward = jax.make_jaxpr(jax.value_and_grad(loss))(variables["params"], x)
    in_island = linen_island([*islands, "/head"])
    check_program(forward, backward, policy.compute_dtype, in_island, f"linen {case} {name}")
    grads = jax.grad(loss)(variables["params"], x)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {policy.param_dtype}
    assert {p.dtype for p in jax.tree.leaves(variables["params"])} == {policy.param_dtype}


@pytest.mark.parametrize("name", HALF_POLICIES)
def test_nnx_program(name):
    policy = jmp.get_policy(name)
    model = jmp.nnx.mixed_precision(NNXClassifier(rngs=nnx.Rngs(0)), policy)
    x = jnp.ones((2, 5, 16))

    def loss(model, x):
        out = model(x)
        assert out.dtype == policy.output_dtype
        return out.sum()

    graphdef, params = nnx.split(model)

    def pure_loss(p, x):
        return loss(nnx.merge(graphdef, p), x)

    forward = jax.make_jaxpr(pure_loss)(params, x)
    backward = jax.make_jaxpr(jax.value_and_grad(pure_loss))(params, x)
    check_program(forward, backward, policy.compute_dtype, nnx_island, f"nnx block {name}")
    grads = nnx.grad(loss)(model, x)
    assert {g.dtype for g in jax.tree.leaves(nnx.state(grads))} == {policy.param_dtype}
    assert nnx.jit(loss)(model, x).dtype == policy.output_dtype


@third_party_promotion
def test_batch_stats_stay_float32_and_match_a_float32_reference():
    policy = jmp.get_policy("mixed_float16")
    model = CNN()
    mixed = jmp.linen.mixed_precision(model, policy)
    x = jax.random.normal(jax.random.key(1), (16, 8, 8, 3))
    y = jax.random.randint(jax.random.key(2), (16,), 0, 4)
    variables = mixed.init(jax.random.key(0), x)
    state = train_state.TrainState.create(
        apply_fn=mixed.apply,
        params=variables["params"],
        tx=jmp.loss_scaling(optax.adam(1e-2), jmp.DynamicLossScale(2.0**15)),
    )
    is_conv = lambda mdl, method: isinstance(mdl, nn.Conv)  # noqa: E731

    @jax.jit
    def step(state, batch_stats, x):
        scale = jmp.get_loss_scale(state)

        def loss_fn(params):
            logits, updates = state.apply_fn(
                {"params": params, "batch_stats": batch_stats},
                x,
                mutable=["batch_stats", "intermediates"],
                capture_intermediates=is_conv,
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return scale.scale(loss), updates

        grads, updates = jax.grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), updates["batch_stats"], updates["intermediates"]

    stats = variables["batch_stats"]
    reference = jax.tree.map(lambda s: np.asarray(s, np.float32), stats)
    for i in range(20):
        state, stats, inter = step(state, stats, jax.random.normal(jax.random.key(10 + i), x.shape))
        for layer in ("0", "1"):
            # BatchNorm_k normalises Conv_k's half-precision output.
            conv_out = np.asarray(inter[f"Conv_{layer}"]["__call__"][0], np.float32)
            mean = conv_out.mean(axis=(0, 1, 2))
            var = (conv_out**2).mean(axis=(0, 1, 2)) - mean**2
            ref = reference[f"BatchNorm_{layer}"]
            ref["mean"] = np.float32(0.9) * ref["mean"] + np.float32(0.1) * mean
            ref["var"] = np.float32(0.9) * ref["var"] + np.float32(0.1) * var
    assert {s.dtype for s in jax.tree.leaves(stats)} == {F32}
    chex.assert_trees_all_close(stats, reference, rtol=1e-4, atol=1e-5)
    assert int(jmp.scaling.find_loss_scaling_state(state).applied_steps) >= 18


def _synthetic_task():
    kx, kw = jax.random.split(jax.random.key(42))
    x = jax.random.normal(kx, (256, 6, 16))
    w = jax.random.normal(kw, (16, 4))
    y = jnp.argmax(x.mean(axis=1) @ w, axis=-1)
    return x, y


def _train_linen(policy_name, steps=60):
    x, y = _synthetic_task()
    policy = jmp.get_policy(policy_name)
    mixed = jmp.linen.mixed_precision(Classifier(), policy)
    params = mixed.init(jax.random.key(0), x[:2])["params"]
    scale = (
        jmp.DynamicLossScale(2.0**15)
        if policy.compute_dtype == jnp.float16
        else jmp.NoOpLossScale()
    )
    tx = jmp.loss_scaling(optax.adam(3e-3), scale)
    opt_state = tx.init(params)

    def loss_fn(params):
        logits = mixed.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(params, opt_state):
        s = jmp.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: s.scale(loss_fn(p)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for _ in range(steps):
        params, opt_state = step(params, opt_state)
    # Judge every run by the same float32 evaluation of its master weights.
    return float(
        optax.softmax_cross_entropy_with_integer_labels(
            Classifier().apply({"params": params}, x), y
        ).mean()
    )


@third_party_promotion
def test_training_parity_linen():
    losses = {name: _train_linen(name) for name in ("float32", *HALF_POLICIES)}
    print(f"\nfinal float32-evaluated losses: {losses}")
    for name in HALF_POLICIES:
        assert abs(losses[name] - losses["float32"]) <= 0.02 * losses["float32"], losses
    assert losses["float32"] < 0.8  # it learned (chance is log(4) = 1.39)


@third_party_promotion
def test_nnx_optimizer_with_loss_scaling_and_parity():
    x, y = _synthetic_task()
    losses = {}
    for name in ("float32", "mixed_float16"):
        model = jmp.nnx.mixed_precision(NNXClassifier(rngs=nnx.Rngs(0)), jmp.get_policy(name))
        optimizer = nnx.Optimizer(
            model, jmp.loss_scaling(optax.adam(3e-3), jmp.DynamicLossScale(2.0**15)), wrt=nnx.Param
        )

        @nnx.jit
        def step(model, optimizer):
            scale = jmp.get_loss_scale(optimizer)

            def loss_fn(model):
                loss = optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()
                return scale.scale(loss)

            grads = nnx.grad(loss_fn)(model)
            optimizer.update(model, grads)

        for _ in range(60):
            step(model, optimizer)
        reference = NNXClassifier(rngs=nnx.Rngs(0))
        nnx.update(reference, nnx.state(model.model, nnx.Param))  # float32 evaluation
        losses[name] = float(
            optax.softmax_cross_entropy_with_integer_labels(reference(x), y).mean()
        )
        assert {p.dtype for p in jax.tree.leaves(nnx.state(model, nnx.Param))} == {F32}
    print(f"\nNNX final losses: {losses}")
    assert abs(losses["mixed_float16"] - losses["float32"]) <= 0.02 * losses["float32"]


def test_parameter_tree_unchanged_and_float32_checkpoint_loads():
    x = jnp.ones((2, 5, 16))
    plain = Classifier().init(jax.random.key(0), x)
    mixed = jmp.linen.mixed_precision(Classifier(), jmp.get_policy("mixed_float16"))
    assert jax.tree.structure(mixed.init(jax.random.key(0), x)) == jax.tree.structure(plain)
    out = mixed.apply(plain, x)  # a float32 "checkpoint" loads as is
    chex.assert_trees_all_close(out, Classifier().apply(plain, x), atol=2e-2)

    model = NNXClassifier(rngs=nnx.Rngs(0))
    before = nnx.state(model)
    mixed = jmp.nnx.mixed_precision(model, jmp.get_policy("mixed_bfloat16"))
    assert mixed.model is model
    after = nnx.state(mixed.model)
    assert jax.tree.structure(before) == jax.tree.structure(after)
    chex.assert_trees_all_equal(before, after)
    fresh = NNXClassifier(rngs=nnx.Rngs(1))
    nnx.update(mixed.model, nnx.state(fresh))  # load a float32 model's state
    chex.assert_trees_all_equal(nnx.state(mixed.model), nnx.state(fresh))
    assert mixed(x).dtype == F32


def test_nnx_policy_changes_no_class_and_sets_no_attribute_of_its_own():
    """The user's modules keep their classes and gain no attribute: the policy sets only the
    layers' own fields (`dtype`, `param_dtype`, `attention_fn`, `dot_general`), and the
    wrapper it returns runs the model (before, every module's class was swapped for a scoped
    subclass and seven `_jmp_policy_*` attributes were set on them)."""
    x = jnp.ones((2, 5, 16))
    model = NNXClassifier(rngs=nnx.Rngs(0))
    modules = [m for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Module)]
    before = [(type(m), set(vars(m))) for m in modules]
    overrides = {**jmp.nnx.NORMS_IN_FLOAT32, "head": jmp.get_policy("float32")}
    mixed = jmp.nnx.mixed_precision(model, jmp.get_policy("mixed_float16"), overrides)
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) ** 2)))(mixed)
    mixed(x)
    assert jax.tree.leaves(grads) and jmp.precision_report(mixed, x).counts
    assert [(type(m), set(vars(m))) for m in modules] == before
    assert type(mixed).__module__ == "jmp_policy.nnx" and mixed.model is model
    assert model.head.dtype == F32 and model.up.dtype == jnp.float16


def test_bad_policy_and_module():
    with pytest.raises(TypeError, match="`policy`"):
        jmp.linen.mixed_precision(Classifier(), jnp.float16)
    with pytest.raises(TypeError, match="`module`"):
        jmp.linen.mixed_precision(NNXClassifier(rngs=nnx.Rngs(0)), jmp.get_policy("float32"))
    with pytest.raises(TypeError, match="`model`"):
        jmp.nnx.mixed_precision(Classifier(), jmp.get_policy("float32"))


@third_party_promotion
def test_apply_without_init_with_flags_and_callables():
    """A checkpoint loaded straight into `apply`, in inference mode: the module
    paths are learnt from that call (a flag and a callable among its arguments)."""
    x = jnp.ones((2, 8, 8, 3))
    variables = CNN().init(jax.random.key(0), x)  # the float32 model's checkpoint
    mixed = jmp.linen.mixed_precision(CNN(), jmp.get_policy("mixed_float16"))
    logits, inter = mixed.apply(
        variables,
        x,
        train=False,
        mutable=["intermediates"],
        capture_intermediates=lambda mdl, method: isinstance(mdl, nn.BatchNorm),
    )
    assert logits.dtype == F32
    # BatchNorm (an island) ran in float32 although this call never went through init, and
    # handed its output back in the model's compute dtype (as Flax's own dtype= layers do).
    assert {a.dtype for a in jax.tree.leaves(inter["intermediates"])} == {jnp.dtype(jnp.float16)}
    jaxpr = jax.make_jaxpr(lambda v: mixed.apply(v, x, train=False))(variables)
    convs = [e for e in iter_equations(jaxpr) if e.primitive.name == "conv_general_dilated"]
    assert convs and all(
        {v.aval.dtype for v in e.invars} == {jnp.dtype(jnp.float16)} for e in convs
    )
    norms = [e for e in iter_equations(jaxpr) if e.primitive.name == "rsqrt"]
    assert len(norms) == 2 and {e.outvars[0].aval.dtype for e in norms} == {F32}


# --- Lifted transforms and stacked layers (real deep-model layouts) -------------


class _Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(x.shape[-1])(x)


class _ScanBody(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.LayerNorm()(x)
        return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(2 * x.shape[-1])(h))), None


class _Lifted(nn.Module):
    """A float32 island feeds an nn.scan over nn.remat'd blocks, then nn.vmap, nn.jit, nn.remat."""

    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm()(nn.Dense(16)(x))  # float32 here: the scan carry enters as float32
        stack = nn.scan(
            nn.remat(_ScanBody), variable_axes={"params": 0}, split_rngs={"params": True}, length=3
        )
        x, _ = stack(name="blocks")(x, None)
        x = nn.vmap(_Dense, variable_axes={"params": 0}, split_rngs={"params": True})(name="vm")(x)
        x = nn.jit(_Dense)(name="jt")(x)
        return nn.remat(_Dense)(name="rm")(x)


@third_party_promotion
def test_linen_lifted_transforms_keep_the_carry_dtype():
    mixed = jmp.linen.mixed_precision(_Lifted(), jmp.get_policy("mixed_float16"))
    x = jax.random.normal(jax.random.key(1), (2, 4, 8))
    variables = mixed.init(jax.random.key(0), x)
    kernel = variables["params"]["blocks"]["Dense_1"]["kernel"]
    assert kernel.shape == (3, 16, 32) and kernel.dtype == jnp.float32  # stacked per layer

    # The scanned Dense layers compute in float16 (their dot_generals take float16 operands).
    jaxpr = jax.make_jaxpr(lambda v: mixed.apply(v, x))(variables)
    dots = [e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    assert dots and all(e.invars[0].aval.dtype == jnp.float16 for e in dots)

    out = jax.jit(mixed.apply)(variables, x)
    reference = _Lifted().apply(variables, x)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, reference, atol=5e-2, rtol=5e-2)
    grads = jax.jit(jax.grad(lambda p: mixed.apply({"params": p}, x).sum()))(variables["params"])
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    assert jmp.all_finite(grads)
    print(f"lifted: {len(dots)} float16 dot_generals, max |mixed - float32| "
          f"{float(jnp.abs(out - reference).max()):.4f}")  # fmt: skip


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from _all_eqns(sub)


class _WithMethod(nn.Module):
    def setup(self):
        self.embed = nn.Dense(8)
        self.norm = nn.LayerNorm()
        self.dropout = nn.Dropout(0.5, deterministic=False)

    def __call__(self, x):
        return self.dropout(self.norm(self.embed(x)))  # needs a "dropout" rng

    def embed_only(self, x):
        return self.embed(x)


def test_apply_with_method_learns_that_methods_paths():
    mixed = jmp.linen.mixed_precision(_WithMethod(), jmp.get_policy("mixed_float16"))
    x = jnp.ones((2, 4))
    variables = mixed.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    mixed._path_policies.clear()  # as if this process had never run the model
    # No dropout rng: learning the paths must run `embed_only`, not `__call__`.
    out = mixed.apply(variables, x, method="embed_only")
    assert out.dtype == jnp.float32
    learnt = mixed._path_policies[next(iter(mixed._path_policies))].policies
    assert ("norm",) not in learnt and ("embed",) in learnt
    # A function works too.
    out_fn = mixed.apply(variables, x, method=_WithMethod.embed_only)
    np.testing.assert_array_equal(out, out_fn)


class _NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.lin = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return x + self.lin(self.norm(x))


class _NNXStacked(nnx.Module):
    """Three blocks made by nnx.vmap (with nnx.split_rngs), run by nnx.scan over nnx.remat."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return _NNXBlock(rngs)

        self.blocks = make(rngs)
        self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def body(x, block):
            return block(x)

        return self.head(body(x, self.blocks))


@third_party_promotion
def test_nnx_stacked_layers_under_scan_vmap_remat():
    model = jmp.nnx.mixed_precision(_NNXStacked(nnx.Rngs(0)), jmp.get_policy("mixed_float16"))
    assert model.model.blocks.lin.kernel[...].shape == (3, 8, 8)
    assert model.model.blocks.lin.kernel[...].dtype == jnp.float32
    blocks = model.model.blocks
    assert (blocks.lin.dtype, blocks.norm.dtype) == (jnp.float16, jnp.float32)
    x = jax.random.normal(jax.random.key(3), (4, 8))
    assert model(x).dtype == jnp.float32
    tx = jmp.loss_scaling(optax.adam(1e-2), jmp.DynamicLossScale(2.0**10))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
        scale = jmp.get_loss_scale(optimizer)

        def loss(model):
            return scale.scale(jnp.mean(model(x).astype(jnp.float32) ** 2))

        optimizer.update(model, nnx.grad(loss)(model))

    before = model.model.blocks.lin.kernel[...]
    for _ in range(3):
        step(model, optimizer, x)
    report = jmp.loss_scaling_report(optimizer)
    assert (report.applied_steps, report.skipped_steps) == (3, 0)
    assert not jnp.array_equal(before, model.model.blocks.lin.kernel[...])


class _Runs:
    """A log Flax leaves as it is (a list field would be frozen into a tuple)."""

    def __init__(self):
        self.flags: list = []


class _Counted(nn.Module):
    """Logs the runs of its `__call__` (each is a trace under `jit`)."""

    runs: _Runs

    @nn.compact
    def __call__(self, x, train: bool = False):
        self.runs.flags.append(train)
        h = nn.LayerNorm()(nn.Dense(8)(x))
        return nn.Dense(2)(nn.Dropout(0.5, deterministic=not train)(h))


def test_linen_first_call_runs_the_model_once():
    """After `init` (the usual way: a TrainState made from it), the first call of each
    signature traces the model once: that program is checked for float32 matmuls and is
    the call. A later signature with other flags (train=True) is one run too."""
    runs = _Runs()
    mixed = jmp.linen.mixed_precision(_Counted(runs), "mixed_float16")
    x = jnp.ones((4, 6))
    variables = mixed.init(jax.random.key(0), x)
    runs.flags.clear()
    out = jax.jit(lambda v, x: mixed.apply(v, x))(variables, x)
    assert runs.flags == [False] and out.dtype == jnp.float32
    runs.flags.clear()
    rngs = {"dropout": jax.random.key(1)}
    jax.jit(lambda v, x: mixed.apply(v, x, train=True, rngs=rngs))(variables, jnp.ones((8, 6)))
    assert runs.flags == [True]
    # Without an earlier run (parameters restored in a new process): one abstract recording
    # run finds the module paths exactly (no guess from the parameters' names), then the
    # call runs once, with the same results.
    fresh_runs = _Runs()
    fresh = jmp.linen.mixed_precision(_Counted(fresh_runs), "mixed_float16")
    out = jax.jit(lambda v, x: fresh.apply(v, x))(variables, x)
    assert fresh_runs.flags == [False, False]
    np.testing.assert_array_equal(out, mixed.apply(variables, x))


class _OwnMatmul(nn.Module):
    """A module that multiplies by its own parameter (`x @ self.param`): it casts nothing."""

    runs: _Runs
    name_of_weight: str = "w"

    @nn.compact
    def __call__(self, x):
        self.runs.flags.append(x.shape)
        w = self.param(self.name_of_weight, nn.initializers.lecun_normal(), (x.shape[-1], 4))
        return nn.LayerNorm()(x @ w)


@pytest.mark.parametrize("name", ["w", "kernel"])
def test_linen_first_call_without_an_earlier_run_learns_the_paths_exactly(name):
    """Without an earlier run the first call learns which modules cast their own parameters
    and which use theirs themselves (cast where used, `cast_at_use`) from one abstract
    recording run, then runs the call: two runs, whatever the parameters are named (a
    module's own `kernel`, a name Flax's layers use, too). The result is the one after
    `init`, the weight in float16 at its matmul."""
    x = jnp.ones((2, 6))
    after_init = jmp.linen.mixed_precision(_OwnMatmul(_Runs(), name), "mixed_float16")
    variables = after_init.init(jax.random.key(0), x)
    log = _Runs()
    fresh = jmp.linen.mixed_precision(_OwnMatmul(log, name), "mixed_float16")
    program = jax.make_jaxpr(lambda v: fresh.apply(v, x))(variables)
    assert len(log.flags) == 2
    np.testing.assert_array_equal(fresh.apply(variables, x), after_init.apply(variables, x))
    dots = [e for e in iter_equations(program) if e.primitive.name == "dot_general"]
    assert [str(e.invars[1].aval.dtype) for e in dots] == ["float16"]


def test_nnx_first_call_runs_the_model_once():
    runs = _Runs()

    class Counted(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(6, 8, rngs=rngs)
            self.norm = nnx.LayerNorm(8, rngs=rngs)

        def __call__(self, x):
            runs.flags.append(x.shape)
            return self.norm(self.up(x))

    model = jmp.nnx.mixed_precision(Counted(nnx.Rngs(0)), "mixed_float16")
    out = nnx.jit(lambda m, x: m(x))(model, jnp.ones((4, 6)))
    assert runs.flags == [(4, 6)] and out.dtype == jnp.float32
