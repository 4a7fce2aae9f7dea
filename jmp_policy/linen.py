"""A policy on an unmodified Flax Linen module, with float32 islands.

`mixed_precision(module, policy)` returns an object with the module's `init`
and `apply`: parameters stay stored in `param_dtype` (float32 master weights)
and are cast to each module's compute dtype for the forward pass, every module
computes in its policy's compute dtype (whatever `dtype` the model gave it) and
gets its floating inputs cast to it, and the model's output
comes back in `output_dtype`. Overrides (by class or path) give part of the
model another policy: by default normalisation layers run in float32.
Non-param collections (`batch_stats`, ...) are never cast down and are stored
back in their own dtype (float32).
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Collection, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core import unfreeze

from jmp_policy import matmul
from jmp_policy._flax_layers import attention_with_float32_softmax, recomputed, recomputes
from jmp_policy._pytree import signature, split_traced
from jmp_policy.autocast import cast_at_use as cast_at_use_program
from jmp_policy.census import trace, warn_float32_matmuls
from jmp_policy.fp8 import Fp8DotGeneral, float8_format, fp8_layer
from jmp_policy.overrides import FLOAT32, Overrides, is_compute_dtype, island_scope
from jmp_policy.policy import (
    Policy,
    casting_policy,
    check_model_policy,
    is_floating_array,
)

NORMS_IN_FLOAT32: Mapping[type, Policy] = types.MappingProxyType(
    {
        cls: FLOAT32
        for cls in (nn.LayerNorm, nn.BatchNorm, nn.GroupNorm, nn.RMSNorm, nn.InstanceNorm)
    }
)
"""The default overrides: Flax's normalisation layers compute in float32."""


