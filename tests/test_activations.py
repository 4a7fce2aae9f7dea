"""Activations stay in the compute dtype between float32 islands
(`jmp_policy._autocast.activations`)."""

import pathlib
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.extend import core as jcore
from jax.extend.core.primitives import remat_p
from models import CNN, GPT, MLP, NNXGPT, NNXBlock, residual_bytes, round_trips

import jmp_policy as jmp
from jmp_policy._autocast.activations import ACTIVATION, ISLAND, STATISTIC, WEIGHT, meet
from jmp_policy._core import jaxpr as _jaxpr

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOKENS = jax.random.randint(jax.random.key(0), (2, 32), 0, 64)
MODEL = GPT(dim=64, length=32, layers=1)
PARAMS = jax.jit(MODEL.init)(jax.random.key(1), TOKENS)["params"]


def _loss(model):
    def loss(params):
        logits = model.apply({"params": params}, TOKENS)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), TOKENS
        ).mean()

    return loss


def test_the_rule():
    f16, f32 = np.dtype(np.float16), np.dtype(np.float32)
    assert meet([f16, f32], [ACTIVATION, WEIGHT]) == (f16, ACTIVATION)  # a bias add
    assert meet([f16, f32], [ACTIVATION, ISLAND]) == (f16, ACTIVATION)  # an island handed back
    assert meet([f16, f32], [ACTIVATION, STATISTIC]) == (f32, ISLAND)  # x - mean
    assert meet([f32, f32], [ISLAND, STATISTIC]) == (f32, ISLAND)  # softmax's quotient
    assert meet([f32, f32], [STATISTIC, WEIGHT]) == (f32, STATISTIC)  # var + eps
    assert meet([f32, f32], [WEIGHT, WEIGHT]) == (f32, WEIGHT)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_autocast_keeps_at_most_what_flax_own_dtype_keeps(policy):
    half = jmp.get_policy(policy).compute_dtype
    full = sum(residual_bytes(_loss(MODEL), PARAMS).values())
    with jax.numpy_dtype_promotion("standard"):  # Flax's own model mixes dtypes as written
        own = residual_bytes(_loss(GPT(dim=64, length=32, layers=1, dtype=half)), PARAMS)
    own = sum(own.values())
    ours = residual_bytes(jmp.autocast(_loss(MODEL), policy), PARAMS)
    assert sum(ours.values()) <= min(own, 0.6 * full), (ours, own, full)


def test_no_float32_activation_is_kept_in_the_blocks():
    # Activation-sized residuals (a token's features, attention weights, MLP activations) are
    # half precision: the float32 islands (LayerNorm, softmax, the embedding sum) are computed
    # again in the backward pass from what the region keeps, so none is kept in float32.
    from jax._src.ad_checkpoint import saved_residuals

    def kept(layers):
        model = GPT(dim=64, length=32, layers=layers)
        params = jax.jit(model.init)(jax.random.key(1), TOKENS)["params"]
        found = saved_residuals(jmp.autocast(_loss(model), "mixed_float16"), params)
        big = [a for a, why in found if "argument" not in why and a.size >= TOKENS.size * 64]
        return [a for a in big if a.dtype == jnp.float32], [
            a for a in big if a.dtype != jnp.float32
        ]

    (wide_1, half_1), (wide_3, half_3) = kept(1), kept(3)
    assert wide_1 == wide_3 == []
    assert len(half_3) > len(half_1)


