"""autocast over every kind of primitive it can meet, with operands that broadcast.

Each operation takes a half-precision activation (`relu(x @ w)`, as every dropout layer
divides one by a scalar) and a second operand of every broadcasting form: a Python scalar,
a 0-d array, a weight of the same shape, a row (rank mismatch), a column of size-1 axes,
and another activation. Each runs under `jit`, `grad`, `vmap`, `scan`, `checkpoint` and
`cond`, with float16 and bfloat16: its value and its gradient must be within the half
dtype's tolerance of float32's.

To keep the suite fast, one program per (transformation, dtype) holds every operation,
each on its own copy of the inputs, so each operation's gradient is its own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jmp_policy as jmp
from jmp_policy._autocast.evaluation import _Evaluation, _Rules
from jmp_policy._autocast.ops import _keeping_half, _quotient_keeping_half
from jmp_policy._core import jaxpr as _jaxpr
from jmp_policy._core import rules as _rules

B, K, N = 6, 5, 4  # batch, features in, features out


@jax.custom_vjp
def _clip_grad(x):
    return x


_clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1.0, 1.0),))


def _second(kind: str, p: dict):
    """The second operand, in each broadcasting form."""
    if kind == "python scalar":
        return 0.9
    if kind == "0-d array":
        return p["s"]
    if kind == "weight":
        return p["v"]  # float32, (B, N)
    if kind == "row":
        return p["r"]  # float32, (N,): rank mismatch
    if kind == "column":
        return p["c"]  # float32, (B, 1): a size-1 axis
    return jnp.abs(p["x"] @ p["w2"]) + 0.5  # another activation, positive


SECONDS = ("python scalar", "0-d array", "weight", "row", "column", "activation")

BINARY = {
    "add": jnp.add,
    "sub": jnp.subtract,
    "mul": jnp.multiply,
    "div": jnp.divide,
    "max": jnp.maximum,
    "min": jnp.minimum,
    "pow": lambda a, b: jnp.power(a + 1.0, b),
    "atan2": jnp.arctan2,
    "where": lambda a, b: jnp.where(a > 0.1, a, b),
    # A ViT's CLS token: a row of the second operand put in front of the activations.
    "concatenate": lambda a, b: jnp.concatenate([jnp.broadcast_to(b, a.shape)[:1], a], axis=0),
}

UNARY = {
    "exp": lambda h: jnp.exp(-h),
    "log": lambda h: jnp.log(h + 1.0),
    "tanh": jnp.tanh,
    "logistic": jax.nn.sigmoid,
    "sqrt": lambda h: jnp.sqrt(h + 1.0),
    "rsqrt": lambda h: lax.rsqrt(h + 1.0),
    "erf": jax.scipy.special.erf,
    "gelu (custom_jvp inside)": jax.nn.gelu,
    "softplus": jax.nn.softplus,
    "square": jnp.square,
    "abs": jnp.abs,
    "sin": jnp.sin,
    "sum": lambda h: jnp.sum(h, axis=-1),
    "mean": jnp.mean,
    "max": lambda h: jnp.max(h, axis=0),
    "prod": lambda h: jnp.prod(h * 0.1 + 1.0, axis=-1),
    "var": lambda h: jnp.var(h, axis=-1),
    "logsumexp (custom_jvp)": lambda h: jax.nn.logsumexp(h, axis=-1),
    "softmax": jax.nn.softmax,
    "log_softmax": jax.nn.log_softmax,
    "cumsum": lambda h: jnp.cumsum(h, axis=0),
    "cumprod": lambda h: jnp.cumprod(h * 0.1 + 1.0, axis=-1),
    "cummax": lambda h: lax.cummax(h, axis=0),
    "gather": lambda h: h[jnp.array([2, 0, 1]), 1:3],
    "scatter-add": lambda h: jnp.zeros((3, N), h.dtype).at[jnp.array([0, 2, 0, 1, 2, 0])].add(h),
    "segment_sum": lambda h: jax.ops.segment_sum(h, jnp.array([0, 0, 1, 1, 1, 2]), 3),
    "sort": lambda h: jnp.sort(h, axis=-1),
    "concatenate": lambda h: jnp.concatenate([h, h[:2]], axis=0),
    "custom_vjp": _clip_grad,
    "dot again": lambda h: h @ jnp.ones((N, 3), h.dtype) / N,
    "conv": lambda h: lax.conv_general_dilated(
        h[None, None], jnp.ones((1, 1, 2, 2), h.dtype), (1, 1), "VALID"
    )[0, 0],
    "cond inside": lambda h: lax.cond(jnp.sum(h) > 0, lambda v: v * 2.0, lambda v: -v, h),
    "scan inside": lambda h: lax.scan(lambda c, r: (c + r, c * r), jnp.zeros(N, h.dtype), h)[1],
}


def _cases():
    for name, op in BINARY.items():
        for kind in SECONDS:
            yield (
                f"{name} by {kind}",
                functools.partial(lambda op, kind, h, p: op(h, _second(kind, p)), op, kind),
            )
    for name, op in UNARY.items():
        yield name, lambda h, p, op=op: op(h)


CASES = dict(_cases())


def _inputs(seed: int = 0) -> dict:
    keys = jax.random.split(jax.random.key(seed), 8)
    return {
        "x": jax.random.normal(keys[0], (B, K)),
        "w": jax.random.normal(keys[1], (K, N)) * 0.6,
        "w2": jax.random.normal(keys[2], (K, N)) * 0.6,
        "v": jax.random.uniform(keys[3], (B, N), minval=0.5, maxval=1.5),
        "r": jax.random.uniform(keys[4], (N,), minval=0.5, maxval=1.5),
        "c": jax.random.uniform(keys[5], (B, 1), minval=0.5, maxval=1.5),
        "s": jnp.float32(1.3),
    }


def forward(params: dict) -> dict:
    """Every case on its own copy of the inputs: `relu(x @ w)` met by the case's operation."""
    out = {}
    for name, case in CASES.items():
        p = params[name]
        h = jax.nn.relu(p["x"] @ p["w"])
        out[name] = case(h, p)
    return out