class MixedPrecisionModule:
    """A Linen module run under a policy. Use its `init` and `apply` like the module's.

    Attributes:
      module: the unmodified Linen module.
      policy: the policy for everything not overridden.
      overrides: the validated overrides.
    """

    def __init__(
        self,
        module: nn.Module,
        policy: Policy,
        overrides: Mapping[Any, Policy],
        reduce_dtype: Any = jnp.float32,
        accumulate_dtype: Any = None,
    ):
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"Expected a flax.linen.Module for `module`, got {type(module).__name__}."
            )
        self.module = module
        self.policy = check_model_policy(policy, "jmp_policy.linen.mixed_precision")
        self.overrides = Overrides(overrides, nn.Module)
        self.reduce_dtype = matmul.check_reduce_dtype(reduce_dtype)
        self.accumulate_dtype = matmul.check_accumulate_dtype(accumulate_dtype)
        # Module path -> the policy it runs under, learnt from a trace (abstract,
        # so it costs no compute); needed to cast each parameter for its module.
        self._path_policies: dict[Any, dict[tuple[str, ...], Policy]] = {}
        # Module paths of Flax layers that cast their own parameters where they use them
        # (a `promote_dtype` field): their parameters are not cast before the call.
        self._cast_at_use: dict[Any, set[tuple[str, ...]]] = {}
        # Module paths of modules whose matmuls are not taken over (`_weights_cast_inside`):
        # where they own parameters, `apply` runs under `autocast.cast_at_use`.
        self._not_taken_over: dict[Any, set[tuple[str, ...]]] = {}
        self._at_use: dict[Any, Any] = {}
        self._owns_weights: dict[Any, bool] = {}
        self._stack: list[Policy] = []
        self._checked: set[Any] = set()
        self._as_written = False  # inside `_recomputed`: modules run as Flax wrote them

    def __repr__(self) -> str:
        return f"MixedPrecisionModule({type(self.module).__name__}, policy={self.policy})"

    # --- interception -----------------------------------------------------

    def _policy_for(self, path: tuple[str, ...], module: Any) -> Policy:
        own = self.overrides.own_policy(path, module)
        if own is not None:
            return own
        return self._stack[-1] if self._stack else self.policy

    def _interceptor(
        self, record: dict | None, cast_at_use: set | None = None, not_taken_over: set | None = None
    ):
        def intercept(next_fun, args, kwargs, context):
            if (
                self._as_written
                or context.method_name == "setup"
                or (context.method_name.startswith("_") and context.method_name != "__call__")
            ):
                return next_fun(*args, **kwargs)
            module = context.module
            path = tuple(module.scope.path) if module.scope is not None else ()
            policy = self._policy_for(path, module)
            if record is not None:
                # A recording pass (init, or learning the module paths) only
                # needs the structure: it runs the module as written.
                record[path] = policy
                if cast_at_use is not None and "promote_dtype" in getattr(
                    module, "__dataclass_fields__", {}
                ):
                    cast_at_use.add(path)
                if not_taken_over is not None and not isinstance(module, _TAKEN_OVER):
                    not_taken_over.add(path)
                self._stack.append(policy)
                try:
                    return next_fun(*args, **kwargs)
                finally:
                    self._stack.pop()
            _fp8_matmuls(module, policy, path)
            cast = casting_policy(policy)
            _compute_in(module, cast.compute_dtype)
            _softmax_in_float32(module, cast)
            out_dtype = (
                None  # a float8 policy's layers are float8's (`_fp8_matmuls`)
                if policy.compute_dtype.itemsize == 1
                else _weights_cast_inside(
                    module,
                    context.method_name,
                    cast.compute_dtype,
                    self.reduce_dtype,
                    self.accumulate_dtype,
                )
            )
            outer = casting_policy(self._stack[-1] if self._stack else self.policy)
            recompute = context.method_name == "__call__" and recomputes(
                module, NORMS_IN_FLOAT32, cast, outer
            )
            self._stack.append(policy)
            try:
                with island_scope(self.overrides.own_policy(path, module), cast.compute_dtype):
                    if recompute:
                        bias = matmul.Bias()  # a norm: nothing left to add
                        out = self._recomputed(module, cast, outer.compute_dtype, args, kwargs)
                    else:
                        with _layer_casting_inside(out_dtype) as bias:
                            out = next_fun(
                                *cast.cast_to_compute(args), **cast.cast_to_compute(kwargs)
                            )
            finally:
                self._stack.pop()
            if out_dtype is not None:
                out = cast.with_compute_dtype(out_dtype).cast_to_compute(bias.add_to(out))
            if path and args and not isinstance(module.parent, nn.Module):
                out = _carry_keeps_its_dtype(args[0], out)
            return out

        return intercept

    def _recomputed(
        self, module: nn.Module, cast: Policy, back_to: Any, args: tuple, kwargs: dict
    ) -> Any:
        """A float32 normalisation layer inside a half-precision model (`_flax_layers.recomputed`:
        its output handed back in `back_to`, only its half input kept for the backward pass).
        The layer runs as Flax wrote it, on its own variables, and writes back the state it
        updates (BatchNorm's batch statistics)."""
        clone = module.clone(parent=None)
        variables = dict(module.variables)
        mutable = [c for c in variables if c != "params" and module.is_mutable_collection(c)]

        def call(variables, *args, **kwargs):
            self._as_written = True
            try:
                out = clone.apply(variables, *args, mutable=mutable or False, **kwargs)
            finally:
                self._as_written = False
            return out if mutable else (out, {})

        out, updated = recomputed(call, cast, variables, args, kwargs, back_to)
        for collection, values in updated.items():
            for name, value in values.items():
                module.put_variable(collection, name, value)
        return out

    def _run(self, fn, record=None, cast_at_use=None, not_taken_over=None):
        self._stack = []
        with nn.intercept_methods(self._interceptor(record, cast_at_use, not_taken_over)):
            return fn()

    # --- parameters -----------------------------------------------------------

    def _module_policy(self, path_policies, param_path: tuple[str, ...]) -> Policy:
        owner = _owner(path_policies, param_path)
        return self.policy if owner is None else path_policies[owner]

    def _cast_params(
        self, params, path_policies, to: str, cast_at_use: Collection[tuple[str, ...]] = ()
    ):
        def cast(path, leaf):
            keys = _keys(path)
            if keys[:-1] in cast_at_use:
                return leaf  # the layer casts it where it uses it
            policy = casting_policy(self._module_policy(path_policies, keys[:-1]))
            return getattr(policy, f"cast_to_{to}")(leaf)

        return jax.tree_util.tree_map_with_path(cast, params)

    def _learn_paths(self, key, variables, args, kwargs, method):
        if key not in self._path_policies:
            record: dict[tuple[str, ...], Policy] = {}
            cast_at_use: set[tuple[str, ...]] = set()
            not_taken_over: set[tuple[str, ...]] = set()
            # Only arrays are traced; flags such as `train=False` and callables
            # such as `capture_intermediates` are passed through as they are.
            arrays, rebuild = split_traced((variables, args, kwargs))

            def run(arrays):
                v, a, k = rebuild(arrays)
                return self.module.apply(v, *a, method=method, mutable=True, **k)

            self._run(lambda: jax.eval_shape(run, arrays), record, cast_at_use, not_taken_over)
            self._path_policies[key] = record
            self._cast_at_use[key] = cast_at_use
            self._not_taken_over[key] = not_taken_over
            self.overrides.warn_unmatched()
        return self._path_policies[key], self._cast_at_use[key]

    # --- the module's API -------------------------------------------------------

    def init(self, rngs, *args, method=None, **kwargs):
        """Like `module.init`; parameters are stored in each module's `param_dtype`."""
        record: dict[tuple[str, ...], Policy] = {}
        cast_at_use: set[tuple[str, ...]] = set()
        not_taken_over: set[tuple[str, ...]] = set()
        variables = self._run(
            lambda: self.module.init(rngs, *args, method=method, **kwargs),
            record,
            cast_at_use,
            not_taken_over,
        )
        key = _call_key(method, args, kwargs)
        if key not in self._path_policies:
            self._path_policies[key] = record
            self._cast_at_use[key] = cast_at_use
            self._not_taken_over[key] = not_taken_over
        self.overrides.warn_unmatched()
        variables = unfreeze(variables)
        if "params" in variables:
            variables["params"] = self._cast_params(variables["params"], record, "param")
        return variables

    def apply(self, variables, *args, method=None, mutable=False, **kwargs):
        """Like `module.apply`, run under the policy.

        Returns what `module.apply` returns; the output is cast to the policy's
        `output_dtype`, and updated non-param collections keep the dtype they
        came in with (float32 batch statistics stay float32).
        """
        variables = unfreeze(variables)
        key = _call_key(method, args, kwargs)
        path_policies, cast_at_use = self._learn_paths(key, variables, args, kwargs, method)

        def cast(variables):
            if "params" not in variables:
                return variables
            params = self._cast_params(variables["params"], path_policies, "compute", cast_at_use)
            return {**variables, "params": params}

        def run(cast_vars, args, kwargs):
            return self._run(
                lambda: self.module.apply(
                    cast_vars, *args, method=method, mutable=mutable, **kwargs
                )
            )

        if self._casts_own_weights(key, variables, path_policies):
            # Parameters cast inside the traced program, so each matmul on one takes it in
            # float32 (`autocast.cast_at_use`): its gradient is made and summed in float32.
            program = (key, repr(mutable))  # `mutable` may be a list
            if program not in self._at_use:
                self._at_use[program] = cast_at_use_program(
                    lambda params, rest, args, kwargs: run(
                        cast({**rest, "params": params}), args, kwargs
                    )
                )
            at_use = self._at_use[program]
            rest = {k: v for k, v in variables.items() if k != "params"}
            at_use_args = (variables["params"], rest, args, kwargs)
            # The program `cast_at_use` traces (and keeps for the call) serves the check.
            traced = lambda: at_use.traced_program(*at_use_args)  # noqa: E731
            call = lambda: at_use(*at_use_args)  # noqa: E731
        else:
            cast_vars = cast(variables)
            traced = lambda: trace(run, cast_vars, args, kwargs)  # noqa: E731
            call = lambda: run(cast_vars, args, kwargs)  # noqa: E731
        if key not in self._checked:
            self._checked.add(key)
            if any(casting_policy(p).compute_dtype != jnp.float32 for p in path_policies.values()):
                # Abstract, once per call signature: float32 matmuls that slipped through.
                warn_float32_matmuls(traced(), "jmp_policy.linen.mixed_precision")
        out = call()
        root = self._module_policy(path_policies, ())
        if mutable is False:
            return root.cast_to_output(out)
        y, updated = out
        updated = unfreeze(updated)
        for name, collection in updated.items():
            if name in variables and name != "params":
                updated[name] = jax.tree.map(
                    lambda new, old: new.astype(old.dtype), collection, variables[name]
                )
        return root.cast_to_output(y), updated

    def _casts_own_weights(self, key, variables, path_policies) -> bool:
        """Whether a module whose matmuls are not taken over (`nn.Einsum`,
        `nn.ConvTranspose`, a module's own `x @ self.param(...)`) owns a parameter and
        computes in 16 bits, with gradients to be summed in float32 (`reduce_dtype`)."""
        if self.reduce_dtype is None or "params" not in variables:
            return False
        leaves, tree = jax.tree_util.tree_flatten_with_path(variables["params"])
        if (key, tree) not in self._owns_weights:  # once per call signature and tree
            plain = self._not_taken_over.get(key, set())
            owners = {_owner(path_policies, _keys(path)[:-1]) for path, _ in leaves}
            # 16 bits; a float8 policy's layers are left as they are (`_fp8_matmuls`).
            self._owns_weights[(key, tree)] = any(
                owner in plain and path_policies[owner].compute_dtype.itemsize == 2
                for owner in owners
            )
        return self._owns_weights[(key, tree)]


