"""int8 x int8 matmuls on x86 CPUs: the quantizers and the kernel call.

Weights are int8 per output row (symmetric, scale = row max / levels; 127 levels each side,
63 on a CPU without int8 dot products: gemm_weight_levels). Activations are quantized per
row at every call (symmetric, 127 levels) and stored as uint8 around 128 because
oneDNN's int8 GEMM (`onednn.qlinear_pointwise`) takes unsigned activations. The GEMM
returns float32 with the weight scales applied; the per-row activation scale is applied
after it, since the kernel takes only one activation scale per tensor. Beside it runs a
plain path, `torch._int_mm` on signed int8 activations (W8A8Linear), with the same result
bit for bit: for one row where the CPU has int8 dot products, for every row count on
AVX2 alone (plain_gemm_max_rows).

Why int8 activations at all: without AMX, a decode batch of 16-64 rows makes the matmuls
compute-bound, and VNNI's int8 dot products do twice the multiply-adds per instruction of
AVX512-BF16's. Gemma 3 270M on one Sapphire Rapids core, 16 rows: all 18 layers' matmuls
take 70 ms per step in bfloat16 and 23 ms in int8 x int8. On AVX2 alone the int8 products
(vpmaddubsw) still do four times the multiply-adds per instruction of float32 FMAs, and a
step reads a quarter of float32's bytes.

Per-row activation scales lose the small channels of a row with one large channel; the
decoder's linears therefore see smoothed activations (models/smoothing.py). The output
head needs no smoothing: its input is the final norm's output.
"""

from __future__ import annotations

from functools import cache
from typing import Callable

import torch

from hybridserve.models.cpu_features import has_int8_dot, has_int8_gemm, read_cpu_flags

# Rows quantized at a time: float32 temporaries of 2048 x hidden (5 MB at Gemma 3's 640),
# small beside the weight's own int8 copy.
QUANTIZE_BLOCK_ROWS = 2048
INT8_LEVELS = 127
NARROW_WEIGHT_LEVELS = 63  # weights' levels without int8 dot products (gemm_weight_levels)
UINT8_ZERO_POINT = 128  # a symmetric int8 activation stored as uint8 (oneDNN's u8 x s8 GEMM)

# (int8 activations [S, K] as the kernel takes them, their float32 per-row scale [S, 1]) -> float32 [S, N]
Int8Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@cache
def int8_gemm_available() -> bool:
    """Whether the int8 x int8 GEMMs run here: oneDNN's quantized linear exists and the CPU
    has int8 dot products or at least AVX2 (whose u8 x s8 step needs narrower weights:
    gemm_weight_levels). Elsewhere the head alone is quantized, weight-only."""
    return hasattr(torch.ops.onednn, "qlinear_pointwise") and has_int8_gemm(read_cpu_flags())


@cache
def gemm_weight_levels() -> int:
    """The largest |weight level| the int8 x int8 GEMMs take on this CPU.

    With int8 dot products (VNNI, AMX-INT8) the u8 x s8 products go straight into int32
    sums: 127. Without them (AVX2 alone) oneDNN multiplies with vpmaddubsw, which adds each
    pair of products into int16 and saturates there: activations up to 255 times weights of
    127 make pairs of up to 64,770, past 32,767 (measured on AVX2: int32 sums off by 10^5).
    Weights within +-63 keep every pair within 2 x 255 x 63 = 32,130, so the sums stay
    exact, for one bit of weight precision. torch._int_mm (s8 x s8, which oneDNN shifts to
    u8 x s8) is exact under the same bound (tests/test_int8_layers.py runs both under
    ONEDNN_MAX_CPU_ISA=AVX2)."""
    return INT8_LEVELS if has_int8_dot(read_cpu_flags()) else NARROW_WEIGHT_LEVELS


def _row_levels(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / scale rounded, in -127..127 as float32 [S, K], float32 scale [S, 1]): symmetric per
    row, scale = the row's largest magnitude / 127."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_(min=torch.finfo(torch.float32).tiny) / INT8_LEVELS
    return (x / scale).round_(), scale


def quantize_rows_uint8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 [S, K], float32 scale [S, 1]) with x ~= (values - 128) * scale: symmetric per
    row, 127 levels each side (so values are 1..255)."""
    levels, scale = _row_levels(x)
    return levels.add_(UINT8_ZERO_POINT).to(torch.uint8), scale


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [S, K], float32 scale [S, 1]) with x ~= values * scale: the same levels as
    quantize_rows_uint8, signed."""
    levels, scale = _row_levels(x)
    return levels.to(torch.int8), scale


