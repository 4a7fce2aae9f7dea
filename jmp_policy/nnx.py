"""A policy on an existing Flax NNX model, with float32 islands.

NNX modules are mutable objects that know their computation dtype (`dtype`)
and keep their parameters in `param_dtype`, so `mixed_precision(model,
policy)` sets every submodule's `dtype` to the compute dtype of the policy it
falls under (overrides give float32 islands), keeps the parameters stored in
`param_dtype`, and returns a `MixedPrecision` wrapper that casts the model's
inputs to the compute dtype and its outputs to `output_dtype`. Nothing else of
the user's modules changes (no class, no attribute of ours): what a module does
besides its `dtype` (name scopes, float32 islands recomputed in the backward
pass) is done on the wrapper's own copy of the model for each call. The model's
state tree (parameters, batch statistics) keeps its structure, so checkpoints of
the float32 model load unchanged (`nnx.update(wrapped.model, state)`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jmp_policy import matmul
from jmp_policy._core import jaxpr as _jaxpr
from jmp_policy._core.compat import set_variable_value, variable_value
from jmp_policy._core.naming import SCOPED_FROM, module_path
from jmp_policy._core.overrides import FLOAT32, FLOAT32_ISLAND, Overrides, is_compute_dtype
from jmp_policy._core.pytree import ByEquality, signature
from jmp_policy._core.tracing import traced_once
from jmp_policy._flax.fp8_layers import NnxDelayedDot, layer_recipe, stacked_shape
from jmp_policy._flax.layers import (
    NNX_NORMS,
    attention_with_float32_softmax,
    block_keeps_its_dtype,
    fp8_dot_for,
    note_matmul_layer,
    recomputed,
    recomputes,
    warning_if_head_in_low_precision,
)
from jmp_policy._flax.nnx_skip import revert_if_skipped as revert_if_skipped  # public here
from jmp_policy._reports.census import warn_float32_matmuls
from jmp_policy.autocast import cast_at_use
from jmp_policy.policy import (
    Policy,
    cast_floating,
    casting_policy,
    check_model_policy,
    is_floating_array,
)

NORMS_IN_FLOAT32: Mapping[type, Policy] = types.MappingProxyType(dict.fromkeys(NNX_NORMS, FLOAT32))
"""The default overrides: Flax's normalisation layers compute in float32."""


class _Once:
    """Which call signatures the float32 check has seen (static on the wrapper)."""

    def __init__(self):
        self.seen: set[Any] = set()


@dataclasses.dataclass(frozen=True)
class _Layer:
    """What `mixed_precision` decided for one module, read by its calls inside the wrapper:
    the name scopes it runs in (its attribute path below the nearest module that opens one,
    and the float32-island marker), its compute dtype, the policy its inputs are cast by (an
    override computing in another dtype than the model around it), the float32 island it
    runs as, recomputed in the backward pass (a normalisation layer: (its policy, the dtype
    its output goes back in)), and the dtype its own Params are cast to for its call (a
    module without a `dtype` attribute that multiplies its own Params)."""

    scope: tuple[str, ...]
    compute: Any
    inputs: Policy | None = None
    recompute: tuple[Policy, Any] | None = None
    own_params: Any = None


def _run(module: nnx.Module, base: type, layer: _Layer, args: tuple, kwargs: dict) -> Any:
    """`base.__call__(module, *args, **kwargs)` as `layer` says: in its name scopes (so
    operations carry NNX module paths in their name stacks as Linen's do: `precision_report`,
    the float32 check and the precision debugger name layers by them), its inputs cast, as a
    recomputed float32 island, or with its own Params cast to its compute dtype."""
    if layer.inputs is not None:
        args, kwargs = layer.inputs.cast_to_compute((args, kwargs))
    with contextlib.ExitStack() as scopes:
        for name in layer.scope:
            scopes.enter_context(jax.named_scope(name))
        note_matmul_layer(module, module_path(_jaxpr.current_name_stack()), args)
        if layer.recompute is not None:
            cast, back_to = layer.recompute
            return _recomputed(module, base, cast, back_to, args, kwargs)
        with _own_params_cast(module, layer.own_params):
            out = base.__call__(module, *args, **kwargs)
        if layer.inputs is None and args:  # not an island itself
            out = block_keeps_its_dtype(args[0], out, layer.compute)
        return out


