"""jmp_policy: mixed precision for JAX, Flax and optax.

Compute in float16 or bfloat16 while the master weights stay in float32. The loss is scaled so
that small float16 gradients survive, a step whose gradients overflow is skipped, and numerically
fragile operations stay in float32. Everything is a pure function of pytrees: it runs under `jit`,
`grad`, `vmap` and buffer donation. `import jmp_policy as jmp` is a drop-in for jmp.

A loss-scaled train step:

    tx = jmp.loss_scaling(optax.adam(1e-3), jmp.DynamicLossScale(2.0**15))
    opt_state = tx.init(params)                          # float32 master weights

    @jax.jit
    def train_step(params, opt_state, batch):
        loss, grads = jmp.value_and_scaled_grad(loss_fn)(opt_state, params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)  # skips on inf/NaN
        return optax.apply_updates(params, updates), opt_state, loss

The top level (`__all__`, 21 names):

- jmp's eleven: `Policy`, `get_policy` ("mixed_float16", "params=float32,compute=bfloat16"),
  `cast_to_full`, `cast_to_half`, `half_dtype`; the loss scales `LossScale`, `NoOpLossScale`,
  `StaticLossScale`, `DynamicLossScale`; `all_finite`, `select_tree`.
- A train step: `loss_scaling` (unscale, check, apply or skip, adjust: one optax transform),
  `value_and_scaled_grad`, `get_loss_scale`, `unless_skipped` (a skipped step keeps the model
  state too), `low_precision_optimizer` (bfloat16 parameters and moments).
- `autocast(fn, policy)` and `full_precision(fn)`; `precision_report`, `debug_precision`,
  `loss_scaling_report`.

Beside it, each family in its module: `jmp_policy.linen`, `jmp_policy.nnx`, `jmp_policy.eqx`
(imported on first use: jmp and optax users do not load Flax or Equinox);
`jmp_policy.scaling` (the loss-scaling state and records, spike skipping,
`check_loss_scaling`); `jmp_policy.casting` (autocast's op lists); `jmp_policy.reports` (the
report records, `value_and_grad_with_stats`); `jmp_policy.low_precision`; `jmp_policy.fp8`,
`jmp_policy.block_scaled`, `jmp_policy.nvfp4` (NVFP4's training recipe:
`fp8_scaling=nvfp4.Recipe()`); `jmp_policy.matmul`; `jmp_policy.errors` (every warning and error).
Names that were at the top level before are still found there for one release, with a
`DeprecationWarning` naming their module.

The source: the public modules are faces; what they show is built in one private package per
family, each with a docstring naming its files: `_core` (the jaxpr core, the compatibility
layer, pytrees, module names), `_loss_scaling`, `_autocast`, `_flax`, `_fp8`, `_low_precision`
and `_reports` (`precision_report` and the debugger). `transform`, `census`, `loss_scale`,
`finite`, `scaled_grad`, `diagnostics`, `activations`, `overrides` and `debugger` are module
paths of earlier releases: they import for one release, with a `DeprecationWarning`.

The guides and the API reference are in the repository's docs/ folder (`mkdocs serve`).
"""

from typing import TYPE_CHECKING

from jmp_policy import casting as casting  # the families' modules, beside the top level
from jmp_policy import errors as errors
from jmp_policy import matmul as matmul
from jmp_policy import nvfp4 as nvfp4
from jmp_policy import reports as reports
from jmp_policy import scaling as scaling
from jmp_policy._flax import serialization as _flax_serialization
from jmp_policy._loss_scaling.diagnostics import loss_scaling_report
from jmp_policy._loss_scaling.finite import all_finite
from jmp_policy._loss_scaling.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    select_tree,
)
from jmp_policy._loss_scaling.optimizer import loss_scaling
from jmp_policy._loss_scaling.scaled_grad import value_and_scaled_grad
from jmp_policy._loss_scaling.state import get_loss_scale, unless_skipped
from jmp_policy._reports.census import precision_report
from jmp_policy._reports.debugger import debug_precision
from jmp_policy.autocast import autocast, full_precision  # the module first, then the function
from jmp_policy.low_precision import low_precision_optimizer
from jmp_policy.policy import Policy, cast_to_full, cast_to_half, get_policy, half_dtype

if TYPE_CHECKING:
    from jmp_policy import eqx as eqx
    from jmp_policy import linen as linen
    from jmp_policy import nnx as nnx

_flax_serialization.register_when_flax_loads()

__version__ = "0.1.0"

_LAZY_SUBMODULES = ("eqx", "linen", "nnx")


def __getattr__(name: str):
    import importlib

    # `jmp_policy.linen` and `jmp_policy.nnx` import Flax, `jmp_policy.eqx` Equinox;
    # load them on first use.
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_SUBMODULES})


__all__ = (
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "Policy",
    "StaticLossScale",
    "all_finite",
    "autocast",
    "cast_to_full",
    "cast_to_half",
    "debug_precision",
    "full_precision",
    "get_loss_scale",
    "get_policy",
    "half_dtype",
    "loss_scaling",
    "loss_scaling_report",
    "low_precision_optimizer",
    "precision_report",
    "select_tree",
    "unless_skipped",
    "value_and_scaled_grad",
)
