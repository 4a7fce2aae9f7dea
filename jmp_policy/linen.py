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

import functools
import types
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import unfreeze

from jmp_policy import matmul
from jmp_policy._core.overrides import FLOAT32, Overrides, island_scope
from jmp_policy._core.pytree import signature, split_traced
from jmp_policy._core.tracing import traced_once
from jmp_policy._flax.fp8_layers import LinenDelayedDot, layer_recipe
from jmp_policy._flax.layers import (
    LINEN_NORMS,
    carry_keeps_its_dtype,
    fp8_dot_for,
    linen_compute_in,
    linen_softmax_in_float32,
    note_matmul_layer,
    recomputed,
    recomputes,
    warning_if_head_in_low_precision,
)
from jmp_policy._flax.linen_paths import Paths, params_and_rest
from jmp_policy._reports.census import warn_float32_matmuls
from jmp_policy.autocast import cast_at_use as cast_at_use_program
from jmp_policy.policy import (
    Policy,
    casting_policy,
    check_model_policy,
)

NORMS_IN_FLOAT32: Mapping[type, Policy] = types.MappingProxyType(
    dict.fromkeys(LINEN_NORMS, FLOAT32)
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
        fp8_scaling: Any = "tensorwise",
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
        self.fp8_recipe = layer_recipe(fp8_scaling, self.policy)
        # Per call signature: what a run of the model showed (`Paths`): each module path's
        # policy, needed to cast each parameter for its module before the call.
        self._path_policies: dict[Any, Paths] = {}
        self._checked: set[Any] = set()  # call signatures traced once, checked, and verified
        self._at_use: dict[Any, Any] = {}  # `autocast.cast_at_use` programs, by signature
        self._stack: list[Policy] = []
        self._seen: Paths | None = None  # set while a first call notes what it runs
        self._as_written = False  # inside `_recomputed`: modules run as Flax wrote them

    def __repr__(self) -> str:
        return f"MixedPrecisionModule({type(self.module).__name__}, policy={self.policy})"

    # --- interception -----------------------------------------------------

    def _policy_for(self, path: tuple[str, ...], module: Any) -> Policy:
        own = self.overrides.own_policy(path, module)
        if own is not None:
            return own
        return self._stack[-1] if self._stack else self.policy

    def _interceptor(self, record: Paths | None):
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
            delayed = None
            if self.fp8_recipe is not None:
                recipe = self.fp8_recipe
                delayed = lambda _path, _module: LinenDelayedDot(module, recipe)  # noqa: E731
            if record is not None:
                # A recording pass (init, or learning the module paths) only
                # needs the structure: it runs the module as written, except that
                # float8 delayed scaling makes its layers' state.
                record.note(path, module, policy)
                fp8_dot = None if delayed is None else fp8_dot_for(module, policy, path, delayed)
                if fp8_dot is not None:
                    object.__setattr__(module, "dot_general", fp8_dot)
                self._stack.append(policy)
                try:
                    return next_fun(*args, **kwargs)
                finally:
                    self._stack.pop()
            if self._seen is not None:
                self._seen.note(path, module, policy)
            fp8_dot = fp8_dot_for(module, policy, path, delayed)
            if fp8_dot is not None:  # the bound module is a per-call clone
                object.__setattr__(module, "dot_general", fp8_dot)
            note_matmul_layer(module, "/".join(path), args)
            cast = casting_policy(policy)
            linen_compute_in(module, cast.compute_dtype)
            linen_softmax_in_float32(module, cast)
            outer = casting_policy(self._stack[-1] if self._stack else self.policy)
            recompute = context.method_name == "__call__" and recomputes(
                module, NORMS_IN_FLOAT32, cast, outer
            )
            self._stack.append(policy)
            try:
                with island_scope(self.overrides.own_policy(path, module), cast.compute_dtype):
                    if recompute:
                        out = self._recomputed(module, cast, outer.compute_dtype, args, kwargs)
                    else:
                        out = next_fun(*cast.cast_to_compute(args), **cast.cast_to_compute(kwargs))
            finally:
                self._stack.pop()
            if path and args and not isinstance(module.parent, nn.Module):
                out = carry_keeps_its_dtype(args[0], out)
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

    def _run(self, fn, record: Paths | None = None):
        self._stack = []
        with nn.intercept_methods(self._interceptor(record)):
            return fn()

    # --- parameters -----------------------------------------------------------

    def _borrowed_paths(self, key, method) -> Paths | None:
        """The paths an earlier run of the same method showed (`init`'s, or another
        signature's), for a first call to use and check; None if there was none."""
        if key in self._path_policies:
            return self._path_policies[key]
        for (other, _), paths in reversed(self._path_policies.items()):
            if other == key[0]:
                return paths
        return None

    def _learn_paths(self, variables, args, kwargs, method) -> Paths:
        """The paths of the call's modules, from a recording run of the model as written
        (abstract: it costs no compute)."""
        record = Paths()
        # Only arrays are traced; flags such as `train=False` and callables
        # such as `capture_intermediates` are passed through as they are.
        arrays, rebuild = split_traced((variables, args, kwargs))

        def run(arrays):
            v, a, k = rebuild(arrays)
            return self.module.apply(v, *a, method=method, mutable=True, **k)

        self._run(lambda: jax.eval_shape(run, arrays), record)
        return record

    # --- the module's API -------------------------------------------------------

    def init(self, rngs, *args, method=None, **kwargs):
        """Like `module.init`; parameters are stored in each module's `param_dtype`."""
        record = Paths()
        variables = self._run(
            lambda: self.module.init(rngs, *args, method=method, **kwargs), record
        )
        self._path_policies.setdefault(_call_key(method, args, kwargs), record)
        self.overrides.warn_unmatched()
        variables = unfreeze(variables)
        if "params" in variables:
            variables["params"] = record.cast_params(variables["params"], "param", self.policy)
        return variables

    def apply(self, variables, *args, method=None, mutable=False, **kwargs):
        """Like `module.apply`, run under the policy.

        Returns what `module.apply` returns; the output is cast to the policy's
        `output_dtype`, and updated non-param collections keep the dtype they
        came in with (float32 batch statistics stay float32).
        """
        variables = unfreeze(variables)
        key = _call_key(method, args, kwargs)
        call = (variables, args, kwargs, method, mutable)
        if key in self._checked:
            paths = self._path_policies[key]
            out = self._call(key, paths, *call)
        else:
            # The first call with this signature runs the model once: the program it traces
            # serves the float32-matmul check and the call. The paths it is given are an
            # earlier run's (`init`'s, another signature's); without one (parameters restored
            # in a new process), one abstract recording run of the model finds them exactly.
            given = self._borrowed_paths(key, method)
            if given is None:
                given = self._learn_paths(variables, args, kwargs, method)
            paths, traced, first = self._first_trace(key, given, *call)
            plan = functools.partial(
                Paths.plan, variables=variables, ran=paths, default=self.policy,
                reduce_dtype=self.reduce_dtype,
            )  # fmt: skip
            if plan(given) != plan(paths):
                # Another signature's paths, and this call ran other modules (e.g. a flag).
                _, traced, first = self._first_trace(key, paths, *call)
            self._path_policies[key] = paths
            self._checked.add(key)
            self.overrides.warn_unmatched()
            if any(casting_policy(p).compute_dtype != jnp.float32 for p in paths.policies.values()):
                warn_float32_matmuls(traced, "jmp_policy.linen.mixed_precision")
            out = first()
        root = paths.policy_of((), self.policy)
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

    def _first_trace(self, key, paths: Paths, variables, args, kwargs, method, mutable):
        """The call's program traced (the model run once, its parameters cast by `paths`).
        Returns the paths of the modules it ran, the traced program and the call."""
        self._at_use.pop((key, repr(mutable)), None)
        at_use = self._at_use_program(key, paths, variables, method, mutable)
        seen = self._seen = Paths()
        try:
            if at_use is None:
                # Traced to a program, evaluated for the call (not run again). The program is
                # not kept: later calls run the model in their caller's trace, as Flax's `apply`.
                run = functools.partial(self._mixed_run, paths, method, mutable)
                traced, call = traced_once(run, variables, args, kwargs)
            else:
                params, rest = params_and_rest(variables)
                traced = at_use.traced_program(params, rest, args, kwargs)
                call = lambda: at_use(params, rest, args, kwargs)  # noqa: E731
        finally:
            self._seen = None
        return seen, traced, call

    def _call(self, key, paths: Paths, variables, args, kwargs, method, mutable):
        at_use = self._at_use_program(key, paths, variables, method, mutable)
        if at_use is None:
            return self._mixed_run(paths, method, mutable, variables, args, kwargs)
        return at_use(*params_and_rest(variables), args, kwargs)

    def _at_use_program(self, key, paths: Paths, variables, method, mutable):
        """The `autocast.cast_at_use` program of the call (traced once, kept for later
        calls), where a module computes in 16 bits: the float32 list held in the model's own
        code, each matmul's sum in `accumulate_dtype`, and where a 16-bit module owns a
        parameter and gradients are to be summed in float32 (`reduce_dtype`), the parameters
        cast inside the program where each is used, so a matmul on one takes it in float32
        and its gradient is made and summed in float32. None where no module is 16-bit.
        """
        if not paths.in_half(self.policy):
            return None
        program = (key, repr(mutable))  # `mutable` may be a list
        if program not in self._at_use:
            self._at_use[program] = cast_at_use_program(
                lambda params, rest, args, kwargs: self._mixed_run(
                    paths, method, mutable, {**rest, "params": params}, args, kwargs
                ),
                weights_in_float32=paths.casts_own_weights(variables, self.reduce_dtype),
                accumulate_dtype=self.accumulate_dtype,
            )
        return self._at_use[program]

    def _mixed_run(self, paths: Paths, method, mutable, variables, args, kwargs):
        """The module's `apply` under the policy, each parameter cast for its module."""
        if "params" in variables:
            params = paths.cast_params(variables["params"], "compute", self.policy)
            variables = {**variables, "params": params}
        with warning_if_head_in_low_precision():
            return self._run(
                lambda: self.module.apply(
                    variables, *args, method=method, mutable=mutable, **kwargs
                )
            )


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
    fp8_scaling: Any = "tensorwise",
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
        default one): each float8 layer keeps its scales and amax histories in
        the `"fp8_state"` collection, made by `init`; differentiate with respect
        to it too and update with a `loss_scaling` optimizer, which writes its
        gradient, the next state (docs/fp8.md).

    The policy decides every module's compute dtype: a floating (or unset)
    `dtype` field, given explicitly (`dtype=self.dtype`, `dtype=config.dtype`)
    or by default, and the floating `dtype` of a config dataclass a module
    holds, become the compute dtype of the module's policy; an integer or bool
    `dtype` is left alone. On the first `apply` with each input signature the
    mixed program is traced once (abstractly) and a
    `jmp_policy.errors.PrecisionWarning` names the modules whose matmuls or convs
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
    return MixedPrecisionModule(
        module, policy, overrides, reduce_dtype, accumulate_dtype, fp8_scaling
    )


__all__ = [
    "MixedPrecisionModule",
    "NORMS_IN_FLOAT32",
    "mixed_precision",
]