def _scoped_class(base: type, layer: _Layer) -> type:
    """A subclass of `base` whose calls run as `layer` says (`_run`). Only the copy of the
    model the wrapper makes for a call (`nnx.merge` of its graph, `MixedPrecision._functional`)
    is given it: the user's modules keep their classes."""

    def __call__(self, *args, **kwargs):
        return _run(self, base, layer, args, kwargs)

    return type(
        base.__name__,
        (base,),
        {
            "__call__": __call__,
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
            "__doc__": base.__doc__,
            SCOPED_FROM: base,
        },
    )


class _AtUse:
    """The model's `autocast.cast_at_use` programs, one per graph (static on the wrapper)."""

    def __init__(self, weights_in_float32: bool, accumulate: Any = None):
        self.programs = ByEquality()  # one per graph definition
        self.weights_in_float32 = weights_in_float32
        self.accumulate = accumulate


class MixedPrecision(nnx.Module):
    """An NNX model run under a policy (what `mixed_precision` returns); call it like the
    model, train it with `nnx.Optimizer(wrapped, tx, wrt=nnx.Param)`.

    Attributes:
      model: the wrapped model (the user's object): its layers compute in their policies'
        dtypes, its Params are stored in `param_dtype`, and its state tree is the float32
        model's (a checkpoint of the float32 model loads into it:
        `nnx.update(wrapped.model, state)`).
    """

    def __init__(
        self,
        model: nnx.Module,
        policy: Policy,
        root: _Layer,
        classes: tuple[tuple[tuple[str, ...], type], ...],
        at_use: _AtUse | None,
    ):
        self.model = model
        self.policy = nnx.static(policy)
        self.root = nnx.static(root)  # how the model's own call runs
        self.classes = nnx.static(classes)  # (path, `_scoped_class`) for each submodule's call
        self.checked = nnx.static(_Once())
        self.at_use = nnx.static(at_use)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        policy = self.policy
        args, kwargs = policy.cast_to_compute((args, kwargs))
        key = signature((args, kwargs))
        # The first call with each signature runs the model once: the program it traces
        # serves the float32-matmul check and the call.
        check = policy.compute_dtype != jnp.float32 and key not in self.checked.seen
        self.checked.seen.add(key)
        graphdef, params, rest = nnx.split(self.model, nnx.Param, ...)
        run = self._functional(graphdef)
        with warning_if_head_in_low_precision():
            at_use = self.at_use
            if at_use is not None:
                program: Any = at_use.programs.get(
                    graphdef,
                    lambda: cast_at_use(
                        run,
                        weights_in_float32=at_use.weights_in_float32,
                        accumulate_dtype=at_use.accumulate,
                    ),
                )
                if check:
                    _check(program.traced_program(params, rest, args, kwargs))
                out, state = program(params, rest, args, kwargs)
            elif check:
                traced, result = traced_once(run, params, rest, args, kwargs)
                _check(traced)
                out, state = result()
            else:
                out, state = run(params, rest, args, kwargs)
        nnx.update(self.model, state)
        return policy.cast_to_output(out)

    def _functional(self, graphdef: Any) -> Any:
        """The model's call as a function of its weights and other state: `(params, rest,
        args, kwargs) -> (out, the state besides weights as the call left it)`, run on a
        copy of the model whose modules run as `mixed_precision` decided (`_run`)."""
        root, classes = self.root, dict(self.classes)

        def run(params, rest, args, kwargs):
            inner = nnx.merge(graphdef, params, rest)
            for path, node in nnx.iter_graph(inner):
                cls = classes.get(tuple(str(p) for p in path))
                if cls is not None and type(node) is vars(cls)[SCOPED_FROM]:
                    node.__class__ = cls  # the call's own copy, not the user's module
            out = _run(inner, type(inner), root, args, kwargs)
            return out, nnx.split(inner, nnx.Param, ...)[2]

        return run