def _keys(path: tuple) -> tuple[str, ...]:
    """A parameter's path in the variables (dict keys or attribute names) as strings."""
    return tuple(getattr(k, "key", getattr(k, "name", str(k))) for k in path)


def _owner(path_policies, param_path: tuple[str, ...]) -> tuple[str, ...] | None:
    """The innermost recorded module above a parameter: the one that owns it."""
    for cut in range(len(param_path), -1, -1):
        if param_path[:cut] in path_policies:
            return param_path[:cut]
    return None


_TAKEN_OVER = (nn.Dense, nn.DenseGeneral, nn.Conv, nn.Embed)
"""Layers whose matmul (or lookup) `_weights_cast_inside` takes over."""


def _carry_keeps_its_dtype(carry_in: Any, out: Any) -> Any:
    """A lifted body's `(carry, y)` result with the carry in its input dtypes.

    Lifted transforms (`nn.scan`, `nn.remat`, `nn.vmap`, `nn.jit`) run a clone
    of the module whose parent is a Scope; its inputs were cast inside the
    transform, but `lax.scan` fixed the carry's type from the uncast input, so
    a carry that came in as float32 (from a float32 island) must leave as
    float32. Results of any other form are returned as they are.
    """
    if not (isinstance(out, tuple) and len(out) == 2):
        return out
    carry_out, y = out
    if jax.tree.structure(carry_out) != jax.tree.structure(carry_in):
        return out

    def like(new, old):
        old_dtype = getattr(old, "dtype", None)
        if is_floating_array(new) and old_dtype is not None and new.dtype != old_dtype:
            return new.astype(old_dtype)
        return new

    return jax.tree.map(like, carry_out, carry_in), y