@pytest.mark.parametrize(
    "policy, kept_in_block",
    [
        (jax.checkpoint_policies.nothing_saveable, []),
        (jax.checkpoint_policies.dots_saveable, ["float16[64,128]"] * 2),
    ],
)
def test_the_users_own_checkpoint_inside_autocast_keeps_what_its_policy_saves(
    policy, kept_in_block
):
    # autocast's region is checkpointed to keep only what it names; inside the user's own
    # `jax.checkpoint` only what the user's policy saves is named (JAX applies the outermost
    # policy to everything inside it).
    from jax._src.ad_checkpoint import saved_residuals

    x = jax.random.normal(jax.random.key(0), (64, 32))
    w = [jax.random.normal(jax.random.key(i), s) for i, s in enumerate([(32, 128), (128, 128)])]

    def block(w, h):
        return jnp.tanh(jnp.tanh(h @ w[0]) @ w[1])

    def loss(w):
        return jnp.sum(jax.checkpoint(block, policy=policy)(w, x) @ w[0].T)

    found = saved_residuals(jmp.autocast(loss, "mixed_float16"), w)
    kept = sorted(str(a) for a, why in found if "argument" not in why and a.size >= 64 * 128)
    # Outside the block: its output, the half operand of the last matmul.
    assert kept == sorted(["float16[64,128]", *kept_in_block]), kept


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_a_half_precision_tanh_is_kept_once_and_not_computed_again(policy):
    # tanh's derivative reads its output: the region keeps it (one half-precision value, which
    # the next matmul takes as its operand too) rather than running tanh again in the backward
    # pass. Inside the user's own checkpoint the user's policy decides (test above).
    def loss(w1, w2, x):
        return jnp.mean(jnp.tanh(x @ w1) @ w2)

    w1, w2 = jnp.ones((64, 128)) * 0.01, jnp.ones((128, 8))
    x = jax.random.normal(jax.random.key(0), (32, 64))
    f = jmp.autocast(loss, policy)
    half = jmp.get_policy(policy).compute_dtype
    assert residual_bytes(f, w1, w2, x) == {half.name: 32 * 128 * half.itemsize}
    program = jax.make_jaxpr(jax.grad(f))(w1, w2, x)
    assert sum(e.primitive.name == "tanh" for e, _ in _jaxpr.walk(program)) == 1
    rtol = 2e-2 if half == jnp.float16 else 2e-1
    np.testing.assert_allclose(
        jax.grad(f)(w1, w2, x), jax.grad(loss)(w1, w2, x), rtol=rtol, atol=1e-5
    )


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_a_norms_half_precision_input_is_kept_not_made_again_from_the_residual_stream(policy):
    # A pre-norm residual stack: each norm (a float32 island) reads the half-precision sum of
    # every block before it. The region keeps that input (once) and computes the norm again
    # from it in the backward pass; it does not make the sum again there (the float16 Equinox
    # example's XLA:CPU gradient spent 1.22x of MPX's time on that, 0.90-0.94x now).
    def norm(x):
        mean = jnp.mean(x, -1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(jnp.var(x, -1, keepdims=True) + 1e-6)

    def loss(ws, x):
        x = x @ ws[0]
        for w in ws[1:]:
            x = x + norm(x) @ w
        return jnp.mean(norm(x) ** 2)

    ws = [jax.random.normal(jax.random.key(i), (64, 64)) / 8 for i in range(5)]
    x = jax.random.normal(jax.random.key(9), (32, 64))
    f = jmp.autocast(loss, policy)
    half = jmp.get_policy(policy).compute_dtype

    def adds(program):
        return sum(
            e.primitive.name == "add" and e.outvars[0].aval.shape == (32, 64)
            for e, _ in _jaxpr.walk(program)
        )

    forward = adds(jax.make_jaxpr(f)(ws, x))
    assert forward == 4  # the residual adds, in half precision
    assert adds(jax.make_jaxpr(jax.grad(f))(ws, x)) == forward  # none made again
    kept = residual_bytes(f, ws, x)
    assert set(kept) == {half.name}  # nothing of the islands kept in float32
    # The norms' inputs (the first matmul's output, each block's sum) and the half-precision
    # norm outputs the matmuls take: nine values of 32 x 64, none twice.
    assert kept[half.name] == 9 * 32 * 64 * half.itemsize
    rtol = 3e-2 if half == jnp.float16 else 2e-1
    for got, want in zip(jax.grad(f)(ws, x), jax.grad(loss)(ws, x), strict=True):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=2e-3)