def _loss(params: dict) -> jax.Array:
    outs = forward(params)
    # A fixed weighting per case, so each output's gradient is not all ones.
    return sum(jnp.sum(jnp.sin(jnp.arange(o.size).reshape(o.shape)) * o) for o in outs.values())


def _transformed(transform: str, fun, loss):
    """The function under `transform`, taking the per-case params."""
    if transform == "jit":
        return jax.jit(fun)
    if transform == "grad":
        return jax.jit(jax.grad(loss))
    if transform == "vmap":  # over a leading batch of two copies of the inputs
        return jax.jit(jax.vmap(fun))
    if transform == "scan":  # grad of a scan over two steps, each running the model
        return jax.jit(
            jax.grad(lambda p: lax.scan(lambda c, _: (c + loss(p), None), 0.0, None, length=2)[0])
        )
    if transform == "checkpoint":
        return jax.jit(jax.grad(jax.checkpoint(loss)))
    if transform == "cond":
        return jax.jit(jax.grad(lambda p: lax.cond(True, loss, lambda q: 0.0 * loss(q), p)))
    raise AssertionError(transform)


# The loops and branches compile the largest programs: they run in the slow lane (.ci/run).
TRANSFORMS = (
    "jit",
    "grad",
    "vmap",
    pytest.param("scan", marks=pytest.mark.slow),
    pytest.param("checkpoint", marks=pytest.mark.slow),
    pytest.param("cond", marks=pytest.mark.slow),
)
TOLERANCE = {"mixed_float16": 1.5e-2, "mixed_bfloat16": 6e-2}


def _params(transform: str) -> dict:
    base = _inputs()
    if transform == "vmap":
        other = _inputs(1)
        base = jax.tree.map(lambda a, b: jnp.stack([a, b]), base, other)
    return {name: base for name in CASES}


@functools.cache
def _float32(transform: str) -> dict:
    """The float32 result, once per transformation for both policies."""
    return jax.device_get(_transformed(transform, forward, _loss)(_params(transform)))


def _relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / (np.linalg.norm(want) + 1e-3))


@pytest.mark.standard_promotion  # `relu(h) / 0.9` as users write it: a weak Python float
@pytest.mark.parametrize("policy", TOLERANCE)
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_every_primitive_with_every_broadcast_under_each_transform(transform, policy):
    params = _params(transform)
    # autocast wraps what the user writes: the model (jit, vmap) or the loss (the rest).
    half_fun, half_loss = jmp.autocast(forward, policy), jmp.autocast(_loss, policy)
    got = _transformed(transform, half_fun, half_loss)(params)
    want = _float32(transform)
    errors = {}
    for name in CASES:
        for g, w in zip(jax.tree.leaves(got[name]), jax.tree.leaves(want[name]), strict=True):
            assert g.dtype == w.dtype, name  # outputs and gradients in the callers' dtypes
            err = _relative_error(g, w)
            if not err <= TOLERANCE[policy]:
                errors[name] = round(err, 4)
    assert not errors, f"{transform}, {policy}: relative error above tolerance: {errors}"