def _check(program: Any) -> None:
    warn_float32_matmuls(program, "jmp_policy.nnx.mixed_precision", stacklevel=4)


def _has_call(cls: type) -> bool:
    return any("__call__" in vars(k) for k in cls.__mro__[:-1])


def mixed_precision(
    model: nnx.Module,
    policy: Policy,
    overrides: Mapping[Any, Policy] = NORMS_IN_FLOAT32,
    *,
    reduce_dtype: Any = jnp.float32,
    accumulate_dtype: Any = None,
    fp8_scaling: Any = "tensorwise",
) -> MixedPrecision:
    """`model` run under `policy`: a `MixedPrecision` wrapper to call and train.

    Every submodule with a `dtype` attribute (Flax's layers: Linear, Conv,
    Embed, LayerNorm, BatchNorm, MultiHeadAttention and its projections, ...)
    computes in the compute dtype of the policy it falls under (its `dtype` is
    set); parameters are cast to that policy's `param_dtype` (a no-op for
    float32 master weights); attention modules that use Flax's default
    attention get `attention_with_float32_softmax`. Those fields are all that
    changes on the user's modules. The wrapper casts the floating inputs to the
    compute dtype and the outputs to `output_dtype`, and runs each call on its
    own copy of the model (`nnx.merge` of its graph), whose modules run in
    name scopes of their paths and as the policy's float32 islands. Works with
    `nnx.jit`, `nnx.grad` and `nnx.Optimizer(wrapped, tx, wrt=nnx.Param)`;
    gradients arrive in `param_dtype`.

    Args:
      model: an `nnx.Module` (Flax's layers or your own), or a `MixedPrecision`
        wrapper, whose model then takes this policy instead.
      policy: e.g. `jmp_policy.get_policy("mixed_float16")`. Under a float8
        policy (`"mixed_float8"`) the model computes in bfloat16 and every
        `Linear`/`LinearGeneral` multiplies in float8
        (`jmp_policy.fp8.Fp8DotGeneral`: current scaling, no state), except
        the logits head and the embedding (`jmp_policy.fp8.FP8_EXCLUDE`) and
        matmuls too small for float8 GEMMs.
      overrides: `{module class | glob path pattern | compiled regex: Policy}`;
        paths join attribute names with "/" (e.g. "blocks/0/attn"). They
        also choose which layers run in float8. Default: `NORMS_IN_FLOAT32`.
      reduce_dtype: float32 (default): under a half compute dtype, the model
        runs under `jmp_policy.autocast.cast_at_use`: every matmul or conv on
        a parameter (Flax's layers and your own `x @ w` alike) takes it in
        float32 and casts it inside the op (`jmp_policy.matmul`), so weight
        and bias gradients are made, and summed across devices, in float32,
        and an embedding's rows are gathered in float32.
        None: gradients in the compute dtype (half the bytes on the wire).
      accumulate_dtype: e.g. float32: each 16-bit matmul returns its sum in
        this dtype (`preferred_element_type`), the bias is added in it, and
        the arithmetic after it stays in it until an operation takes it back
        in the compute dtype (the next matmul). None (default): the compute
        dtype.
      fp8_scaling: under a float8 policy, "tensorwise" (current scaling, the
        default) or a `jmp_policy.fp8.DelayedScaling` recipe ("delayed": the
        default one): each float8 layer's `dot_general` becomes a submodule
        holding its scales and amax histories as an `Fp8State` (an `nnx.Param`:
        `nnx.grad` differentiates it, and a `loss_scaling` optimizer writes its
        gradient, the next state; docs/fp8.md).

    Returns:
      A `MixedPrecision` holding `model` (`wrapped.model`, its state tree
      unchanged). On the first call with each input signature it warns
      (`jmp_policy.errors.PrecisionWarning`) about matmuls/convs still in
      float32 outside overrides. Operations carry the layers' attribute paths
      (e.g. `layers/0/attn`) in their name stacks, so reports name NNX layers.
      An integer `dtype` (an index dtype) is left as it is.

    Raises:
      TypeError: `model` is not an NNX module, or `policy`/`overrides` are malformed.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import jmp_policy as jmp
      >>> model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
      >>> wrapped = jmp.nnx.mixed_precision(model, jmp.get_policy("mixed_bfloat16"))
      >>> model.dtype, model.kernel[...].dtype, wrapped(jnp.ones((1, 4))).dtype
      (dtype(bfloat16), dtype('float32'), dtype('float32'))
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"Expected a flax.nnx.Module for `model`, got {type(model).__name__}.")
    policy = check_model_policy(policy, "jmp_policy.nnx.mixed_precision")
    rules = Overrides(overrides, nnx.Module)
    reduce_dtype = matmul.check_reduce_dtype(reduce_dtype)
    accumulate_dtype = matmul.check_accumulate_dtype(accumulate_dtype)
    recipe = layer_recipe(fp8_scaling, policy)
    delayed = None
    if recipe is not None:
        state_recipe = recipe  # what the closure takes: never None

        def stacked_dot(path: tuple[str, ...], module: nnx.Module) -> NnxDelayedDot:
            return NnxDelayedDot(state_recipe, path, stacked_shape(module))

        delayed = stacked_dot

    if isinstance(model, MixedPrecision):  # a policy again: it replaces the one before
        model = model.model
    modules = {
        tuple(str(p) for p in path): node
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nnx.Module)
    }
    resolved: dict[tuple[str, ...], Policy] = {}
    scoped: set[tuple[str, ...]] = {()}  # modules whose calls open a name scope
    root: _Layer | None = None  # how the model's own call runs
    classes = []  # (path, `_scoped_class`) for each submodule with a call of its own
    at_use = False  # a module computes in 16 bits: the float32 list in the model's own code
    weights_at_use = False  # a 16-bit module owns a weight: each matmul on it takes it in float32
    for path in sorted(modules, key=len):  # parents before children
        module = modules[path]
        parent = max((p for p in resolved if path[: len(p)] == p), key=len, default=())
        own = rules.own_policy(path, module)
        resolved[path] = own or resolved.get(parent, policy)
        _apply_to_module(module, resolved[path], path, delayed)
        # A float32 normalisation layer inside a half-precision model keeps only its
        # half-precision input for the backward pass (`_recomputed`).
        island = casting_policy(resolved[path])
        outer = casting_policy(resolved.get(parent, policy))
        recompute = bool(path) and recomputes(module, NORMS_IN_FLOAT32, island, outer)
        # A module with its own override computing in another dtype than the model around it
        # gets its inputs cast to its compute dtype, as Linen's modules do.
        overridden = own is not None and island.compute_dtype != outer.compute_dtype
        # A module of the user's that multiplies its own Params (`x @ self.w + self.b`, as
        # NNX's examples write layers) has no `dtype` to set: its Params are cast to the
        # compute dtype for its call (`_own_params_cast`), as Linen's `self.param`s are.
        owns_params = bool(_own_floating_params(module))
        own_params = not hasattr(module, "dtype") and owns_params
        half = resolved[path].compute_dtype.itemsize == 2  # float8's layers are float8's
        # Under a float8 policy too, a layer without a `dtype` multiplies in bfloat16, the
        # policy's dtype for what float8 does not take (as Linen's `self.param`s are cast).
        sixteen = island.compute_dtype.itemsize == 2
        weights_at_use = weights_at_use or (reduce_dtype is not None and half and owns_params)
        at_use = at_use or sixteen  # float8's compute in bfloat16
        # The scope continues the nearest scoped ancestor's: containers without a
        # `__call__` (nnx.List, nnx.Dict) open none, so their names go here.
        above = max((p for p in scoped if path[: len(p)] == p), key=len)
        scope = ["/".join(path[len(above) :])] if path else []
        if own is not None and casting_policy(own).compute_dtype == jnp.float32:
            scope.append(FLOAT32_ISLAND)
        layer = _Layer(
            scope=tuple(scope),
            compute=island.compute_dtype,
            inputs=island if overridden and not recompute else None,  # a recompute casts its own
            recompute=(island, outer.compute_dtype) if recompute else None,
            own_params=island.compute_dtype if own_params and sixteen else None,
        )
        if not path:
            root = layer
        elif _has_call(type(module)):
            classes.append((path, _scoped_class(type(module), layer)))
            scoped.add(path)
    rules.warn_unmatched()
    # The model runs under `autocast.cast_at_use`: the float32 list holds in its own code
    # (segment sums, exp, log: `jmp_policy._core.rules.FLOAT32`), each matmul or conv on a
    # weight takes it in float32 (its gradient made in float32), and each 16-bit matmul
    # returns its sum in `accumulate_dtype`.
    at_use_program = _AtUse(weights_at_use, accumulate_dtype) if at_use else None
    assert root is not None  # the model itself is among `modules` (path ())
    return MixedPrecision(model, casting_policy(resolved[()]), root, tuple(classes), at_use_program)


@contextlib.contextmanager
def _own_params_cast(module: nnx.Module, dtype: Any) -> Iterator[None]:
    """During one call of `module`: its own floating Params hold their values cast to
    `dtype` (None: as they are); the stored values are put back after it. Under
    `autocast.cast_at_use` (the model's call) a matmul on such a cast takes the float32 value
    and casts inside (`jmp_policy.matmul`), so the weight's gradient is made in float32."""
    if dtype is None:
        yield
        return
    own = _own_floating_params(module)
    stored = [variable_value(v) for v in own]
    for variable, value in zip(own, stored, strict=True):
        set_variable_value(variable, cast_floating(value, dtype))
    try:
        yield
    finally:
        for variable, value in zip(own, stored, strict=True):
            set_variable_value(variable, value)


def _own_floating_params(module: nnx.Module) -> list:
    """The floating `nnx.Param`s a module holds itself (not its submodules')."""
    return [
        v
        for v in vars(module).values()
        if isinstance(v, nnx.Param) and is_floating_array(variable_value(v))
    ]


def _recomputed(
    module: nnx.Module, base: type, cast: Policy, back_to: Any, args: tuple, kwargs: dict
) -> Any:
    """`base.__call__(module, ...)` as `_flax_layers.recomputed` runs a float32 normalisation
    layer: its output handed back in `back_to`, only its half input kept for the backward
    pass. The module's state (BatchNorm's `BatchStat`s) is updated as the call left it."""
    graphdef, state = nnx.split(module)

    def call(state, *args, **kwargs):
        inner = nnx.merge(graphdef, state)
        out = base.__call__(inner, *args, **kwargs)
        return out, nnx.state(inner, nnx.Not(nnx.Param))  # the forward pass changes no weight

    out, updated = recomputed(call, cast, state, args, kwargs, back_to)
    nnx.update(module, updated)
    return out


def _apply_to_module(
    module: nnx.Module, policy: Policy, path: tuple[str, ...], delayed: Any = None
) -> None:
    # setattr: Flax's layers declare these attributes, nnx.Module does not.
    compute = casting_policy(policy).compute_dtype
    given = getattr(module, "dtype", _ABSENT)
    if given is not _ABSENT and is_compute_dtype(given):
        # An integer or bool `dtype` (indices, masks) is the model's, not the policy's.
        setattr(module, "dtype", compute)  # noqa: B010
    fp8_dot = fp8_dot_for(module, policy, path, delayed)  # float8's, or Flax's back
    if fp8_dot is not None:
        # A delayed-scaling dot is a submodule (its state is data); the others are static.
        wrap = nnx.data if isinstance(fp8_dot, nnx.Module) else nnx.static
        setattr(module, "dot_general", wrap(fp8_dot))  # noqa: B010
    half = compute != jnp.float32
    if half and getattr(module, "attention_fn", None) is nnx.dot_product_attention:
        setattr(module, "attention_fn", attention_with_float32_softmax)  # noqa: B010
    if hasattr(module, "param_dtype"):
        setattr(module, "param_dtype", policy.param_dtype)  # noqa: B010
    for value in vars(module).values():
        if isinstance(value, nnx.Param):
            set_variable_value(value, policy.cast_to_param(variable_value(value)))


_ABSENT = object()

__all__ = [
    "NORMS_IN_FLOAT32",
    "MixedPrecision",
    "attention_with_float32_softmax",
    "mixed_precision",
    "revert_if_skipped",
]
