"""One name per layer: what the precision debugger advises is what `overrides` take.

On models written the way Flax's and Equinox's examples write them (a Linen model whose
`__call__` calls its own `encode`/`decode`, a Linen `nn.scan` stack, NNX `nnx.scan` over
layers `nnx.vmap` made, an Equinox RNN under `lax.scan`), a layer whose values do not fit
float16 is planted; `advice()["overrides"]` passed as they are to the integration the model
came from match (no "matches no module path" warning) and the advised layer runs in float32.
"""

import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from models import ScanMLP

import jmp_policy as jmp
from jmp_policy._core import naming as _naming
from jmp_policy._reports.census import compute_dtype, iter_equations, module_path_of, trace

X = jax.random.normal(jax.random.key(0), (4, 8))
F32 = jmp.get_policy("float32")


def rescaled(x):
    """Scaled down 1e12 and back: values over more binades than float16 holds."""
    return (x * 1e-12) * 1e12


class LinenRescaled(nn.Module):
    @nn.compact
    def __call__(self, x):
        return rescaled(x)


class Encoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="proj")(LinenRescaled(name="rescaled")(x))


class Transformer(nn.Module):
    """Flax's translation example's shape: `setup` submodules, methods `__call__` calls."""

    def setup(self):
        self.encoder = Encoder()
        self.decoder = nn.Dense(8)

    def encode(self, x):
        return self.encoder(x)

    def decode(self, h):
        return self.decoder(h)

    def __call__(self, x):
        return self.decode(self.encode(x))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.Dense(8, name="fc")(LinenRescaled(name="rescaled")(x)), None


class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
        scan = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        return scan(name="layers")(x, None)[0]


class NNXRescaled(nnx.Module):
    def __call__(self, x):
        return rescaled(x)


class NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(8, 8, rngs=rngs)
        self.rescaled = NNXRescaled()

    def __call__(self, x):
        return self.linear(self.rescaled(x))


