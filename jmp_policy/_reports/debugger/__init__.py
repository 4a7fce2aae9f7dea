"""A precision debugger: per-layer statistics of a loss's forward and backward pass.

`debug_precision(loss_fn, *args)` traces the loss's value and gradient and runs them as one
program that returns every intermediate value (on the default device: a debugging tool, not a
train step), then reads them operation by operation on the host.
For every layer (a Linen module path, an NNX attribute path or an Equinox field path under the
root module's class name, a `jax.named_scope`; "(top level)" outside any) and direction (forward:
activations, backward: the values that carry the gradient) it records how close the values come
to the edges of a target dtype at a given loss scale, and it names the first operation that made
an inf or NaN out of finite inputs. Under a policy, only what the policy runs in the target dtype
is judged.

One concept a file: `report` (the report and its advice), `names` (an operation's layer and
direction), `values` (the statistics of values on the host), `interpreter` (its rule sets
over the engine's interpreter, `jmp_policy._core.interpreter`: every operation recorded,
loops unrolled), `run` (`debug_precision`), `in_program` (statistics
inside a jitted step). Programs are read through `jmp_policy._core.jaxpr`."""

from jmp_policy._reports.debugger.in_program import PrecisionStats, value_and_grad_with_stats
from jmp_policy._reports.debugger.names import TOP_LEVEL
from jmp_policy._reports.debugger.report import (
    LayerStats,
    NonFiniteOrigin,
    OpError,
    PrecisionDebugReport,
)
from jmp_policy._reports.debugger.run import debug_precision

__all__ = [
    "TOP_LEVEL",
    "LayerStats",
    "NonFiniteOrigin",
    "OpError",
    "PrecisionDebugReport",
    "PrecisionStats",
    "debug_precision",
    "value_and_grad_with_stats",
]
