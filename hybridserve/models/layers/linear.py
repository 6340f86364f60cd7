"""Linear layers for inference: plain `F.linear`, or oneDNN with weights packed once on CPU.

PyTorch's CPU `F.linear` goes through MKL, which on AMD CPUs (and at the small row
counts of decode steps anywhere) reaches a fraction of the machine's bandwidth; oneDNN
with the weight pre-packed into its blocked layout reads it at full speed
(benchmarks/head_chunks.py, benchmarks/results/cpu_kernels.md). Packing costs a copy per
weight at load; small weights (the tiny test models) stay on the plain path, where
oneDNN's per-call overhead would dominate.

Results differ from `F.linear` only by float summation order (~1e-6 relative).

bfloat16 weights on a CPU that does not multiply bf16 natively (no AVX512-BF16 or AMX)
are packed as float32 copies of their bf16 values, and each call runs the float32 kernel
on the input's values and rounds the result to bf16 once. That is the arithmetic of a
native bf16 GEMM (exact products, float32 sums, one rounding) at float32's speed, several
times software bf16's from a few rows on; at one row bf16's half-size reads win, the cost
of this one path (`benchmarks/bf16_linear.py`, benchmarks/results/cpu_kernels.md).
Such weights take float32's memory; `--dtype auto` does not pick bf16 on these CPUs.
"""

from __future__ import annotations

from functools import cache
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from hybridserve.models.platform.cpu_features import has_native_bf16, read_cpu_flags
from hybridserve.models.layers.int8 import W8A8Linear, quantize_gemm_weight

Linear = Callable[[torch.Tensor], torch.Tensor]                        # x -> x W^T + b
ResidualLinear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (h, x) -> h + x W^T + b

# Below this many weight elements oneDNN's per-call overhead outweighs its faster kernel
# (measured: 512 x 128 is slower packed, 1536 x 640 already faster at 16 rows).
PACK_MIN_NUMEL = 256 * 1024
# The row count oneDNN tunes the packed layout for: a decode step's batch.
_PACK_ROWS_HINT = 16


def _packable(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16) and weight.dim() == 2
            and weight.numel() >= PACK_MIN_NUMEL and torch.backends.mkldnn.is_available())


@cache
def native_bf16_here() -> bool:
    """Whether this CPU multiplies bf16 in hardware (see cpu_features.has_native_bf16)."""
    return has_native_bf16(read_cpu_flags())


def compute_dtype(weight: torch.Tensor, native_bf16: bool | None = None) -> torch.dtype:
    """The dtype `weight`'s packed kernel multiplies in: its own, except bfloat16 on a CPU
    without native bf16 (`native_bf16`, default: this CPU's), which runs as float32 (see
    the module docstring)."""
    if native_bf16 is None:
        native_bf16 = native_bf16_here()
    bf16_as_float32 = weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and not native_bf16
    return torch.float32 if bf16_as_float32 else weight.dtype


def pack(weight: torch.Tensor, native_bf16: bool | None = None) -> torch.Tensor | None:
    """The oneDNN-packed copy of `weight` [out, in] in its compute_dtype, or None where
    packing does not pay (not CPU float32 or bfloat16, too small) or the CPU lacks the
    instructions oneDNN needs. Packed bfloat16 against plain bfloat16 F.linear, Gemma 3 270M
    shapes on 2 Sapphire Rapids cores without AMX: about 2x at 1 row, 1.15-1.35x at 16 rows."""
    if not _packable(weight):
        return None
    values = weight.detach().to(compute_dtype(weight, native_bf16)).contiguous()
    try:
        return torch.ops.mkldnn._reorder_linear_weight(values, _PACK_ROWS_HINT)
    except (RuntimeError, AttributeError):  # old torch or a CPU oneDNN refuses
        return None


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, native_bf16: bool | None = None
                ) -> tuple[Linear, ResidualLinear, bool]:
    """(linear, residual_linear, packed) for one weight; packed says the plain weight
    is no longer read and may be released. Inputs and outputs are in the weight's dtype
    whatever dtype the kernel computes in (compute_dtype; `native_bf16` as there)."""
    packed = pack(weight, native_bf16)
    if packed is None:
        def linear(x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, weight, bias)

        def residual(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            out = torch.addmm(h, x, weight.t())  # the residual add fused into the matmul
            return out if bias is None else out + bias

        return linear, residual, False
    mkl_linear = torch.ops.mkldnn._linear_pointwise
    if packed.dtype != weight.dtype:  # bf16 computed in float32, one rounding to bf16
        out_dtype, bias32 = weight.dtype, None if bias is None else bias.detach().float()

        def widened_linear(x: torch.Tensor) -> torch.Tensor:
            return mkl_linear(x.float(), packed, bias32, "none", [], "").to(out_dtype)

        def widened_residual(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return mkl_linear.binary(x.float(), h.float(), packed, bias32, "add").to(out_dtype)

        return widened_linear, widened_residual, True

    def packed_linear(x: torch.Tensor) -> torch.Tensor:
        return mkl_linear(x.contiguous(), packed, bias, "none", [], "")

    def packed_residual(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return mkl_linear.binary(x.contiguous(), h, packed, bias, "add")

    return packed_linear, packed_residual, True


class LayerLinears(NamedTuple):
    """One layer's matmuls as callables (plain or oneDNN-packed, see models/layers/linear.py)."""

    qkv: Linear
    o: Linear
    o_residual: ResidualLinear
    gate_up: Linear
    down: Linear
    down_residual: ResidualLinear


def make_int8_linear(weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
                     ) -> tuple[Linear, ResidualLinear]:
    """(linear, residual_linear) as int8 x int8 (models/layers/int8.py): `weight` [out, in] is
    quantized per row once, the input per row at every call; bias and residual are added
    in float32 before the result is rounded to `out_dtype`."""
    matmul = W8A8Linear(*quantize_gemm_weight(weight))
    bias32 = None if bias is None else bias.detach().float()

    def product(x: torch.Tensor) -> torch.Tensor:
        out = matmul(x)
        return out if bias32 is None else out.add_(bias32)

    if out_dtype == torch.float32:  # the product's own dtype: no conversion kernel at all
        return product, lambda h, x: product(x).add_(h)

    def linear(x: torch.Tensor) -> torch.Tensor:
        return product(x).to(out_dtype)

    def residual(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return product(x).add_(h).to(out_dtype)

    return linear, residual
