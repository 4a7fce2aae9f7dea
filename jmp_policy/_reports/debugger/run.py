"""`debug_precision`: a loss's value and gradient traced with the pullback's seed as an input,
run as one program, read on the host."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.typing import DTypeLike

from jmp_policy._core import jaxpr as _jaxpr
from jmp_policy._core import naming as _naming
from jmp_policy._core.pytree import is_traced_leaf, pure_nnx, split_traced
from jmp_policy._core.validation import argnum_positions, positive_number
from jmp_policy._fp8.state import is_state, stepped
from jmp_policy._reports.debugger.interpreter import _Collector
from jmp_policy._reports.debugger.names import _hoisted, _renamed
from jmp_policy._reports.debugger.report import OpError, PrecisionDebugReport
from jmp_policy._reports.debugger.values import _Accumulator, _all_finite
from jmp_policy.policy import is_floating_array, normalise_dtype

_TARGETS = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float32")
# Formats a policy names: their values are judged in the dtypes the program holds them in.
_FORMATS = ("mxfp8", "nvfp4")


def _target_dtype(dtype: DTypeLike | None) -> np.dtype | None:
    """The dtype values are judged against; None: each in the dtype the policy holds it in."""
    if dtype is None or (isinstance(dtype, str) and dtype in _FORMATS):
        return None
    target = normalise_dtype(dtype, "dtype")
    if target.name not in _TARGETS:
        raise TypeError(
            f"Expected None, one of {_TARGETS} or one of {_FORMATS} for `dtype`, got {dtype!r}."
        )
    return target


def _held_dtypes(jaxpr: Any) -> frozenset:
    """The narrow floating dtypes `jaxpr` holds values in (float16, bfloat16, float8, float4),
    block scales (float8_e8m0fnu, powers of two) left out."""
    return frozenset(
        dtype
        for eqn, _ in _jaxpr.walk(jaxpr)
        for v in eqn.outvars
        for dtype in [getattr(v.aval, "dtype", None)]
        if dtype is not None
        and jnp.issubdtype(dtype, jnp.floating)
        and jnp.dtype(dtype).itemsize < 4
        and jnp.dtype(dtype) != jnp.dtype(jnp.float8_e8m0fnu)
    )


def _primary(held: frozenset) -> np.dtype:
    """The dtype a report under a policy is named by: its 16-bit dtype (float16 first)."""
    for name in ("float16", "bfloat16"):
        if jnp.dtype(name) in held:
            return jnp.dtype(name)
    return sorted(held, key=lambda d: d.name)[0]


def _warmed_up(loss: Callable[..., Any], args: tuple) -> tuple[tuple, int]:
    """`args` with every fresh float8 delayed-scaling state (an empty amax history: the scale
    1 only a run's first steps use) replaced by the state one step on these arguments writes,
    as `loss_scaling` writes it (a policy's state's gradient is its next value, with its count
    of uses in `grad_amax`). Returns the arguments and how many states were replaced."""
    leaves, treedef = jax.tree.flatten(args, is_leaf=is_state)
    fresh = [
        i
        for i, leaf in enumerate(leaves)
        if is_state(leaf) and not np.asarray(leaf.lhs.amax_history).any()
    ]
    if not fresh:
        return args, 0

    def of_states(states):
        new = list(leaves)
        for i, state in zip(fresh, states, strict=True):
            new[i] = state
        return loss(*jax.tree.unflatten(treedef, new))

    grads = jax.jit(jax.grad(of_states))([leaves[i] for i in fresh])
    warmed, new = 0, list(leaves)
    for i, grad in zip(fresh, grads, strict=True):
        count = np.asarray(grad.grad_amax)
        if count.ndim == 0 and count > 0 and np.asarray(grad.lhs.amax_history).any():
            new[i] = stepped(grad, leaves[i])
            warmed += 1
    return jax.tree.unflatten(treedef, new), warmed


def _with_seed(
    fun: Callable[..., Any], args: Sequence[Any], argnums: int | Sequence[int], has_aux: bool
) -> tuple[Any, list, list[bool], Any]:
    """`jax.value_and_grad(fun, argnums, has_aux)(*args)` as a jaxpr whose last input is the
    pullback's seed (a one): what carries it is a gradient, the rest is forward.

    Returns the closed jaxpr, its inputs, which inputs are the seed, and the shapes of its
    outputs `(value, grads)` (`((value, aux), grads)` with `has_aux`)."""
    diff = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    def value_and_pullback(args, seed):
        def of_diff(*chosen):
            full = list(args)
            for i, value in zip(diff, chosen, strict=True):
                full[i] = value
            return fun(*full)

        value, pullback, *aux = jax.vjp(of_diff, *(args[i] for i in diff), has_aux=has_aux)
        if jnp.shape(value) != () or not jnp.issubdtype(jnp.result_type(value), jnp.floating):
            raise TypeError(f"Expected `loss_fn` to return a floating scalar, got {value}.")
        grads = pullback(seed.astype(jnp.result_type(value)))  # the cast carries the seed too
        return (value, *aux) if has_aux else value, grads[0] if isinstance(argnums, int) else grads

    seed = jnp.ones((), jnp.float32)  # a placeholder: the program takes the loss scale here
    with _naming.module_names():  # NNX and Equinox modules named by their paths
        closed, shapes = jax.make_jaxpr(value_and_pullback, return_shape=True)(list(args), seed)
    flat = [*jax.tree.leaves(list(args)), seed]
    return closed, flat, [False] * (len(flat) - 1) + [True], shapes


def debug_precision(
    loss_fn: Callable[..., Any],
    *args: Any,
    dtype: DTypeLike | None = None,
    loss_scale: float = 1.0,
    argnums: int | Sequence[int] = 0,
) -> PrecisionDebugReport:
    """Per-layer statistics of `loss_fn(*args)`'s forward and backward pass in a target dtype.

    Traces `jax.value_and_grad(loss_fn, argnums)` (with the pullback's seed as an input, so
    that what carries it is the backward pass) and runs it as one compiled program that
    returns every intermediate value, and each judged operation again in the other precision
    (use small example inputs: every value is kept). NNX and Equinox
    modules called while it traces are named by their paths (see `jmp_policy._core.naming`).

    Args:
      loss_fn: a scalar loss, e.g. `lambda p, x, y: loss(model.apply({"params": p}, x), y)`; it
        may already run under a policy or `autocast`: then only what the policy holds in
        half precision, float8 or float4 is judged (`PrecisionDebugReport.judged`).
      *args: its example arguments: pytrees (NNX modules and states, Equinox modules); leaves
        that are not arrays (an activation function, a flag) are passed as they are. A fresh
        float8 delayed-scaling state among them (an empty amax history) is judged with the
        scales one step on these arguments gives it (`PrecisionDebugReport.warmed_states`).
      dtype: None (the default): under a policy, every value in the dtype the policy holds it
        in (float16, bfloat16, float8 as scaled, MXFP8 and NVFP4 block by block); a float32
        loss as if it ran in float16. Or the dtype values are judged against: "float16",
        "bfloat16", "float8_e4m3fn", "float8_e5m2" ("mxfp8" and "nvfp4" are None).
      loss_scale: the loss scale the gradients are computed at: the program runs the backward
        pass from it, as the train step does (forward values are not scaled).
      argnums: which arguments the gradients are taken of.

    Returns:
      A `PrecisionDebugReport`: `print` it, `.advice()`, `.plot(path)`.

    Raises:
      TypeError: `dtype` is not one of those, or `loss_fn` does not return a floating
        scalar.
      TypeError, ValueError: `loss_fn` is not callable, `loss_scale` is not a positive number
        float32 holds, `argnums` is not within `args`, or the arguments are traced (under
        `jit`: debug_precision runs the program itself).

    Examples:
      >>> import jax.numpy as jnp
      >>> import jmp_policy as jmp
      >>> # exp(12) = 162755 does not fit in float16 (largest 65504): 3 doublings too many.
      >>> report = jmp.debug_precision(lambda w, x: jnp.sum(jnp.exp(x * w)), 12.0, jnp.ones(3))
      >>> [(s.direction, round(s.amax), s.headroom) for s in report.layers]
      [('forward', 488264, -3), ('backward', 488264, -3)]
      >>> report.advice()["loss_scale"]
      {'initial': 0.0625, 'hysteresis': 1}
    """
    if not callable(loss_fn):
        raise TypeError(
            "Expected a loss function returning a scalar for `loss_fn`, got "
            f"{loss_fn!r}: `debug_precision(loss_fn, *example_args)`."
        )
    target = _target_dtype(dtype)
    # A Python number or a concrete scalar array, such as `get_loss_scale(state).loss_scale`.
    loss_scale = positive_number(loss_scale, "loss_scale")
    argnum_positions(argnums, len(args))
    if any(isinstance(leaf, Tracer) for leaf in jax.tree.leaves(args)):
        raise TypeError(
            "Expected concrete example arguments for debug_precision, got traced values: it "
            "runs the program and reads every value on the host, so it cannot run inside "
            "`jit`, `grad` or `vmap`. Call it outside the train step, on example inputs."
        )
    # An argument that is a number is an array; inside a pytree, leaves that are not arrays (an
    # Equinox module's activation function, a flag) are passed as they are, as
    # `eqx.filter_jit` does.
    args = tuple(jnp.asarray(a) if isinstance(a, (int, float)) else a for a in args)
    leaves = jax.tree_util.tree_leaves_with_path(args)
    bad_inputs = tuple(
        f"args{jax.tree_util.keystr(path)}"
        for path, leaf in leaves
        if is_traced_leaf(leaf) and is_floating_array(leaf) and not _all_finite([leaf])
    )
    # An NNX module among the arguments: its state is what is traced, and it is merged back
    # inside the trace, so one that writes variables (BatchNorm, Dropout) can be called there.
    args, merge = pure_nnx(args)

    def on_arrays_of(args):
        """`loss_fn` as a function of the arrays among `args`, and those arrays."""
        split = [split_traced(a) for a in args]

        def on_arrays(*arrays):
            rebuilt = [rebuild(a) for a, (_, rebuild) in zip(arrays, split, strict=True)]
            return loss_fn(*merge(rebuilt))

        return on_arrays, [traced for traced, _ in split]

    # The loss as `jit` computes it, of the arguments as given (the program below rounds every
    # operation to its dtype, and may judge warmed-up float8 states).
    on_arrays, arrays = on_arrays_of(args)
    loss = float(np.asarray(jax.jit(on_arrays)(*arrays)))
    args, warmed = _warmed_up(lambda *a: loss_fn(*merge(a)), args)
    on_arrays, arrays = on_arrays_of(args)
    closed, flat, cotangent, _ = _with_seed(on_arrays, arrays, argnums, has_aux=False)
    flat[-1] = jnp.asarray(loss_scale, jnp.float32)  # the backward pass at the loss scale
    if target is None:
        held = _held_dtypes(closed.jaxpr)
        target = _primary(held) if held else jnp.dtype(jnp.float16)
    else:
        held = frozenset([target]) if _computes_in(closed.jaxpr, target) else frozenset()
    held = held - {jnp.dtype(jnp.float32)}
    acc = _Accumulator(target, float(loss_scale), held)
    trip_counts: dict = {}
    while True:  # once, or again while `while` loops inside it have trip counts to learn
        collector = _Collector(acc, trip_counts)

        def program(flat, collector=collector):
            # Constants (a mask literal) are cast with NumPy while this traces: one beyond the
            # target dtype's range becomes inf there, as it does in the program, unwarned.
            with np.errstate(over="ignore"):
                outs = collector.run(closed.jaxpr, closed.consts, flat, "", cotangent)
            collector.keep_outputs(outs)
            return outs, collector.kept

        # Inputs rounded to the target dtype must stay rounded inside the one program.
        compiled = jax.jit(program).lower(flat).compile({"xla_allow_excess_precision": False})
        outs, kept = compiled(flat)
        if not collector.pending:
            break
        trip_counts.update({k: int(kept[i]) for k, i in collector.pending.items()})
    host = collector.replay(kept)
    hoisted = _hoisted(layer for layer, *_ in acc.stats)
    origin = host.origin
    if origin is not None:
        layer = hoisted.get(origin.layer, origin.layer)
        origin = dataclasses.replace(origin, layer=layer, passed_on=host.passed_on)
    errors: dict[tuple[str, str], float] = {}
    for (layer, op), error in acc.op_errors.items():
        key = (hoisted.get(layer, layer), op)
        errors[key] = max(error, errors.get(key, 0.0))
    measured = [OpError(layer, op, error) for (layer, op), error in errors.items()]
    op_errors = tuple(sorted(measured, key=lambda e: -e.error))
    report = PrecisionDebugReport(
        dtype=target.name,
        loss_scale=float(loss_scale),
        layers=acc.layers(),
        origin=origin,
        nonfinite_inputs=bad_inputs,
        loss=loss,
        op_errors=op_errors,
        matmul_layers=_renamed(acc.matmul_layers, hoisted),
        judged="target" if held else "all",
        target_layers=acc.layers(target=True),
        float32_layers=_renamed(acc.float32_layers, hoisted),
        held_dtypes=tuple(sorted(d.name for d in held)),
        warmed_states=warmed,
    )
    # Under a policy the program computes in the held dtypes: the advised scale is checked
    # there. Where the gradients overflowed at `loss_scale`, their statistics hold no amax to
    # advise from, and the search starts below it.
    values = jax.tree.leaves(outs)  # the loss, then the gradients
    overflowed = not _all_finite(values)
    if not held or not (overflowed or _scaled_rows(report)):
        return report
    if not _all_finite(values[:1]) or bad_inputs:
        return report  # a non-finite loss or input: no loss scale makes the step finite
    top = float(loss_scale) / 2 if overflowed else report.advice()["loss_scale"]["initial"]
    return dataclasses.replace(report, finite_scale=_finite_scale(compiled, flat, top))


def _scaled_rows(report: PrecisionDebugReport) -> bool:
    """Whether the advice's initial scale comes from gradients held in float16."""
    return any(
        s.direction == "backward" and s.dtype == "float16" and s.amax > 0
        for s in report.target_layers
    )


def _finite_scale(compiled: Any, flat: list, top: float) -> float:
    """The largest power of two `S` at most `top` such that the program's loss and gradients
    are finite at `2 S` (a doubling of headroom, as the statistics' rule leaves): `top / 2**24`
    if there is none."""

    def headroom(s: float) -> bool:
        outs, _ = compiled([*flat[:-1], jnp.asarray(2 * s, jnp.float32)])
        return _all_finite(jax.tree.leaves(outs))

    top = 2.0 ** math.floor(math.log2(top))
    if headroom(top):
        return top
    low, high = -24, 0  # exponents, relative to `top`: `high` has no headroom
    if not headroom(top * 2.0**low):
        return top * 2.0**low
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if headroom(top * 2.0**middle) else (low, middle)
    return top * 2.0**low


def _computes_in(jaxpr: Any, dtype: np.dtype) -> bool:
    """Whether some operation of `jaxpr` (or of a program inside it) outputs `dtype` values."""
    return any(
        eqn.primitive is not _jaxpr.CONVERT
        and any(getattr(v.aval, "dtype", None) == dtype for v in eqn.outvars)
        for eqn, _ in _jaxpr.walk(jaxpr)
    )
