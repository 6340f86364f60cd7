"""int8 x int8 matmuls on CPUs with int8 dot products: the quantizers and the kernel call.

Weights are int8 per output row (symmetric, 127 levels, scale = row max / 127). Activations
are quantized per row at every call, the same way, and stored as uint8 around 128 because
oneDNN's int8 GEMM (`onednn.qlinear_pointwise`) takes unsigned activations. The GEMM
returns float32 with the weight scales applied; the per-row activation scale is applied
after it, since the kernel takes only one activation scale per tensor. A one-row product
(a decode step of one request) takes a fast path beside it, `torch._int_mm` on signed int8
activations (W8A8Linear), with the same result bit for bit.

Why int8 activations at all: without AMX, a decode batch of 16-64 rows makes the matmuls
compute-bound, and VNNI's int8 dot products do twice the multiply-adds per instruction of
AVX512-BF16's. Gemma 3 270M on one Sapphire Rapids core, 16 rows: all 18 layers' matmuls
take 70 ms per step in bfloat16 and 23 ms in int8 x int8.

Per-row activation scales lose the small channels of a row with one large channel; the
decoder's linears therefore see smoothed activations (models/smoothing.py). The output
head needs no smoothing: its input is the final norm's output.
"""

from __future__ import annotations

from functools import cache
from typing import Callable

import torch

from hybridserve.models.cpu_features import has_int8_dot, read_cpu_flags

# Rows quantized at a time: float32 temporaries of 2048 x hidden (5 MB at Gemma 3's 640),
# small beside the weight's own int8 copy.
QUANTIZE_BLOCK_ROWS = 2048
INT8_LEVELS = 127
UINT8_ZERO_POINT = 128  # a symmetric int8 activation stored as uint8 (oneDNN's u8 x s8 GEMM)

# (uint8 activations [S, K], their float32 per-row scale [S, 1]) -> float32 [S, N]
Int8Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@cache
def int8_activations_native() -> bool:
    """Whether int8 x int8 GEMMs are the fast path here: oneDNN's quantized linear exists
    and the CPU has int8 dot-product instructions (without them the u8 x s8 step can
    saturate)."""
    return hasattr(torch.ops.onednn, "qlinear_pointwise") and has_int8_dot(read_cpu_flags())


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


def quantize_int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values [N, K], float32 scale per row [N]) with weight ~= values * scale[:, None].
    Rows are independent, so they are quantized QUANTIZE_BLOCK_ROWS at a time: the float32
    temporaries then cost a few MB instead of several copies of the whole weight (three
    float32 copies of a 16k x 640 head chunk were 120 MB of the default model's peak RSS)."""
    n = weight.shape[0]
    values = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(n, dtype=torch.float32, device=weight.device)
    for start in range(0, n, QUANTIZE_BLOCK_ROWS):
        stop = min(start + QUANTIZE_BLOCK_ROWS, n)
        w = weight[start:stop].float()
        block_scale = w.abs().amax(dim=1).clamp_(min=torch.finfo(torch.float32).tiny) / INT8_LEVELS
        scale[start:stop] = block_scale
        values[start:stop] = torch.round(w / block_scale[:, None]).clamp_(-INT8_LEVELS, INT8_LEVELS)
    return values, scale


def w8a8_matmul(values: torch.Tensor, scale: torch.Tensor) -> Int8Matmul:
    """The int8 x int8 product with int8 weight rows (`values`, `scale` from
    quantize_int8_rows), packed once for oneDNN: (x_values, x_scale) -> x W^T in float32,
    both scales applied."""
    packed = torch.ops.onednn.qlinear_prepack(values, None)
    zero_points = torch.zeros(len(scale), dtype=torch.int64)
    qlinear = torch.ops.onednn.qlinear_pointwise

    def matmul(x: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        out = qlinear(x, 1.0, UINT8_ZERO_POINT, packed, scale, zero_points, None, 1.0, 0,
                      torch.float32, "none", [None], "")
        return out.mul_(x_scale)

    return matmul


class W8A8Linear:
    """x [S, K] (float) -> x W^T in float32, int8 x int8: `x` quantized per row at each
    call, the int8 weight rows (`values`, `scale` from quantize_int8_rows) fixed.

    The general path is oneDNN's packed u8 x s8 GEMM (w8a8_matmul). Beside it, a fast path
    for one row (a decode step of one request): `torch._int_mm` on the plain int8 weight.
    The packed GEMM costs about 30 us per call whatever its size (a 64 x 64 weight takes as
    long as a 640 x 1024 one), which is much of a one-row product on a decoder-sized
    weight. `python benchmarks/int8_rows.py` (Gemma 3 270M's 72 decoder matmuls, weights
    from memory, quantizers included, 2 Sapphire Rapids cores, 4 runs, load ~1): one row
    8.9-13.2 ms per step against 11.2-16.7 packed; from 2 rows on the plain GEMM is no
    faster (2 rows 12.0-19.0 vs 11.2-16.9, 16 rows 20.1-27.4 vs 20.1-26.6). So only one row
    takes it; the plain weight stays beside the packed one for it (the decoder's int8 size
    again: 100 MB for Gemma 3 270M).

    Both paths sum the same int32 products and scale them the same way (times the weight
    scales, then times the row's scale), so they agree bit for bit
    (tests/test_int8_layers.py).
    """

    def __init__(self, values: torch.Tensor, scale: torch.Tensor) -> None:
        self.packed = w8a8_matmul(values, scale)
        self._values_t = values.t()  # [K, N] with strides (1, K): _int_mm reads the rows as they are
        self._scale = scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.single_row(x) if x.shape[0] == 1 else self.general(x)

    def general(self, x: torch.Tensor) -> torch.Tensor:
        """The general path: unsigned activations into the packed GEMM."""
        return self.packed(*quantize_rows_uint8(x))

    def single_row(self, x: torch.Tensor) -> torch.Tensor:
        """The fast path (any row count works; one row is where it is faster)."""
        x_values, x_scale = quantize_rows_int8(x)
        return torch._int_mm(x_values, self._values_t).mul(self._scale).mul_(x_scale)