def test_the_matmul_runs_in_half_precision_in_every_case():
    """The sweep means something: each case's matmul ran in half precision."""
    report = jmp.precision_report(jmp.autocast(_loss, "mixed_bfloat16"), _params("jit"))
    assert report.half_matmul_flop_share == 1.0
    # One per case, one more per activation denominator, one for "dot again".
    assert report.counts["dot_general"] == {"bfloat16": len(CASES) + len(BINARY) + 1}


# --- the hand-written backward rules against JAX's derivative of the float32 function ------

HALF_RULES = _Rules(np.dtype(jnp.float16), np.dtype(jnp.float32), frozenset(), frozenset())


def _eqn(fun, *args):
    return jax.make_jaxpr(fun)(*args).eqns[-1]


@pytest.mark.parametrize("denominator", [(), (B, N)], ids=["0-d (a literal)", "same shape"])
def test_quotient_keeping_half_derivative_is_jaxs(denominator):
    """The division's rule (softmax's quotient, `relu(h) / 0.9`): the only operand shapes a
    `div` equation has (jnp broadcasts size-1 axes before it; a literal stays 0-d)."""
    a = jax.random.normal(jax.random.key(0), (B, N))
    b = jax.random.uniform(jax.random.key(1), denominator, minval=0.5, maxval=2.0)
    eqn = _eqn(lax.div, a, b)
    assert eqn.primitive is _jaxpr.DIV

    def ours(a, b):
        return _quotient_keeping_half(_Evaluation(HALF_RULES), a, b, np.dtype(jnp.float16), eqn)

    weights = jnp.cos(jnp.arange(B * N).reshape(B, N))
    got = jax.grad(lambda a, b: jnp.sum(weights * ours(a, b)), argnums=(0, 1))(a, b)
    want = jax.grad(lambda a, b: jnp.sum(weights * lax.div(a, b)), argnums=(0, 1))(a, b)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=5e-3, atol=5e-3)


def test_keeping_half_derivative_is_jaxs():
    """`_keeping_half` (a float32-list op on activations, its operands kept in 16 bits)
    differentiates as JAX differentiates the float32 op, up to the operands' rounding."""
    a = jax.random.normal(jax.random.key(0), (B, N))
    b = jax.random.uniform(jax.random.key(1), (B, N), minval=0.5, maxval=2.0)
    a = jnp.abs(a) + 0.5
    eqn = _eqn(lax.pow, a, b)

    def ours(a, b):
        return _keeping_half(eqn, [a, b], frozenset({0, 1}), np.dtype(jnp.float16))[0]

    got = jax.grad(lambda a, b: jnp.sum(ours(a, b)), argnums=(0, 1))(a, b)
    want = jax.grad(lambda a, b: jnp.sum(lax.pow(a, b)), argnums=(0, 1))(a, b)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-2, atol=1e-2)


def test_a_primitive_without_a_rule_runs_as_traced_and_is_reported():
    """A primitive autocast has no rule for (a library's own) runs in the dtypes it was
    traced with, and a PrecisionWarning names it: never a retry, never a silent float32."""
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    doubled = Primitive("jmp_test_doubled")
    doubled.def_impl(lambda x: x * 2)
    doubled.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    mlir.register_lowering(doubled, mlir.lower_fun(lambda x: x * 2, multiple_results=False))
    assert _rules.rule_of(doubled) is None

    def f(w, x):
        return doubled.bind(x @ w) @ w

    w, x = jnp.eye(K) * 0.5, _inputs()["x"]
    with pytest.warns(jmp.errors.PrecisionWarning, match="jmp_test_doubled"):
        program = jax.make_jaxpr(jmp.autocast(f, "mixed_float16"))(w, x)
    (eqn,) = [e for e, _ in _jaxpr.walk(program) if e.primitive is doubled]
    assert eqn.invars[0].aval.dtype == jnp.float32  # as traced
    dots = [e for e, _ in _jaxpr.walk(program) if e.primitive is _jaxpr.DOT_GENERAL]
    assert [d.outvars[0].aval.dtype for d in dots] == [jnp.float16, jnp.float16]