def test_no_widen_op_narrow_pair_in_a_block():
    # A bias add runs in half precision: no value is widened, added to and narrowed back.
    block = GPT(dim=64, length=32, layers=1)
    jaxpr = jax.make_jaxpr(jmp.autocast(lambda p: block.apply({"params": p}, TOKENS)))(PARAMS)
    program = jaxpr.jaxpr  # the region runs inline in the caller's trace
    if program.eqns[0].primitive is remat_p:  # the region's own jax.checkpoint
        program = program.eqns[0].params["jaxpr"]
    widened = {
        e.outvars[0]
        for e in program.eqns
        if e.primitive.name == "convert_element_type"
        and e.invars[0].aval.dtype == jnp.float16
        and e.outvars[0].aval.dtype == jnp.float32
    }
    narrowing = [
        e
        for e in program.eqns
        if e.primitive.name == "convert_element_type" and e.outvars[0].aval.dtype == jnp.float16
    ]
    producers = _jaxpr.producers(program)  # a value named for the backward pass: its maker
    for e in narrowing:
        made = producers.get(e.invars[0])
        if made is not None and made.primitive.name in ("add", "sub", "mul"):
            assert not any(v in widened for v in made.invars if not isinstance(v, jcore.Literal)), (
                made
            )
    # ...and every add that takes a matmul's output (the bias adds, the residual adds) stays
    # in half precision (torch's "promote" made them float32).
    adds = [
        e
        for e in program.eqns
        if e.primitive.name == "add"
        and any(
            not isinstance(v, jcore.Literal)
            and producers.get(v) is not None
            and producers[v].primitive.name in ("dot_general", "custom_vjp_call")
            and v.aval.dtype == jnp.float16  # a matmul's output, not an island op's
            for v in e.invars
        )
    ]
    assert len(adds) >= 4
    assert {e.outvars[0].aval.dtype for e in adds} == {jnp.dtype(jnp.float16)}


def test_a_fully_masked_row_stays_finite():
    # finfo(float32).min cast to a half format would be -inf: the cast saturates instead.
    def attend(w, x, mask):
        logits = jnp.where(mask, x @ w, jnp.finfo(jnp.float32).min)
        return jax.nn.softmax(logits, axis=-1)

    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    mask = jnp.array([[1, 1, 0, 0], [0, 0, 0, 0]], bool)
    for policy in ("mixed_float16", "mixed_bfloat16"):
        mixed = jmp.autocast(attend, policy)
        out = jax.jit(mixed)(w, x, mask)
        np.testing.assert_allclose(out, [[0.5, 0.5, 0, 0], [0.25] * 4])
        grad = jax.jit(jax.grad(lambda w, mixed=mixed: mixed(w, x, mask).sum()))(w)
        assert np.isfinite(grad).all()


@pytest.mark.parametrize("policy,rtol", [("mixed_float16", 2e-2), ("mixed_bfloat16", 1e-1)])
def test_gradients_match_float32(policy, rtol):
    loss = _loss(MODEL)
    want = jax.jit(jax.grad(loss))(PARAMS)
    got = jax.jit(jax.grad(jmp.autocast(loss, policy)))(PARAMS)
    # Against the gradient's global scale: some leaves' true gradient is zero (a key bias:
    # softmax does not see a shift shared by every key).
    scale = max(float(jnp.abs(w).max()) for w in jax.tree.leaves(want))
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        assert g.dtype == jnp.float32
        assert float(jnp.abs(g - w).max()) <= rtol * scale
    np.testing.assert_allclose(
        jax.jit(jmp.autocast(loss, policy))(PARAMS), jax.jit(loss)(PARAMS), rtol=rtol / 4
    )


