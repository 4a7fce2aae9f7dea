"""How the precision debugger names the layer of an operation (`_naming.module_path`, as the
integrations' `overrides` take it), its direction and its source line."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from jmp_policy._core import naming as _naming
from jmp_policy._core.overrides import FLOAT32_ISLAND, FULL_PRECISION_REGION
from jmp_policy._core.validation import is_library_file

TOP_LEVEL = _naming.TOP_LEVEL
_module_path = _naming.relative
# Name-stack parts that are not modules (JAX names a remat's recomputation `rematted_computation`).
_MARKERS = (FLOAT32_ISLAND, FULL_PRECISION_REGION, "rematted_computation")
_WRAPPERS = re.compile(r"^(?:[a-z_]+\()+")  # transpose(, jvp(, vmap(: transforms, not modules


def _layer_and_direction(name_stack: str, gradient: bool | None = None) -> tuple[str, str]:
    backward = "transpose(" in name_stack if gradient is None else gradient
    return _naming.module_path(name_stack, _MARKERS), ("backward" if backward else "forward")


def _once(name_stack: str) -> str:
    """An operation's own name stack with JAX's repetition around a remat's backward pass
    taken out: `transpose(jvp(ckpt))/jvp(ckpt)`, or `ckpt/ckpt` under autocast, is `ckpt`.
    (A module inside a module of the same name, its whole own stack `a/a`, is named `a`
    too: the price of reading the name stack alone.)"""
    parts = name_stack.split("/")
    half = len(parts) // 2
    bare = [_WRAPPERS.sub("", p).rstrip(")") for p in parts]
    if len(parts) % 2 == 0 and half > 0 and bare[:half] == bare[half:]:
        return "/".join(parts[:half])
    return name_stack


def _float32_island(name_stack: str) -> str | None:
    """The layer an override keeps in float32 around this operation; "" inside a
    `full_precision` region (kept there by the region, not by an override); None outside."""
    if FLOAT32_ISLAND in name_stack:
        return _layer_and_direction(name_stack[: name_stack.index(FLOAT32_ISLAND)])[0]
    return "" if FULL_PRECISION_REGION in name_stack else None


def _source(eqn: Any) -> str:
    tb = eqn.source_info.traceback
    if tb is None:
        return "(unknown)"
    for frame in tb.frames:
        name = frame.file_name.replace("\\", "/")
        if not is_library_file(name):
            return f"{frame.file_name}:{frame.line_num}"
    return "(library code)"


# A masking constant, not data: what models write where attention may not look (float32's
# lowest value as Flax does, -2.38e38, -1e30, -1e9 * 1e30, -inf...) is 1e30 or more in
# magnitude, or exactly its dtype's largest value (float16's -65504, in float16 or cast up to
# float32 for a softmax). Left out of every statistic and op error, and so are the values an
# operation derives from one near the target dtype's edge (-65504 minus the row maximum).


def _hoisted(layers: Iterable[str]) -> dict[str, str]:
    """{name: full name} for the layers named relative to a loop: JAX moves a loop body's
    operations that do not depend on the loop (e.g. a weight's transpose) out of it, keeping
    their names relative to the loop (`cell` for `RNN/cell`). Each is the one layer whose
    name ends with it; where there is none, or more than one, it keeps its name."""
    names = set(layers) - {TOP_LEVEL}
    found = {}
    for name in names:
        holders = [n for n in names if n.endswith("/" + name)]
        if len(holders) == 1:
            found[name] = holders[0]
    return found


def _renamed(layers: Iterable[str], hoisted: dict[str, str]) -> tuple[str, ...]:
    return tuple(sorted({hoisted.get(layer, layer) for layer in layers}))