def _compute_in(module: nn.Module, dtype: np.dtype) -> None:
    """The policy decides the module's computation dtype, whatever the model wrote.

    Linen layers promote their inputs and kernels to their `dtype`, so a layer
    given `dtype=self.dtype` or `dtype=config.dtype` (float32 by default, as in
    Flax's examples) would compute in float32 whatever its inputs are. A
    floating (or unset) `dtype` field, and the floating `dtype` of a config
    dataclass held in a field, become the policy's compute dtype; an integer or
    bool `dtype` (indices, masks) is left alone. The bound module is a per-call
    clone, so the user's module is untouched.
    """
    fields = getattr(module, "__dataclass_fields__", {})
    if "dtype" in fields and is_compute_dtype(getattr(module, "dtype", None)):
        object.__setattr__(module, "dtype", dtype)
    for name in fields:
        config = getattr(module, name, None)
        if not dataclasses.is_dataclass(config) or isinstance(config, (type, nn.Module)):
            continue
        given = getattr(config, "dtype", None)
        if (
            given is not None
            and "dtype" in {f.name for f in dataclasses.fields(config)}
            and is_compute_dtype(given)
            and jnp.dtype(given) != dtype
        ):
            object.__setattr__(module, name, dataclasses.replace(config, dtype=dtype))