def test_equinox_keeps_no_more_than_mpx_would():
    # MPX casts the whole model to half precision; eqx.mixed_precision keeps the float32 list
    # in float32 and must still keep at most the bytes of a model cast whole.
    model = eqx.nn.MLP(16, 4, 64, 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (32, 16))

    def bytes_of(model):
        arrays, static = eqx.partition(model, eqx.is_array)

        def loss(arrays):
            out = jax.vmap(eqx.combine(arrays, static))(x)
            return jax.nn.logsumexp(out.astype(jnp.float32), axis=-1).mean()

        return sum(residual_bytes(loss, arrays).values())

    whole = jax.tree.map(lambda a: a.astype(jnp.float16) if eqx.is_inexact_array(a) else a, model)
    with jax.numpy_dtype_promotion("standard"):  # a model cast whole mixes dtypes
        assert bytes_of(jmp.eqx.mixed_precision(model, "mixed_float16")) <= bytes_of(whole)


HALF = ["mixed_float16", "mixed_bfloat16"]


def _linen_case(name, dtype=None):
    """A Linen model of the suite written with `dtype=` on every layer, its input and labels,
    and the collections `apply` updates."""
    tokens = jax.random.randint(jax.random.key(0), (4, 64), 0, 64)
    if name == "MLP":
        x = jax.random.normal(jax.random.key(0), (64, 32))
        return MLP((128, 128), 10, dtype=dtype), x, jnp.zeros(64, jnp.int32), False
    if name == "CNN + BatchNorm":
        x = jax.random.normal(jax.random.key(0), (8, 16, 16, 3))
        return CNN((8, 16), 4, dtype=dtype), x, jnp.zeros(8, jnp.int32), ["batch_stats"]
    scan = name == "nn.scan GPT"
    return GPT(dim=32, length=64, layers=4, scan=scan, dtype=dtype), tokens, tokens, False


def _linen_loss(apply, variables, x, labels, mutable):
    rest = {k: v for k, v in variables.items() if k != "params"}

    def loss(params):
        out = apply({"params": params, **rest}, x, mutable=mutable)
        logits = out[0] if mutable else out
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), labels
        ).mean()

    return loss


@pytest.mark.parametrize("policy", HALF)
@pytest.mark.parametrize("name", ["MLP", "GPT loop", "nn.scan GPT", "CNN + BatchNorm"])
def test_linen_integrations_keep_at_most_0_6x_and_what_flax_own_dtype_keeps(name, policy):
    model, x, labels, mutable = _linen_case(name)
    variables = jax.jit(model.init)(jax.random.key(1), x)

    def kept(apply, transform=lambda f: f):
        loss = transform(_linen_loss(apply, variables, x, labels, mutable))
        return sum(residual_bytes(loss, variables["params"]).values())

    full = kept(model.apply)
    with jax.numpy_dtype_promotion("standard"):  # Flax's own model mixes dtypes as written
        own = kept(_linen_case(name, jmp.get_policy(policy).compute_dtype)[0].apply)
    mixed = jmp.linen.mixed_precision(model, jmp.get_policy(policy))
    linen = kept(mixed.apply)
    assert linen <= min(own, 0.6 * full), (linen / full, own / full)
    # autocast's float32 islands are computed again from what it keeps, as the Linen
    # policy's are: no more than 0.55x of float32, and the Linen policy's + 0.05.
    ours = kept(model.apply, lambda f: jmp.autocast(f, policy))
    assert ours <= min(own, 0.55 * full, linen + 0.05 * full), (ours / full, linen / full)


@pytest.mark.parametrize("policy", HALF)
def test_nnx_keeps_at_most_0_6x_and_what_its_own_dtype_keeps(policy):
    tokens = jax.random.randint(jax.random.key(0), (4, 64), 0, 64)

    def kept(model):
        graph, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(params):
            logits = nnx.merge(graph, params, rest)(tokens).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

        return sum(residual_bytes(loss, params).values())

    half = jmp.get_policy(policy).compute_dtype
    own = NNXGPT(64, 32, 4, rngs=nnx.Rngs(0))
    for _, module in nnx.iter_graph(own):  # Flax's own dtype= on every layer
        if isinstance(module, nnx.Module) and hasattr(module, "dtype"):
            module.dtype = half
    full = kept(NNXGPT(64, 32, 4, rngs=nnx.Rngs(0)))
    with jax.numpy_dtype_promotion("standard"):
        own = kept(own)
    ours = kept(jmp.nnx.mixed_precision(NNXGPT(64, 32, 4, rngs=nnx.Rngs(0)), policy))
    assert ours <= min(own, 0.6 * full), (ours / full, own / full)


