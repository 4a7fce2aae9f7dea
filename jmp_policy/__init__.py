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

What is here, by topic:

- Policies: `Policy`, `get_policy` ("mixed_float16", "params=float32,compute=bfloat16"),
  `cast_to_full`, `cast_to_half`, `half_dtype`.
- Loss scales (pure pytree state): `NoOpLossScale`, `StaticLossScale`, `DynamicLossScale`;
  `all_finite`, `select_tree`.
- optax: `loss_scaling` (unscale, check, apply or skip, adjust: one transform),
  `value_and_scaled_grad` (the loss for logging, the gradients for `update`), `get_loss_scale`,
  `find_loss_scaling_state`, `LossScalingState`, `LeafFlags`; `unless_skipped` (a skipped
  step keeps the model state too: batch statistics, `eqx.nn.State`).
- Low-precision optimizer state: `low_precision_optimizer` (bfloat16 parameters and moments
  with stochastic rounding, Kahan compensation, or an exact float32 split), `master_params`,
  `LowPrecisionState`.
- Flax: `jmp_policy.linen.mixed_precision`, `jmp_policy.nnx.mixed_precision` (a policy on an
  unmodified model, with float32 norms, softmax and batch statistics). Flax is imported only when
  one of these two is first used, so jmp and optax users do not load it.
- Equinox: `jmp_policy.eqx.mixed_precision` (a policy on an Equinox model, through autocast),
  `jmp_policy.eqx.filter_value_and_scaled_grad`; imported on first use.
- autocast: `autocast(fn, policy)` (matmuls and convs in half precision; exp, log, sums,
  decompositions and FFTs in float32), `full_precision(fn)`, `AUTOCAST_ALLOW`, `AUTOCAST_DENY`,
  `AUTOCAST_NO_HALF_KERNEL`, `precision_report` (operations by dtype, FLOPs, casts, float32
  matmuls and why), `PrecisionWarning`.
- Across devices: `jmp_policy.matmul` (half-precision matmuls and convs whose weight gradients
  are made, and summed across devices, in float32); the Flax integrations and autocast use it
  (`reduce_dtype`, `accumulate_dtype`).
- Diagnostics: `loss_scaling_report` (the scale, skips, which gradients held inf/NaN, and
  gradient statistics with `loss_scaling(..., stats_every=N)`), `check_loss_scaling`,
  `NonFiniteLossError`; `debug_precision` (per-layer statistics in a target dtype, the first
  inf/NaN, advice), `PrecisionDebugReport`; `value_and_grad_with_stats` (the same statistics
  inside a jitted train step), `PrecisionStats`.

The guides and the API reference are in the repository's docs/ folder (`mkdocs serve`).
"""

from typing import TYPE_CHECKING

from jmp_policy import _flax_serialization, matmul
from jmp_policy.autocast import ALLOW as AUTOCAST_ALLOW
from jmp_policy.autocast import DENY as AUTOCAST_DENY
from jmp_policy.autocast import NO_HALF_KERNEL as AUTOCAST_NO_HALF_KERNEL
from jmp_policy.autocast import autocast, full_precision
from jmp_policy.census import PrecisionReport, PrecisionWarning, precision_report
from jmp_policy.debugger import (
    PrecisionDebugReport,
    PrecisionStats,
    debug_precision,
    value_and_grad_with_stats,
)
from jmp_policy.diagnostics import (
    LossScalingReport,
    NonFiniteLossError,
    check_loss_scaling,
    loss_scaling_report,
)
from jmp_policy.finite import all_finite
from jmp_policy.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    select_tree,
)
from jmp_policy.low_precision import LowPrecisionState, low_precision_optimizer, master_params
from jmp_policy.policy import Policy, cast_to_full, cast_to_half, get_policy, half_dtype
from jmp_policy.scaled_grad import value_and_scaled_grad
from jmp_policy.transform import (
    SKIP_CAUSES,
    LeafFlags,
    LossScalingState,
    LossScalingWarning,
    SkipSpikes,
    SpikeStats,
    find_loss_scaling_state,
    get_loss_scale,
    loss_scaling,
    unless_skipped,
)

if TYPE_CHECKING:
    from jmp_policy import eqx, linen, nnx

_flax_serialization.register_when_flax_loads()

__version__ = "0.1.0"

_LAZY_SUBMODULES = ("eqx", "linen", "nnx")


def __getattr__(name: str):
    # `jmp_policy.linen` and `jmp_policy.nnx` import Flax, `jmp_policy.eqx` Equinox;
    # load them on first use.
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_SUBMODULES})


__all__ = (
    "AUTOCAST_ALLOW",
    "AUTOCAST_DENY",
    "AUTOCAST_NO_HALF_KERNEL",
    "DynamicLossScale",
    "LeafFlags",
    "LossScale",
    "LossScalingReport",
    "LossScalingState",
    "LossScalingWarning",
    "LowPrecisionState",
    "NoOpLossScale",
    "NonFiniteLossError",
    "Policy",
    "PrecisionDebugReport",
    "PrecisionReport",
    "PrecisionStats",
    "PrecisionWarning",
    "SKIP_CAUSES",
    "SkipSpikes",
    "SpikeStats",
    "StaticLossScale",
    "all_finite",
    "autocast",
    "cast_to_full",
    "cast_to_half",
    "check_loss_scaling",
    "debug_precision",
    "eqx",
    "find_loss_scaling_state",
    "full_precision",
    "get_loss_scale",
    "get_policy",
    "half_dtype",
    "linen",
    "loss_scaling",
    "loss_scaling_report",
    "low_precision_optimizer",
    "master_params",
    "matmul",
    "nnx",
    "precision_report",
    "select_tree",
    "unless_skipped",
    "value_and_grad_with_stats",
    "value_and_scaled_grad",
)
