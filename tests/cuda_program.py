"""The matmuls of the program a GPU would compile: a function exported for CUDA
(`jax.export(..., platforms=["cuda"])`, which lowers on a machine without a GPU), its
StableHLO `dot_general`s and `convolution`s read with their operand dtypes and FLOPs.

What XLA's GPU compiler is given decides its GEMMs: a `dot_general` whose operands are a
float32 and a 16-bit array runs as a float32 GEMM (the 16-bit operand is widened), and so
does one on two float32 operands. `jax.export` lowers each `lax.platform_dependent` to the
CUDA branch, so the CPU-only widening of bfloat16 matmuls (`jmp_policy.matmul._runnable`)
is not in it.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax

_TENSOR = re.compile(r"tensor<([^>]*)>")
_DOT = re.compile(r"= stablehlo\.dot_general .*?contracting_dims = \[([\d, ]*)\] x")
_CONV = re.compile(r"= stablehlo\.convolution\(.*?\]x\[([^\]]*)\]->")


@dataclasses.dataclass(frozen=True)
class Matmul:
    op: str  # "dot_general" or "convolution"
    lhs: str  # the element types as StableHLO prints them: f32, bf16, f16, f8E4M3FN, ...
    rhs: str
    flops: int
    line: str

    @property
    def mixes_float32_with_16_bits(self) -> bool:
        return {self.lhs, self.rhs} in ({"f32", "bf16"}, {"f32", "f16"})

    @property
    def in_low_precision(self) -> bool:
        """Both operands 16- or 8-bit floats."""
        return all(t in ("bf16", "f16") or t.startswith("f8") for t in (self.lhs, self.rhs))


def _shape_and_type(tensor: str) -> tuple[list[int], str]:
    *dims, element = tensor.split("x")
    return [int(d) for d in dims], element


def matmuls(mlir: str) -> list[Matmul]:
    """Every `dot_general` and `convolution` of a StableHLO module's text."""
    found = []
    for line in mlir.splitlines():
        dot, conv = _DOT.search(line), _CONV.search(line)
        if dot is None and conv is None:
            continue
        signature = line.rsplit(" : ", 1)[1]
        (lhs, lhs_type), (rhs, rhs_type), (out, _) = (
            _shape_and_type(t) for t in _TENSOR.findall(signature)[:3]
        )
        if dot is not None:
            contracted = [int(d) for d in dot.group(1).split(",") if d.strip()]
            macs = math.prod(out) * math.prod(lhs[d] for d in contracted)
            op = "dot_general"
        else:
            assert conv is not None
            # the kernel's layout, e.g. `0, 1, i, o`: each output element sums over all of
            # the kernel but its output features
            kernel_dims = [d.strip() for d in conv.group(1).split(",")]
            macs = math.prod(out) * math.prod(rhs) // rhs[kernel_dims.index("o")]
            op = "convolution"
        found.append(Matmul(op, lhs_type, rhs_type, 2 * macs, line.strip()))
    return found


def cuda_matmuls(fun, *args) -> list[Matmul]:
    """The matmuls of `fun(*args)` (a jitted function) lowered for CUDA."""
    exported = jax.export.export(fun, platforms=["cuda"])(*args)
    return matmuls(exported.mlir_module())


def assert_gpu_matmuls_in_low_precision(found: list[Matmul], what: str) -> None:
    """>= 99% of the matmul FLOPs on 16/8-bit operands, and no matmul of a float32 operand
    with a 16-bit one."""
    assert found, f"{what}: no matmul in the CUDA program"
    mixing = [m.line[:300] for m in found if m.mixes_float32_with_16_bits]
    assert not mixing, f"{what}: matmuls mixing float32 and 16-bit operands: {mixing}"
    share = sum(m.flops for m in found if m.in_low_precision) / sum(m.flops for m in found)
    assert share >= 0.99, f"{what}: {share:.2%} of the GPU program's matmul FLOPs in 16/8 bits"