def _weight_copies(loss, params) -> list[str]:
    """The residuals of `jax.grad(loss)` shaped like one of `params`' matrices that the
    forward pass made (a cast of a weight), not `params` themselves."""
    from jax._src.ad_checkpoint import saved_residuals

    shapes = {leaf.shape for leaf in jax.tree.leaves(params) if leaf.ndim >= 2}
    assert shapes, "no weight matrix among the parameters: nothing would be checked"
    return sorted(
        str(aval)
        for aval, why in saved_residuals(loss, params)
        if aval.shape in shapes and "argument" not in why
    )


def test_no_copy_of_a_weight_is_kept_for_the_backward_pass():
    # Each matmul keeps its float32 weight, the argument itself (under FSDP the device's own
    # shard), and casts it again in the backward pass (gathered there in 16 bits:
    # tests/test_matmul.py's collectives), where Flax's own `dtype=` keeps a 16-bit copy of
    # every weight: gathered whole under FSDP, once per layer.
    model, tokens, labels, _ = _linen_case("GPT loop")
    variables = jax.jit(model.init)(jax.random.key(1), tokens)
    params = variables["params"]
    flax_own = _linen_case("GPT loop", jnp.bfloat16)[0]
    with jax.numpy_dtype_promotion("standard"):  # Flax's own model mixes dtypes as written
        own = _weight_copies(_linen_loss(flax_own.apply, variables, tokens, labels, False), params)
    assert len(own) >= 4 * 6, own  # q, k, v, out, up, down of every block
    policy = jmp.linen.mixed_precision(model, "mixed_bfloat16")
    assert _weight_copies(_linen_loss(policy.apply, variables, tokens, labels, False), params) == []
    autocast = jmp.autocast(
        _linen_loss(model.apply, variables, tokens, labels, False), "mixed_bfloat16"
    )
    assert _weight_copies(autocast, params) == []

    nnx_model = jmp.nnx.mixed_precision(NNXGPT(64, 32, 4, rngs=nnx.Rngs(0)), "mixed_bfloat16")
    graph, nnx_params, rest = nnx.split(nnx_model, nnx.Param, ...)

    def nnx_loss(params):
        logits = nnx.merge(graph, params, rest)(tokens).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    assert _weight_copies(nnx_loss, nnx_params) == []


@pytest.mark.parametrize("policy", HALF)
def test_equinox_example_keeps_at_most_0_6x_and_what_mpx_keeps(policy):
    sys_path_example()
    from equinox_transformer import CharLM

    mpx = pytest.importorskip("mpx")  # mixed-precision-for-jax, a test extra
    tokens = jax.random.randint(jax.random.key(0), (4, 64), 0, 128)
    model = CharLM(jax.random.key(1), length=64, layers=2)

    def kept(call):
        arrays, static = eqx.partition(model, eqx.is_array)

        def loss(arrays):
            logits = jax.vmap(call(eqx.combine(arrays, static)))(tokens)
            return optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), tokens
            ).mean()

        return sum(residual_bytes(loss, arrays).values())

    mpx.set_half_precision_datatype(jmp.get_policy(policy).compute_dtype)
    with jax.numpy_dtype_promotion("standard"):  # MPX's model mixes dtypes
        theirs = kept(mpx.cast_to_half_precision)
    ours = kept(lambda m: jmp.eqx.mixed_precision(m, policy))
    full = kept(lambda m: m)
    assert ours <= min(theirs, 0.6 * full), (ours / full, theirs / full)


