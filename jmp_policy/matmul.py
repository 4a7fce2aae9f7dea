"""Half-precision matmuls and convs whose weight gradients are made, and summed, in float32.

Under data parallelism or FSDP, XLA sums a weight's gradient across devices
where that gradient is made: at the output of the backward matmul that
contracts the batch. When the weight was cast to float16 before the matmul,
that output is float16, so the scaled gradients are summed in float16 (bits
lost, and an overflow where no single device's gradient overflows) and only
then cast to float32 (jax-ml/jax#27496).

`dot_general(compute_dtype)` and `conv_general_dilated(compute_dtype)` return
drop-ins for `lax.dot_general` and `lax.conv_general_dilated` that take each
operand in its own dtype (a float32 master weight, a float16 activation), cast
it to the compute dtype inside the op, and differentiate so that each
operand's gradient comes out of its backward matmul in that operand's dtype
(`preferred_element_type`): a float32 weight's gradient is accumulated in
float32, crosses the wire in float32 and reaches the parameter without a
float16 round trip, while activation gradients stay in half precision. The
backward matmuls still take half-precision operands (tensor cores), and the
weight is cast again in the backward pass rather than kept, so under FSDP or
`nn.scan` one layer's half copy is live at a time.

`accumulate_dtype` (e.g. float32) also makes the forward matmul return its sum
in that dtype (`preferred_element_type`) instead of rounding it to the compute
dtype, for the bias add and whatever follows (flax#4890).

`autocast` and the Flax integrations (`linen.mixed_precision`,
`nnx.mixed_precision`, whose models run under `autocast.cast_at_use`) multiply
through `mixed` wherever a matmul or conv takes a float32 weight, unless given
`reduce_dtype=None`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_policy._core import jaxpr as _jaxpr
from jmp_policy._core.interpreter import RuleSet
from jmp_policy.policy import normalise_dtype


def _floating(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _cast(x: Any, dtype: np.dtype) -> Any:
    return lax.convert_element_type(x, dtype) if _floating(x) and x.dtype != dtype else x


def _accumulated_in(out_dtype: np.dtype | None, eqn: Any, invals: list) -> list | None:
    """A matmul with its `preferred_element_type` set to `out_dtype` (None: as traced)."""
    if out_dtype is None:
        return None
    return _runnable(
        lambda *xs: _jaxpr.bind(eqn, list(xs), preferred_element_type=out_dtype),
        invals,
        out_dtype,
    )


_WIDER = RuleSet(
    "a backward matmul accumulated wider", dict.fromkeys(_jaxpr.MATMULS, _accumulated_in)
)
"""`_eval_with_output`'s rules (their `ctx`: the dtype to accumulate in); every other operation
as traced."""


def _eval_with_output(closed: Any, out_dtype: np.dtype | None, *args: Any) -> list:
    """Evaluates `closed` (a jaxpr of one backward matmul and its reshapes) with the matmul's
    `preferred_element_type` set to `out_dtype`: JAX's own transpose rule, accumulated wider."""
    return _WIDER.run(out_dtype, closed.jaxpr, list(closed.consts), list(args))


CPU_WIDENED = "xla_cpu_widened_bfloat16"
"""The name scope of the casts `_runnable` makes: `precision_report` says why such a matmul is
float32 (this machine's XLA), not that the model's code cast its operand."""


def _runnable(matmul: Callable[..., Any], operands: list, out_dtype: np.dtype | None) -> Any:
    """`matmul(*operands)`, where XLA:CPU compiles, but cannot run, a bfloat16 x bfloat16 ->
    float32 matmul: for CPU the operands are widened first (exactly: bfloat16 products are
    exact in float32), so the result is the one a GPU computes. Decided when the program is
    lowered (`lax.platform_dependent`), not when it is traced: the same program exported or
    lowered for a GPU or TPU runs its matmul in bfloat16 (`_jaxpr.sub_programs` reads the
    branch of the platform it runs on). Other dtypes are left as they are."""
    if out_dtype != np.float32 or not any(
        getattr(x, "dtype", None) == jnp.bfloat16 for x in operands
    ):
        return matmul(*operands)

    def widened(*operands: Any) -> Any:
        with jax.named_scope(CPU_WIDENED):
            wide = [_cast(x, np.dtype(np.float32)) for x in operands]
        return matmul(*wide)

    return lax.platform_dependent(*operands, cpu=widened, default=matmul)


def _free_axes(ndim: int, *taken: Any) -> tuple[int, ...]:
    used = {d for t in taken for d in t}
    return tuple(d for d in range(ndim) if d not in used)