def _weights_cast_inside(
    module: nn.Module, method: str, compute: np.dtype, reduce_dtype: Any, accumulate: Any
) -> np.dtype | None:
    """Flax's Dense, DenseGeneral and Conv multiply through `jmp_policy.matmul` (their kernel
    cast inside the matmul, its gradient made and summed across devices in float32), and
    Embed gathers float32 rows; returns the dtype their output is cast to (None: the layer
    is left as Flax wrote it). The bound module is a per-call clone."""
    if compute == jnp.float32 or (reduce_dtype is None and accumulate is None):
        return None
    fields = getattr(module, "__dataclass_fields__", {})
    if "promote_dtype" not in fields:
        return None
    if isinstance(module, nn.Embed) and method == "__call__" and reduce_dtype is not None:
        object.__setattr__(module, "promote_dtype", matmul.promote_for_lookup)
        return compute
    if isinstance(module, (nn.Dense, nn.DenseGeneral)):
        hook = "dot_general"
    elif isinstance(module, nn.Conv):
        hook = "conv_general_dilated"
    else:
        return None
    # A bias over the output's trailing axes is added after the layer (`matmul.promote_bias_after`).
    trailing = not getattr(module, "batch_dims", ())
    return matmul.take_over(
        module, hook, compute, reduce_dtype, accumulate, object.__setattr__, trailing
    )


@contextlib.contextmanager
def _layer_casting_inside(out_dtype: np.dtype | None):
    """Around a layer `_weights_cast_inside` took over (`out_dtype` set): its bias is left
    for the caller to add (`matmul.adding_bias_after`); where Flax adds it itself (a layer
    whose bias is not over the trailing axes), it adds a float32 bias to the matmul's
    result under standard promotion."""
    if out_dtype is None:
        yield matmul.Bias()
        return
    with jax.numpy_dtype_promotion("standard"), matmul.adding_bias_after() as bias:
        yield bias


def _softmax_in_float32(module: nn.Module, policy: Policy) -> None:
    """Attention modules (Flax's MultiHeadDotProductAttention) get a float32 softmax: Flax's
    default attention becomes `attention_with_float32_softmax` (one half-precision copy of
    the weights kept); a custom `attention_fn` or einsum gets Flax's `force_fp32_for_softmax`.

    The bound module is a per-call clone, so the user's module is untouched.
    """
    fields = getattr(module, "__dataclass_fields__", {})
    if "force_fp32_for_softmax" not in fields or policy.compute_dtype == jnp.float32:
        return
    custom = ("qk_attn_weights_einsum_cls", "attn_weights_value_einsum_cls")
    if getattr(module, "attention_fn", None) is nn.dot_product_attention and all(
        getattr(module, name, None) is None for name in custom
    ):
        object.__setattr__(module, "attention_fn", attention_with_float32_softmax)
    else:
        object.__setattr__(module, "force_fp32_for_softmax", True)


def _fp8_matmuls(module: nn.Module, policy: Policy, path: tuple[str, ...]) -> None:
    """Under a float8 policy, a Dense-like layer multiplies in float8 (`Fp8DotGeneral`).

    Only layers that take a `dot_general` and were given none, and not the
    logits head or the embedding (`jmp_policy.fp8.FP8_EXCLUDE`, matched
    against the module path). The bound module is a per-call clone, so the
    user's module is untouched.
    """
    fields = getattr(module, "__dataclass_fields__", {})
    if (
        not fp8_layer(policy.compute_dtype, "/".join(path))
        or "dot_general" not in fields
        or module.dot_general is not None
        or getattr(module, "dot_general_cls", None) is not None
    ):
        return
    object.__setattr__(module, "dot_general", Fp8DotGeneral(float8_format(policy.compute_dtype)))