@pytest.mark.parametrize("policy", HALF)
def test_no_cast_a_hand_written_model_would_not_have(policy):
    # One block of each integration: no half value widened for an op and narrowed back (a
    # bias add in float32), no float32 value narrowed and widened back (bits lost for
    # nothing, e.g. the head's logits). `round_trips` finds both (6 pairs a block in the
    # Linen and NNX integrations before their bias adds ran in half precision).
    half = jmp.get_policy(policy).compute_dtype
    tokens = jnp.zeros((2, 16), jnp.int32)
    gpt = GPT(dim=32, length=16, layers=1)
    params = gpt.init(jax.random.key(1), tokens)["params"]
    mixed = jmp.linen.mixed_precision(gpt, jmp.get_policy(policy))
    block = jmp.nnx.mixed_precision(NNXBlock(32, 4, rngs=nnx.Rngs(0)), policy)
    with_head = jmp.nnx.mixed_precision(NNXGPT(64, 32, 1, rngs=nnx.Rngs(0)), policy)
    sys_path_example()
    from equinox_transformer import Block

    eqx_block = jmp.eqx.mixed_precision(Block(32, 4, jax.random.key(0)), policy)
    x = jax.random.normal(jax.random.key(2), (16, 32))
    mask = jnp.tril(jnp.ones((16, 16), bool))
    programs = {
        "linen": jax.make_jaxpr(lambda p: mixed.apply({"params": p}, tokens))(params),
        "autocast": jax.make_jaxpr(
            jmp.autocast(lambda p: gpt.apply({"params": p}, tokens), policy)
        )(params),
        # Inside a model a block's input is an activation in the compute dtype.
        "nnx block": jax.make_jaxpr(lambda x: block(x))(x[None].astype(half)),
        "nnx with head": jax.make_jaxpr(lambda t: with_head(t))(tokens),
        "equinox": jax.make_jaxpr(lambda x: eqx_block(x, mask))(x),
    }
    for how, program in programs.items():
        found = round_trips(program)
        assert found == {"widen_op_narrow": [], "lossy": []}, (how, found)


def sys_path_example():
    """The examples folder on the path (the Equinox example's model)."""
    if str(ROOT / "examples") not in sys.path:
        sys.path.insert(0, str(ROOT / "examples"))


@pytest.mark.parametrize("policy", HALF)
def test_the_float32_list_still_computes_in_float32_in_every_integration(policy):
    # Exp and log (softmax, the loss), rsqrt and sums (normalisation statistics) in float32;
    # matmuls in the compute dtype.
    sys_path_example()
    from equinox_transformer import CharLM

    half = jmp.get_policy(policy).compute_dtype.name
    tokens = TOKENS[:, :32]

    def cross_entropy(logits):
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), tokens
        ).mean()

    gpt = GPT(dim=32, length=32, layers=2)
    params = gpt.init(jax.random.key(1), tokens)["params"]
    mixed = jmp.linen.mixed_precision(gpt, jmp.get_policy(policy))
    graph, state = nnx.split(jmp.nnx.mixed_precision(NNXGPT(64, 32, 2, rngs=nnx.Rngs(0)), policy))
    charlm = jmp.eqx.mixed_precision(CharLM(jax.random.key(1), vocab=64, length=32), policy)
    reports = {
        "linen": jmp.precision_report(
            lambda p: cross_entropy(mixed.apply({"params": p}, tokens)), params
        ),
        "autocast": jmp.precision_report(
            jmp.autocast(lambda p: cross_entropy(gpt.apply({"params": p}, tokens)), policy), params
        ),
        "nnx": jmp.precision_report(lambda s: cross_entropy(nnx.merge(graph, s)(tokens)), state),
        "equinox": jmp.precision_report(lambda m: cross_entropy(jax.vmap(m)(tokens)), charlm),
    }
    for how, report in reports.items():
        counts = report.counts
        for primitive in ("exp", "log", "rsqrt", "reduce_sum"):
            assert set(counts[primitive]) == {"float32"}, (how, primitive, counts[primitive])
        assert counts["dot_general"] == {half: 17}, (how, counts["dot_general"])