def _typed_layout(x: Any) -> bool:
    """Whether `x`'s type carries a layout across devices: the mesh axes it varies over inside
    `shard_map`, or an explicit sharding. JAX's transpose rule then adds what the gradient
    needs (the sum over the axes a replicated weight's gradient varies over; the output's
    sharding), so `mixed` takes JAX's rule there."""
    aval = jax.typeof(x)
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    return bool(getattr(aval, "vma", None)) or not getattr(mesh, "empty", True)


def gradient_matmul(
    dimension_numbers: Any, ndims: tuple[int, int], side: int
) -> tuple[Any, tuple[int, ...]]:
    """The matmul that gives operand `side`'s gradient (0: lhs, 1: rhs) of a `dot_general`, as
    JAX's transpose rule makes it: the dimension numbers of `cotangent x other operand`, and
    the permutation that puts its result in that operand's layout."""
    (lc, rc), (lb, rb) = dimension_numbers
    (xc, yc, xb, yb), (x_ndim, y_ndim) = ((lc, rc, lb, rb), ndims)
    if side == 1:
        (xc, yc, xb, yb), (x_ndim, y_ndim) = ((rc, lc, rb, lb), ndims[::-1])
    x_free, y_free = _free_axes(x_ndim, xc, xb), _free_axes(y_ndim, yc, yb)
    nb = len(xb)
    # The cotangent's axes: batch, then lhs's free axes, then rhs's.
    start = nb + len(x_free) if side == 0 else nb
    g_contract = tuple(range(start, start + len(y_free)))
    dims = ((g_contract, tuple(y_free)), (tuple(range(nb)), tuple(yb)))
    # The result: batch, x's free axes, then x's contracted axes in the order of y's.
    x_contract_by_y = [xc[i] for i in np.argsort(yc)]
    permutation = tuple(int(i) for i in np.argsort([*xb, *x_free, *x_contract_by_y]))
    return dims, permutation


def dot_of(primitive: Any, params: dict) -> dict | None:
    """`mixed`'s `dot` for an equation of `primitive` with `params`: a `dot_general`'s
    dimension numbers and precision (None for a conv, or a dot with an explicit output
    sharding, whose backward matmuls JAX's transpose rule writes)."""
    if primitive is not _jaxpr.DOT_GENERAL or params.get("out_sharding") is not None:
        return None
    return {"dimension_numbers": params["dimension_numbers"], "precision": params.get("precision")}


def mixed(
    op: Callable,
    compute: np.dtype,
    accumulate: np.dtype | None,
    lhs: Any,
    rhs: Any,
    dot: dict | None = None,
):
    """`op(lhs, rhs, preferred_element_type)` on the operands cast to `compute`, with each
    operand's gradient made by its backward matmul in that operand's own dtype (a float32
    weight's in float32; a half-precision activation's in half precision).

    `dot`: where `op` is `lax.dot_general`, its `dimension_numbers` and `precision`: the
    backward matmuls are written from them (`gradient_matmul`), as JAX's transpose rule
    writes them, not traced through `jax.linear_transpose` (two traces per operand), unless
    an operand's type carries a layout across devices (`_typed_layout`)."""

    @jax.custom_vjp
    def in_compute(lhs, rhs):
        return _runnable(
            lambda lhs, rhs: op(lhs, rhs, accumulate),
            [_cast(lhs, compute), _cast(rhs, compute)],
            accumulate,
        )

    def forward(lhs, rhs):
        # The operands as they came: a float32 weight is cast again in the backward
        # pass, so no half copy of it is kept between the passes.
        return in_compute(lhs, rhs), (lhs, rhs)

    def backward(residuals, g):
        lhs, rhs = residuals
        lhs_c, rhs_c, g_c = _cast(lhs, compute), _cast(rhs, compute), _cast(g, compute)
        grads = []
        # Written from the dimension numbers, unless a layout across devices asks for JAX's rule.
        direct = dot if dot is not None and not any(map(_typed_layout, (lhs, rhs, g))) else None
        for i, operand in enumerate((lhs, rhs)):
            if not _floating(operand):
                grads.append(np.zeros(operand.shape, jax.dtypes.float0))
                continue
            wide = jnp.finfo(operand.dtype).bits > jnp.finfo(compute).bits
            wider = operand.dtype if wide else None
            if direct is not None:
                dims, permutation = gradient_matmul(
                    direct["dimension_numbers"], (np.ndim(lhs), np.ndim(rhs)), i
                )
                other, precision = (rhs_c if i == 0 else lhs_c), direct.get("precision")

                def matmul(g, other, dims=dims, wider=wider, precision=precision):
                    return lax.dot_general(g, other, dims, precision, preferred_element_type=wider)

                product = _runnable(matmul, [g_c, other], wider)
                grad = lax.transpose(product, permutation)
            else:

                def one_side(x, i=i):
                    return op(x, rhs_c, None) if i == 0 else op(lhs_c, x, None)

                # JAX's own transpose rule for this operand, traced, then evaluated with
                # its matmul accumulating into the operand's dtype.
                transpose = jax.linear_transpose(one_side, (lhs_c, rhs_c)[i])
                (grad,) = _eval_with_output(jax.make_jaxpr(transpose)(g_c), wider, g_c)
            grads.append(_cast(grad, operand.dtype))
        return tuple(grads)

    in_compute.defvjp(forward, backward)
    return in_compute(lhs, rhs)


