"""How reports write numbers a user compares across them."""

from __future__ import annotations

import math
import re


def format_scale(value: float) -> str:
    """A loss scale as reports write it: `2^15` for a power of two, else 6 significant digits."""
    if value > 0 and math.isfinite(value):
        exponent = math.log2(value)
        if exponent.is_integer():
            return f"2^{exponent:.0f}"
    return f"{value:.6g}"


def short_dtype(name: str) -> str:
    """A dtype's name in a table column: `e4m3` for float8_e4m3fn, `bf16` for bfloat16."""
    small = re.fullmatch(r"float[48]_(e\dm\d)\w*", name)
    if small:
        return small.group(1)
    return {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}.get(name, name)
