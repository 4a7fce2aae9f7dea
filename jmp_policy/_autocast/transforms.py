"""autocast: torch.amp's allow/deny op lists as a JAX function transform.

`autocast(fun, policy)` traces `fun` once per input signature and re-evaluates
its program with casts:

- allow-listed primitives (matmuls, convolutions) get compute-dtype operands;
- deny-listed primitives (exp, log, pow, sqrt/rsqrt, erf, logistic, sums,
  products and cumulative sums: what softmax, logsumexp, normalisation
  statistics and losses lower to) run in float32;
- everything else follows `jmp_policy._autocast.activations.meet`: where a half-precision
  activation meets a float32 weight, constant or island value (a bias add, a
  residual add after a norm), it runs in the activation's dtype, so activations
  stay in the compute dtype between the float32 islands; where it meets a
  float32 statistic (a mean, a variance, a log-sum-exp) it runs in float32;
  integer, bool and key values are never touched;
- the floating outputs are cast to `output_dtype`.

Nested `jit` is inlined; `scan`, `while_loop`, `cond`/`switch` and
`jax.checkpoint` are rebuilt with their bodies autocast (loop carries keep the
dtype of their initial value, branches agree on the widest dtype); a function
with a custom derivative (`custom_jvp`, `custom_vjp`) computes by the rules and
keeps its derivative rule: a `custom_jvp`'s on values in the dtypes it was written
for, a `custom_vjp`'s backward pass by the rules too (torch.amp's `custom_bwd`).
`full_precision(fun)` marks a float32 region, and an inner `autocast` with
another policy is kept as it is.

This module holds the public transforms; `_autocast_call` the function they return
(one program per input signature, run in a region), `_autocast_ops` how one operation
runs under the rules (and the op lists), `_autocast_programs` how a program and its
sub-programs run. Programs are read through `jmp_policy._core.jaxpr`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from jmp_policy._autocast.call import _Autocast
from jmp_policy._autocast.evaluation import _FLOAT32, _Rules
from jmp_policy._autocast.ops import _CAST_AT_USE
from jmp_policy._autocast.ops import ALLOW as ALLOW  # the op lists, exported here
from jmp_policy._autocast.ops import DENY as DENY
from jmp_policy._autocast.ops import NO_HALF_KERNEL as NO_HALF_KERNEL
from jmp_policy._core.overrides import FULL_PRECISION_REGION
from jmp_policy._fp8.state import checked_scaling
from jmp_policy.fp8 import (
    FORMATS,
    FP8_EXCLUDE,
    DelayedScaling,
)
from jmp_policy.matmul import check_accumulate_dtype, check_reduce_dtype
from jmp_policy.policy import Policy, check_policy


def _known_primitives() -> frozenset:
    names = set()
    for module in (lax, jax.lax):
        for value in vars(module).values():
            if isinstance(value, jcore.Primitive):
                names.add(value.name)
    return frozenset(names)


def _check_names(names: Any, argument: str) -> frozenset:
    if isinstance(names, (str, np.ndarray, jax.Array)) or not isinstance(names, Iterable):
        raise TypeError(
            f"Expected a collection of primitive names (e.g. {{'dot_general'}}) for `{argument}`, "
            f"got {names!r}."
        )
    names = list(names)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"Expected primitive names (strings) in `{argument}`, got {bad!r}.")
    names = frozenset(names)
    unknown = sorted(names - _known_primitives() - ALLOW - DENY)
    if unknown:
        raise ValueError(
            f"Unknown primitive name(s) {unknown} in `{argument}`: use names as they appear in "
            "a jaxpr (`jax.make_jaxpr(f)(x)`), e.g. 'dot_general', 'exp', 'reduce_sum', or the "
            "names in jmp_policy.casting.ALLOW / DENY."
        )
    return names


def _static(values: Any, kind: type, argument: str) -> tuple:
    if values is None:
        return ()
    values = (values,) if isinstance(values, (int, str)) else tuple(values)
    if not all(isinstance(v, kind) and not isinstance(v, bool) for v in values):
        raise TypeError(
            f"Expected {kind.__name__} values (or one) for `{argument}`, got {values!r}."
        )
    return values


def autocast(
    fun: Callable,
    policy: Policy | str = "mixed_float16",
    *,
    allow: Iterable[str] = ALLOW,
    deny: Iterable[str] = DENY,
    static_argnums: int | Iterable[int] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    fp8_scaling: str = "tensorwise",
    fp8_format: str = "hybrid",
    fp8_exclude: Iterable[str] = FP8_EXCLUDE,
    reduce_dtype: Any = jnp.float32,
    accumulate_dtype: Any = None,
) -> Callable:
    """Runs `fun` with matmuls in half precision and fragile ops in float32.

    The rewrite happens on the traced program, so `fun` (a Flax `apply`, a loss
    function, anything) needs no change. The returned function takes and
    returns the same pytrees as `fun`, works under `jit`, `grad` (gradients come
    back in the dtype of the inputs they belong to) and `vmap`, and caches one
    program per input signature.

    Matmul outputs are in the compute dtype (`preferred_element_type` is set to
    it): GPUs and TPUs accumulate half-precision matmuls in float32 anyway, and
    a float32 output would make the backward matmuls mix dtypes.

    Args:
      fun: the function to run.
      policy: a `Policy` or a policy string; its `compute_dtype` is used for
        the allow-listed ops and its `output_dtype` for the outputs.
      allow: primitive names run in the compute dtype (default `ALLOW`).
      deny: primitive names run in float32 (default `DENY`), e.g.
        `DENY | {"tanh"}` keeps `tanh` in float32 too.
      static_argnums: positions of arguments that are static (hashable).
      static_argnames: names of keyword arguments that are static.
      fp8_scaling: with a float8 policy (`"mixed_float8"`), how the matmul
        operands are scaled: "tensorwise" or "rowwise" (current scaling,
        `jmp_policy.fp8.fp8_dot_general`), or a `jmp_policy.fp8.DelayedScaling`
        recipe ("delayed": the default one): scales from earlier steps' amaxes, a
        state per matmul that the function then takes as `fp8_state=` (made by
        its `init_fp8_state(*args)`; docs/fp8.md). With `"mixed_nvfp4"`, a
        `jmp_policy.nvfp4.Recipe`: NVIDIA's training recipe on every linear
        layer (all three GEMMs in NVFP4; attention's matmuls in bfloat16), its
        state the key of each layer's draws, taken the same way. Ignored otherwise.
      fp8_format: with a float8 policy, "hybrid" (e5m2 gradients) or "e4m3" (with a
        `DelayedScaling`, its own `fmt` decides).
      fp8_exclude: with a float8 policy, regular expressions for module names
        (each matched against every component of a module path) whose
        matmuls stay in bfloat16; default `jmp_policy.fp8.FP8_EXCLUDE`, the
        logits head and the embedding. `()` puts every eligible matmul in float8.
      reduce_dtype: float32 (default): under a half compute dtype, a matmul or
        conv casts its float32 operands (the weights) inside the op
        (`jmp_policy.matmul`), so their gradients are made, and summed across
        devices, in float32. None: in the compute dtype (half the bytes).
      accumulate_dtype: e.g. float32: matmuls and convs return their sum in
        this dtype (`preferred_element_type`); None (default): the compute dtype.

    Returns:
      The autocast function.

    Raises:
      TypeError/ValueError: a bad policy, or unknown primitive names in `allow`/`deny`.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jmp_policy as jmp
      >>> def f(w, x):
      ...     return jax.nn.logsumexp(x @ w)
      >>> g = jmp.autocast(f, "mixed_bfloat16")
      >>> g(jnp.ones((3, 2)), jnp.ones((4, 3))).dtype
      dtype('float32')
      >>> jmp.precision_report(g, jnp.ones((3, 2)), jnp.ones((4, 3))).counts["dot_general"]
      {'bfloat16': 1}
    """
    policy = check_policy(policy)
    if not callable(fun):
        raise TypeError(f"Expected a callable for `fun`, got {type(fun).__name__}.")
    allow, deny = _check_names(allow, "allow"), _check_names(deny, "deny")
    both = sorted(allow & deny)
    if both:
        raise ValueError(f"Primitives {both} are in both `allow` and `deny`; pick one.")
    if fp8_format not in FORMATS:
        raise ValueError(
            f"Unknown `fp8_format` {fp8_format!r}: expected 'hybrid' (e5m2 gradients) or 'e4m3'."
        )
    fp8_scaling = checked_scaling(fp8_scaling, policy)
    if isinstance(fp8_scaling, DelayedScaling):
        fp8_format = fp8_scaling.fmt
    if isinstance(fp8_exclude, str) or not all(isinstance(p, str) for p in fp8_exclude):
        raise TypeError(
            "Expected a tuple of regular expressions for `fp8_exclude`, e.g. ('head',), got "
            f"{fp8_exclude!r}."
        )
    exclude = tuple(fp8_exclude)
    for pattern in exclude:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(
                f"Invalid regular expression {pattern!r} in `fp8_exclude`: {e}."
            ) from e
    rules = _Rules.of(
        policy,
        allow,
        deny,
        (fp8_scaling, fp8_format),
        exclude,
        reduce=check_reduce_dtype(reduce_dtype) is not None,
        accumulate=check_accumulate_dtype(accumulate_dtype),
    )
    return _Autocast(
        fun,
        rules,
        _static(static_argnums, int, "static_argnums"),
        _static(static_argnames, str, "static_argnames"),
        cast_inputs=False,
        region_name="jmp_autocast_region",
    )


def cast_at_use(
    fun: Callable, *, weights_in_float32: bool = True, accumulate_dtype: Any = None
) -> Callable:
    """`fun(weights, *args, **kwargs)` as written, except that each matmul or conv
    (`dot_general`, `conv_general_dilated`) on a float32 leaf of `weights` cast to 16 bits
    takes the float32 leaf and casts it inside the op (`jmp_policy.matmul.mixed`): the
    same forward pass, and the weight's gradient made, and summed across devices, in
    float32 (activation gradients stay in 16 bits); a bias broadcast to a batch is
    broadcast in float32 before its cast. What `linen.mixed_precision` runs `apply` under,
    and `nnx.mixed_precision` a model's call, when `reduce_dtype` is float32 and a layer
    has no matmul to take over (`nn.Einsum`, `nn.ConvTranspose`, your own
    `x @ self.param(...)`; `nnx.ConvTranspose`). A weight, or its cast, is followed into
    `scan` bodies (one layer of stacked weights at a time) and `jax.checkpoint` bodies, not
    into `cond` branches or `while` loops.

    The float32 list applies to the program's own operations as autocast's does: an
    operation on the list (`jmp_policy._core.rules.FLOAT32`: a segment sum or other
    scatter-add, exp, log, powers, a cumulative sum) computes in float32 from 16-bit operands
    and hands its result back in the dtype it was traced with; a gather of 16-bit values adds
    its backward pass (a scatter-add) in float32. `weights_in_float32=False` (a policy's
    `reduce_dtype=None`): only that; the weights' casts are left as they are.
    `accumulate_dtype` (e.g. float32): each 16-bit matmul returns its sum in it, held for the
    arithmetic that follows (a bias add) until an operation takes it back in 16 bits."""
    rules = _Rules(
        _FLOAT32,
        _FLOAT32,
        frozenset(),
        frozenset(),
        reduce=weights_in_float32,
        accumulate=check_accumulate_dtype(accumulate_dtype),
        at_use=True,
    )
    return _Autocast(fun, rules, (), (), cast_inputs=False, region_name=_CAST_AT_USE)


def full_precision(fun: Callable) -> Callable:
    """Marks `fun` as a float32 region, inside `autocast` or anywhere else.

    JAX's counterpart of torch.amp's `with autocast(enabled=False): x = layer_norm(x.float())`:
    floating inputs are cast to float32 and every operation of `fun` runs in
    float32; an enclosing `autocast` leaves the region as it is.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jmp_policy as jmp
      >>> def f(w, x):
      ...     return jmp.full_precision(lambda a: a @ w)(x) + x @ w
      >>> w = x = jnp.ones((2, 2))
      >>> jmp.precision_report(jmp.autocast(f), w, x).counts["dot_general"]
      {'float16': 1, 'float32': 1}
    """
    if not callable(fun):
        raise TypeError(f"Expected a callable for `fun`, got {type(fun).__name__}.")
    rules = _Rules(_FLOAT32, _FLOAT32, frozenset(ALLOW), frozenset(DENY))
    return _Autocast(fun, rules, (), (), cast_inputs=True, region_name=FULL_PRECISION_REGION)
