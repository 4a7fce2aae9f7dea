"""The four models of issue 71 (`hard_models.py`) under every integration that applies: the
model's own policy wrapper (`nnx`, `linen` or `eqx.mixed_precision`) and `autocast`.

Fast lane, float16, each model's loss-scaled train step (`value_and_scaled_grad`,
`loss_scaling(optax.adam)`, under `jit`):
- it trains (finite losses, the steps applied once the scale has backed off);
- >= 99% of the step's matmul FLOPs in half precision;
- no operation of the float32 list (exp, log, powers, square roots, sums, segment sums)
  computes in half precision, in the forward pass or the backward pass;
- the model's own float32 casts stand (`astype(jnp.float32)` before `top_k`, the soft-capped
  logits), where the model writes one;
- a planted overflow is skipped: parameters and optimizer state bit for bit.
Slow lane: the final loss (the mean over the last 30 steps) of float16 within 2% and bfloat16
within 5% of float32's (or within float32's own noise: the larger of a 2^-11 perturbation and its
mirror image, as the MoE's routing makes one draw an underestimate), two seeds; and the train
step's CUDA program (`cuda_program`) multiplies in 16 bits.
"""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys

import hard_models as hm
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from cuda_program import assert_gpu_matmuls_in_low_precision, cuda_matmuls
from flax import nnx
from parity import assert_matches_float32, perturbed

import jmp_policy as jmp
from jmp_policy._reports.census import compute_dtype, iter_equations, report_of_jaxpr

pytestmark = pytest.mark.standard_promotion  # user code: optax's Adam mixes float and int

OVERFLOW, ONE = jnp.float32(2.0**120), jnp.float32(1.0)
CASES = [
    ("gemma", "nnx.mixed_precision"),
    ("gemma", "autocast"),
    ("moe", "linen.mixed_precision"),
    ("moe", "autocast"),
    ("dot_product_attention", "linen.mixed_precision"),
    ("dot_product_attention", "autocast"),
    ("neural_ode", "eqx.mixed_precision"),
    ("neural_ode", "autocast"),
]
LEARNING_RATE = {"gemma": 3e-3, "moe": 3e-3, "dot_product_attention": 3e-3, "neural_ode": 1e-2}
STEPS = {"gemma": 150, "moe": 150, "dot_product_attention": 150, "neural_ode": 60}
WINDOW = 30  # the final loss: the mean over the last steps' batches


def _setup(model: str, integration: str, policy: str, seed: int = 0, perturb: float = 0.0):
    """`(loss(params, *batch), params, data)`: `data` a tuple of arrays stacked over steps."""
    key, data_key = jax.random.split(jax.random.key(seed))
    mixed = policy != "float32"
    if model == "gemma":
        data = hm.tokens(data_key, STEPS[model])
        gemma = hm.Gemma(hm.GemmaConfig(), nnx.Rngs(seed))
        if mixed and integration == "nnx.mixed_precision":
            gemma = jmp.nnx.mixed_precision(gemma, policy)
        graphdef, params = nnx.split(gemma)

        def loss(params, inputs, targets):
            return hm.gemma_loss(nnx.merge(graphdef, params), inputs, targets)

    elif model in ("moe", "dot_product_attention"):
        data = hm.tokens(data_key, STEPS[model])
        module = hm.MoE() if model == "moe" else hm.DotProductAttention()
        model_loss = hm.moe_loss if model == "moe" else hm.dpa_loss
        params = module.init(key, data[0][0])["params"]
        apply = module.apply
        if mixed and integration == "linen.mixed_precision":
            apply = jmp.linen.mixed_precision(module, policy).apply
        loss = functools.partial(model_loss, apply)
    else:
        eqx = pytest.importorskip("equinox")
        pytest.importorskip("diffrax")
        data = hm.spirals(data_key, STEPS[model])
        ode = hm.neural_ode(key)
        if mixed and integration == "eqx.mixed_precision":
            ode = jmp.eqx.mixed_precision(ode, policy)
        params, static = eqx.partition(ode, eqx.is_inexact_array)

        def loss(params, y0, ys):
            return hm.ode_loss(eqx.combine(params, static), y0, ys)

    if mixed and integration == "autocast":
        loss = jmp.autocast(loss, policy)
    return loss, perturbed(params, seed, perturb), data