@dataclasses.dataclass(frozen=True)
class _Mixed:
    compute_dtype: np.dtype
    accumulate_dtype: np.dtype | None

    def _accumulate(self, preferred_element_type):
        return self.accumulate_dtype if preferred_element_type is None else preferred_element_type


class MixedDotGeneral(_Mixed):
    """A drop-in for `lax.dot_general` (and Flax's `dot_general=`): see the module docstring."""

    def __call__(
        self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kw
    ):
        def op(lhs, rhs, preferred):
            return lax.dot_general(
                lhs, rhs, dimension_numbers, precision, preferred_element_type=preferred, **kw
            )

        accumulate = self._accumulate(preferred_element_type)
        dot = dot_of(_jaxpr.DOT_GENERAL, {**kw, "dimension_numbers": dimension_numbers,
                                           "precision": precision})  # fmt: skip
        return mixed(op, self.compute_dtype, accumulate, lhs, rhs, dot)


class MixedConvGeneralDilated(_Mixed):
    """A drop-in for `lax.conv_general_dilated` (and Flax's `conv_general_dilated=`)."""

    def __call__(self, lhs, rhs, *args, preferred_element_type=None, **kwargs):
        def op(lhs, rhs, preferred):
            return lax.conv_general_dilated(
                lhs, rhs, *args, preferred_element_type=preferred, **kwargs
            )

        accumulate = self._accumulate(preferred_element_type)
        return mixed(op, self.compute_dtype, accumulate, lhs, rhs)


def dot_general(compute_dtype: Any, accumulate_dtype: Any = None) -> MixedDotGeneral:
    """`lax.dot_general` in `compute_dtype`, each operand's gradient in that operand's dtype.

    Args:
      compute_dtype: the dtype both operands are cast to inside the op (float16, bfloat16).
      accumulate_dtype: the dtype of the forward result (`preferred_element_type`);
        None: the compute dtype.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jmp_policy as jmp
      >>> dot = jmp.matmul.dot_general(jnp.float16)
      >>> x, w = jnp.ones((4, 3), jnp.float16), jnp.ones((3, 2), jnp.float32)
      >>> dot(x, w, (((1,), (0,)), ((), ()))).dtype
      dtype('float16')
      >>> grad = jax.grad(lambda w: dot(x, w, (((1,), (0,)), ((), ()))).sum())(w)
      >>> grad.dtype, float(grad[0, 0])
      (dtype('float32'), 4.0)
    """
    return MixedDotGeneral(
        normalise_dtype(compute_dtype, "compute_dtype"), _optional(accumulate_dtype)
    )


def conv_general_dilated(
    compute_dtype: Any, accumulate_dtype: Any = None
) -> MixedConvGeneralDilated:
    """`lax.conv_general_dilated` in `compute_dtype`, each operand's gradient in its own dtype."""
    return MixedConvGeneralDilated(
        normalise_dtype(compute_dtype, "compute_dtype"), _optional(accumulate_dtype)
    )


def _optional(value: Any) -> np.dtype | None:
    return None if value is None else normalise_dtype(value, "accumulate_dtype")


def check_reduce_dtype(value: Any) -> np.dtype | None:
    """`reduce_dtype` of the integrations: None or float32."""
    if value is None:
        return None
    dtype = normalise_dtype(value, "reduce_dtype")
    if dtype != np.float32:
        raise ValueError(
            "Expected float32 (weight gradients made and summed in float32) or None (in the "
            f"compute dtype) for `reduce_dtype`, got {dtype.name}."
        )
    return dtype


def check_accumulate_dtype(value: Any) -> np.dtype | None:
    """`accumulate_dtype` of the integrations: None or a floating dtype."""
    return _optional(value)


__all__ = [
    "MixedConvGeneralDilated",
    "MixedDotGeneral",
    "conv_general_dilated",
    "dot_general",
]