class NNXStack(nnx.Module):
    """Flax's NNX scan-over-layers example's shape."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(axis_size=3)
        def create_block(rngs):
            return NNXBlock(rngs)

        self.layers = create_block(rngs)

    def __call__(self, x):
        @nnx.scan
        def scan_fn(x, block):
            return block(x), None

        return scan_fn(x, self.layers)[0]


class EqxRescaled(eqx.Module):
    def __call__(self, x):
        return rescaled(x)


class RNN(eqx.Module):
    """Equinox's RNN example's shape: a GRU cell under `lax.scan`."""

    cell: eqx.nn.GRUCell
    post: EqxRescaled
    linear: eqx.nn.Linear

    def __init__(self, key):
        cell_key, linear_key = jax.random.split(key)
        self.cell = eqx.nn.GRUCell(8, 8, key=cell_key)
        self.post = EqxRescaled()
        self.linear = eqx.nn.Linear(8, 2, key=linear_key)

    def __call__(self, xs):
        def step(h, x):
            return self.post(self.cell(x, h)), None

        h, _ = jax.lax.scan(step, jnp.zeros(8), xs)
        return self.linear(h)


def linen_case(model, advised, method=None):
    params = model.init(jax.random.key(1), X, method=method)["params"]

    def loss(params, x):
        return jnp.mean(model.apply({"params": params}, x, method=method) ** 2)

    def mixed(overrides):
        policy = jmp.linen.mixed_precision(model, "mixed_float16", overrides)
        return lambda x: policy.apply({"params": params}, x, method=method)

    return loss, (params, X), mixed, advised


def nnx_case():
    def loss(model, x):
        return jnp.mean(model(x) ** 2)

    def mixed(overrides):
        return jmp.nnx.mixed_precision(NNXStack(nnx.Rngs(0)), "mixed_float16", overrides)

    return loss, (NNXStack(nnx.Rngs(0)), X), mixed, "layers/rescaled"


def eqx_case():
    model, xs = RNN(jax.random.key(1)), X[None].repeat(3, 0)

    def loss(model, xs):
        return jnp.mean(jax.vmap(model)(xs) ** 2)

    def mixed(overrides):
        policy = jmp.eqx.mixed_precision(model, "mixed_float16", overrides=overrides)
        return lambda x: jax.vmap(policy)(xs)

    return loss, (model, xs), mixed, "post"


CASES = {
    "linen methods": lambda: linen_case(Transformer(), "encoder/rescaled"),
    "linen apply(method=...)": lambda: linen_case(
        Transformer(), "encoder/rescaled", Transformer.encode
    ),
    "linen nn.scan": lambda: linen_case(Stack(), "layers/rescaled"),
    "nnx.scan over nnx.vmap": nnx_case,
    "equinox lax.scan": eqx_case,
}


def dtypes_in(fun, x, path: str, *more) -> set:
    """The dtypes the operations of the module at `path` (and inside it) compute in (casts
    left out: they are its boundary)."""
    with _naming.module_names():
        program = trace(fun, x, *more)  # as precision_report traces (an NNX model an argument)
    found = set()
    for eqn in iter_equations(program):
        where = _naming.relative(module_path_of(str(eqn.source_info.name_stack)))
        dtype = compute_dtype(eqn)
        if eqn.primitive.name == "convert_element_type" or dtype is None:
            continue
        if where == path or where.startswith(path + "/"):
            found.add(str(dtype))
    return found


@pytest.mark.parametrize("case", sorted(CASES))
def test_advice_goes_to_overrides_as_it_is(case):
    loss, args, mixed, advised = CASES[case]()
    report = jmp.debug_precision(loss, *args)
    # The debugger prints each layer once, under the name `overrides` take.
    printed = {_naming.relative(s.layer) for s in report.layers}
    assert advised in printed, printed
    assert not [p for p in printed if p != advised and p.endswith("/rescaled")], printed
    overrides = report.advice()["overrides"]
    assert overrides.get(advised) == "float32", overrides
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = mixed({path: jmp.get_policy(p) for path, p in overrides.items()})
        assert dtypes_in(run, X, advised) == {"float32"}
    unmatched = [str(w.message) for w in caught if "matches no module path" in str(w.message)]
    assert not unmatched
    # Without the override, the same layer computes in float16: the advice changed it.
    assert "float16" in dtypes_in(mixed({}), X, advised)


def test_an_unmatched_override_names_the_models_own_paths():
    model = Transformer()
    params = model.init(jax.random.key(1), X)["params"]
    policy = jmp.linen.mixed_precision(model, "mixed_float16", {"Encoder_0/Dense_1": F32})
    with pytest.warns(UserWarning, match=r"this model's paths look like 'encoder'"):
        policy.apply({"params": params}, X)
    # The debugger's printed name (with the root's class name) is accepted too.
    printed = jmp.linen.mixed_precision(
        model, "mixed_float16", {"Transformer/encoder/rescaled": F32}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        run = lambda x: printed.apply({"params": params}, x)  # noqa: E731
        assert dtypes_in(run, X, "encoder/rescaled") == {"float32"}


def test_equinox_overrides_are_checked_at_construction():
    with pytest.raises(TypeError, match="overrides"):
        jmp.eqx.mixed_precision(
            RNN(jax.random.key(0)), "mixed_float16", overrides={1: jmp.get_policy("float32")}
        )


def test_flax_scan_over_layers_takes_the_advice_it_gets_in_float32():
    """Flax's 06_scan_over_layers model judged in float32: the advice moves its BatchNorm and
    its Dropout (values past float16's range) to float32. Passed back as it is, the Dropout
    island at the end of the scanned block leaves the block's output in float32: the block
    hands it back in float16, so `nnx.scan`'s carry keeps its dtype, and every matmul stays in
    float16."""
    x = jax.random.normal(jax.random.key(0), (16, 10)) * 300
    model = ScanMLP(10, n_layers=5, rngs=nnx.Rngs(0))
    advice = jmp.debug_precision(lambda m, x: jnp.mean(m(x) ** 2), model, x).advice()
    assert advice["overrides"] == {"layers/bn": "float32", "layers/dropout": "float32"}
    overrides = {path: jmp.get_policy(p) for path, p in advice["overrides"].items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        mixed = jmp.nnx.mixed_precision(
            ScanMLP(10, n_layers=5, rngs=nnx.Rngs(0)), "mixed_float16", overrides
        )
        report = jmp.precision_report(lambda m, x: m(x), mixed, x)
    assert report.counts["dot_general"] == {"float16": 5}
    assert dtypes_in(lambda x, m: m(x), x, "layers/dropout", mixed) == {"float32"}