def _call_key(method, args, kwargs) -> Any:
    """What decides which modules a call reaches: the method and the arguments'
    signature (structure, shapes, dtypes, and the values of e.g. `train=False`)."""
    if method is not None and not isinstance(method, str):
        method = getattr(method, "__name__", method)
    return method, signature((args, kwargs))


def mixed_precision(
    module: nn.Module,
    policy: Policy,
    overrides: Mapping[Any, Policy] = NORMS_IN_FLOAT32,
    *,
    reduce_dtype: Any = jnp.float32,
    accumulate_dtype: Any = None,
) -> MixedPrecisionModule:
    """Applies `policy` to an unmodified Linen module.

    Args:
      module: any `flax.linen.Module` (Flax's layers or your own).
      policy: e.g. `jmp_policy.get_policy("mixed_float16")`. Under a float8
        policy (`"mixed_float8"`) the model computes in bfloat16 and every
        `Dense`/`DenseGeneral` multiplies in float8
        (`jmp_policy.fp8.Fp8DotGeneral`: current scaling, no state), except
        the logits head and the embedding (`jmp_policy.fp8.FP8_EXCLUDE`) and
        matmuls too small for float8 GEMMs.
      overrides: `{module class | glob path pattern | compiled regex: Policy}`
        for parts of the model that run under another policy (which layers
        run in float8, too). Default:
        `NORMS_IN_FLOAT32` (LayerNorm, BatchNorm, GroupNorm, RMSNorm,
        InstanceNorm in float32). Extend it with
        `{**NORMS_IN_FLOAT32, "head": jmp_policy.get_policy("float32")}`.
      reduce_dtype: float32 (default): under a half compute dtype, `Dense`,
        `DenseGeneral` and `Conv` cast their kernel inside their matmul
        (`jmp_policy.matmul`), so kernel and bias gradients are made, and
        summed across devices, in float32, and `Embed` gathers float32 rows;
        parameters of Flax's layers are cast where each layer uses them.
        None: gradients in the compute dtype (half the bytes on the wire).
      accumulate_dtype: e.g. float32: those matmuls return their sum in
        this dtype (`preferred_element_type`), the bias is added in it, and
        the layer's output stays in it. None (default): the compute dtype.

    The policy decides every module's compute dtype: a floating (or unset)
    `dtype` field, given explicitly (`dtype=self.dtype`, `dtype=config.dtype`)
    or by default, and the floating `dtype` of a config dataclass a module
    holds, become the compute dtype of the module's policy; an integer or bool
    `dtype` is left alone. On the first `apply` with each input signature the
    mixed program is traced once (abstractly) and a
    `jmp_policy.PrecisionWarning` names the modules whose matmuls or convs
    still run in float32 outside overrides, and why.

    Returns:
      A `MixedPrecisionModule` with the module's `init` and `apply`; the
      parameter tree has the same structure as the module's.

    Raises:
      TypeError: `module` is not a Linen module, `policy` or an override value
        is not a `Policy`, or an override key is neither a Module class nor a
        pattern.

    Examples:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> import jmp_policy as jmp
      >>> model = nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(2)])
      >>> mixed = jmp.linen.mixed_precision(model, jmp.get_policy("mixed_float16"))
      >>> variables = mixed.init(jax.random.key(0), jnp.ones((1, 4)))
      >>> kernel = variables["params"]["layers_0"]["kernel"]
      >>> kernel.dtype, mixed.apply(variables, jnp.ones((1, 4))).dtype
      (dtype('float32'), dtype('float32'))
    """
    return MixedPrecisionModule(module, policy, overrides, reduce_dtype, accumulate_dtype)