def _trainer(model: str, loss, params, policy: str):
    """`(step, opt_state)`: `step(params, opt_state, batch, gain)` is the jitted train step.
    `gain` is always passed (a default would be a constant of one trace, and the call that
    passes `OVERFLOW` a second trace and compile)."""
    scale = jmp.DynamicLossScale(2.0**15) if policy == "mixed_float16" else jmp.NoOpLossScale()
    tx = jmp.loss_scaling(optax.adam(LEARNING_RATE[model]), scale)

    def gained(params, gain, *batch):
        return gain * loss(params, *batch)

    @jax.jit
    def step(params, opt_state, batch, gain):
        value, grads = jmp.value_and_scaled_grad(gained)(opt_state, params, gain, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step, tx.init(params)


def _batch(data, i):
    return tuple(a[i] for a in data)


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


FLOAT32_LIST = frozenset(
    "exp exp2 log log1p expm1 pow integer_pow square sqrt rsqrt logistic reduce_sum cumsum "
    "scatter-add".split()
)


def _float32_list_in_half(program) -> list[str]:
    """The float32-list operations of `program` (nested programs included) that compute in a
    16-bit dtype; a sum over a single element (a size-1 axis) adds nothing and is left out."""
    found = []
    for eqn in iter_equations(program):
        if eqn.primitive.name not in FLOAT32_LIST:
            continue
        dtype = compute_dtype(eqn)
        if dtype is None or jnp.finfo(dtype).bits != 16:
            continue
        if eqn.primitive.name == "reduce_sum":
            shape = eqn.invars[0].aval.shape
            if int(np.prod([shape[a] for a in eqn.params["axes"]])) <= 1:
                continue
        found.append(f"{eqn.primitive.name} {eqn.source_info.name_stack}")
    return found


def _own_float32_casts(model: str, program) -> list[str]:
    """The operations that take the model's own float32 casts, with the dtype they compute in:
    the router's `top_k` (MoE), the soft-capping `tanh` of the logits (Gemma)."""
    found = []
    for eqn in iter_equations(program):
        name = eqn.primitive.name
        router = model == "moe" and name == "top_k"
        softcap = (
            model == "gemma" and name == "tanh" and eqn.invars[0].aval.shape[-1:] == (hm.VOCAB,)
        )
        if router or softcap:
            found.append(f"{name} in {np.dtype(compute_dtype(eqn)).name}")
    return found


# autocast (and the Equinox wrapper, which runs it) trace the function in float32, where the
# model's `astype(jnp.float32)` is no operation and leaves nothing in the program: the
# operation after it follows its half-precision operand. Issue 71's engine is to keep it.
_CASTS_LOST = pytest.mark.xfail(
    strict=True, reason="autocast traces in float32: an explicit astype(float32) is not seen"
)


@pytest.mark.parametrize(("model", "integration"), CASES)
def test_trains_in_half_precision_and_skips_an_overflow(model, integration):
    loss, params, data = _setup(model, integration, "mixed_float16")
    step, opt_state = _trainer(model, loss, params, "mixed_float16")
    batch = _batch(data, 0)
    program = jax.make_jaxpr(step)(params, opt_state, batch, ONE)
    share = report_of_jaxpr(program).half_matmul_flop_share
    assert share >= 0.99, f"{model} under {integration}: {share:.1%} of matmul FLOPs in half"
    assert _float32_list_in_half(program) == [], f"{model} under {integration}"
    for i in range(5):
        params, opt_state, value = step(params, opt_state, _batch(data, i), ONE)
        assert np.isfinite(float(value))
    scaling = jmp.scaling.find_loss_scaling_state(opt_state)
    assert int(scaling.applied_steps) >= 3 and not bool(scaling.last_step_skipped)
    scale = float(scaling.loss_scale.loss_scale)
    new_params, new_state, _ = step(params, opt_state, _batch(data, 5), OVERFLOW)
    new_scaling = jmp.scaling.find_loss_scaling_state(new_state)
    assert bool(new_scaling.last_step_skipped)
    for a, b in zip(_host(new_params), _host(params), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_host(new_scaling.inner_state), _host(scaling.inner_state), strict=True):
        np.testing.assert_array_equal(a, b)
    assert float(new_scaling.loss_scale.loss_scale) == scale / 2


@pytest.mark.parametrize(
    ("model", "integration"),
    [
        ("gemma", "nnx.mixed_precision"),
        pytest.param("gemma", "autocast", marks=_CASTS_LOST),
        ("moe", "linen.mixed_precision"),
        ("moe", "autocast"),
    ],
)
def test_the_models_own_float32_casts_stand(model, integration):
    loss, params, data = _setup(model, integration, "mixed_float16")
    program = jax.make_jaxpr(jax.value_and_grad(loss))(params, *_batch(data, 0))
    found = _own_float32_casts(model, program)
    assert found and all(f.endswith("float32") for f in found), found


@functools.cache  # float32's runs serve each integration and policy
def _final_loss(case: str, integration: str, policy: str, seed: int, perturb: float = 0.0):
    loss, params, data = _setup(case, integration, policy, seed, perturb)
    step, opt_state = _trainer(case, loss, params, policy)
    losses = []
    for i in range(STEPS[case]):
        params, opt_state, value = step(params, opt_state, _batch(data, i), ONE)
        losses.append(value)
    return float(np.mean(np.asarray(losses[-WINDOW:])))


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize(("model", "integration"), CASES)
def test_final_loss_matches_float32(model, integration, policy):
    tolerance = {"mixed_float16": 0.02, "mixed_bfloat16": 0.05}[policy]
    assert_matches_float32(_final_loss, model, integration, policy, tolerance, both_signs=True)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "integration"), CASES)
def test_the_gpu_program_multiplies_in_16_bits(model, integration, request):
    if model == "neural_ode" and os.environ.get("EQX_ON_ERROR") != "nan":
        # diffrax's runtime checks are host callbacks (`eqx.error_if`), which lower only for
        # the machine's own backend: read the CUDA program in a process where Equinox makes
        # them NaNs instead (`EQX_ON_ERROR=nan`, read when Equinox is imported).
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                request.node.nodeid,
                "-m",
                "slow",
                "-q",
                "-p",
                "no:cacheprovider",
            ],  # fmt: skip
            cwd=pathlib.Path(__file__).parents[1],
            env={**os.environ, "EQX_ON_ERROR": "nan"},
            capture_output=True,
            text=True,
            check=False,
        )
        assert run.returncode == 0, run.stdout[-3000:]
        return
    loss, params, data = _setup(model, integration, "mixed_bfloat16")
    step, opt_state = _trainer(model, loss, params, "mixed_bfloat16")
    found = cuda_matmuls(step, params, opt_state, _batch(data, 0), ONE)
    assert_gpu_matmuls_in_low_precision(found, f"{model} under {integration}")