def quantize_int8_rows(weight: torch.Tensor, levels: int = INT8_LEVELS) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values [N, K] in -levels..levels, float32 scale per row [N]) with
    weight ~= values * scale[:, None].
    Rows are independent, so they are quantized QUANTIZE_BLOCK_ROWS at a time: the float32
    temporaries then cost a few MB instead of several copies of the whole weight (three
    float32 copies of a 16k x 640 head chunk were 120 MB of the default model's peak RSS)."""
    n = weight.shape[0]
    values = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(n, dtype=torch.float32, device=weight.device)
    for start in range(0, n, QUANTIZE_BLOCK_ROWS):
        stop = min(start + QUANTIZE_BLOCK_ROWS, n)
        w = weight[start:stop].float()
        block_scale = w.abs().amax(dim=1).clamp_(min=torch.finfo(torch.float32).tiny) / levels
        scale[start:stop] = block_scale
        values[start:stop] = torch.round(w / block_scale[:, None]).clamp_(-levels, levels)
    return values, scale


def quantize_gemm_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_int8_rows with this CPU's levels for the int8 x int8 GEMMs (gemm_weight_levels)."""
    return quantize_int8_rows(weight, gemm_weight_levels())


def w8a8_matmul(values: torch.Tensor, scale: torch.Tensor) -> Int8Matmul:
    """The int8 x int8 product with int8 weight rows (`values`, `scale` from
    quantize_gemm_weight), packed once for oneDNN: (x_values, x_scale) -> x W^T in float32,
    both scales applied."""
    packed = torch.ops.onednn.qlinear_prepack(values, None)
    zero_points = torch.zeros(len(scale), dtype=torch.int64)
    qlinear = torch.ops.onednn.qlinear_pointwise

    def matmul(x: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        out = qlinear(x, 1.0, UINT8_ZERO_POINT, packed, scale, zero_points, None, 1.0, 0,
                      torch.float32, "none", [None], "")
        return out.mul_(x_scale)

    return matmul


def plain_matmul(values: torch.Tensor, scale: torch.Tensor) -> Int8Matmul:
    """The same product as w8a8_matmul through torch._int_mm on the plain weight rows (a
    transposed view, no copy): (signed x_values from quantize_rows_int8, x_scale) -> x W^T
    in float32, scaled in the same order, so equal to w8a8_matmul's bit for bit."""
    values_t = values.t()  # [K, N] with strides (1, K): _int_mm reads the rows as they are

    def matmul(x: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        return torch._int_mm(x, values_t).mul(scale).mul_(x_scale)

    return matmul


@cache
def plain_gemm_max_rows() -> float:
    """The most rows for which W8A8Linear takes its plain path (torch._int_mm on the plain
    weight) rather than oneDNN's packed GEMM on this CPU.

    With int8 dot products: 1. The packed GEMM costs about 30 us per call whatever its
    size (a 64 x 64 weight takes as long as a 640 x 1024 one), much of a one-row product
    on a decoder-sized weight; from 2 rows on the plain path is no faster
    (`python benchmarks/int8_rows.py`, Gemma 3 270M's 72 decoder matmuls, 2 Sapphire
    Rapids cores, 4 runs, load ~1: one row 8.9-13.2 ms per step against 11.2-16.7 packed;
    2 rows 12.0-19.0 vs 11.2-16.9, 16 rows 20.1-27.4 vs 20.1-26.6).

    On AVX2 alone: every row count. There oneDNN's packed u8 x s8 GEMM is no faster than
    float32 up to 16 rows, while torch._int_mm is faster at every size (`python
    benchmarks/int8_rows.py --isa avx2 --rows 1,4,16,64 --repeat 9`, 2 AMD EPYC cores
    limited to AVX2, load 0.7; plain / packed / float32 ms per step: the 72 decoder
    matmuls at 1 row 9.4 / 14.0 / 15.2, at 16 rows 17.0 / 28.0 / 25.4; the head's 8
    chunks at 16 rows 29.0 / 40.5 / 37.9)."""
    return 1 if has_int8_dot(read_cpu_flags()) else float("inf")


def plain_gemm_always() -> bool:
    """Whether every row count takes the plain path here (AVX2 alone): the packed GEMM is
    then never used, and no packed copy of a weight need be made."""
    return plain_gemm_max_rows() == float("inf")


class W8A8Linear:
    """x [S, K] (float) -> x W^T in float32, int8 x int8: `x` quantized per row at each
    call, the int8 weight rows (`values`, `scale` from quantize_gemm_weight) fixed.

    Two paths: `general`, oneDNN's packed u8 x s8 GEMM (w8a8_matmul), and `plain`,
    torch._int_mm on signed activations and the plain int8 weight (plain_matmul). Which
    one runs is a matter of speed on this CPU (plain_gemm_max_rows). Both sum the same
    int32 products and scale them the same way, so they agree bit for bit
    (tests/test_int8_layers.py). The packed copy is made at the first call that needs it:
    on AVX2 alone, where every call takes the plain path, never (the decoder's int8 size,
    100 MB for Gemma 3 270M, not held twice).
    """

    def __init__(self, values: torch.Tensor, scale: torch.Tensor) -> None:
        self._values, self._scale = values, scale
        self._plain = plain_matmul(values, scale)
        self._plain_max_rows = plain_gemm_max_rows()
        # packed at load where serving will use it, not in the first step that needs it
        self._packed = None if plain_gemm_always() else w8a8_matmul(values, scale)

    @property
    def packed(self) -> Int8Matmul:
        """The packed GEMM on (unsigned activations, their scale)."""
        if self._packed is None:
            self._packed = w8a8_matmul(self._values, self._scale)
        return self._packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.plain(x) if x.shape[0] <= self._plain_max_rows else self.general(x)

    def general(self, x: torch.Tensor) -> torch.Tensor:
        """The general path: unsigned activations into the packed GEMM."""
        return self.packed(*quantize_rows_uint8(x))

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        """The plain path: signed activations, torch._int_mm on the plain weight."""
        return self._plain(*quantize_rows_int8(x))
