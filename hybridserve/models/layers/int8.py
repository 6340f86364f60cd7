"""int8 x int8 matmuls on x86 CPUs: the quantizers and the kernel call.

Weights are int8 per output row (symmetric, scale = row max / levels; 127 levels each side,
63 on a CPU without int8 dot products: gemm_weight_levels). Activations are quantized per
row at every call (symmetric, 127 levels) and stored as uint8 around 128 because
oneDNN's int8 GEMM (`onednn.qlinear_pointwise`) takes unsigned activations. The GEMM
returns float32 with the weight scales applied; the per-row activation scale is applied
after it, since the kernel takes only one activation scale per tensor. Beside it run two
more paths with the same result bit for bit (W8A8Linear): `torch._int_mm` on signed int8
activations, for one row where the CPU has int8 dot products, and fbgemm's int8 GEMM
(`quantized.linear_with_input_q_dq_qweight_dq_output_fp32`), which quantizes its float
input itself, for every row count on AVX2 alone (int8_paths).

Why int8 activations at all: without AMX, a decode batch of 16-64 rows makes the matmuls
compute-bound, and VNNI's int8 dot products do twice the multiply-adds per instruction of
AVX512-BF16's (benchmarks/int8_rows.py, benchmarks/results/cpu_kernels.md). On AVX2 alone the int8 products
(vpmaddubsw) still do four times the multiply-adds per instruction of float32 FMAs, and a
step reads a quarter of float32's bytes.

Per-row activation scales lose the small channels of a row with one large channel; the
decoder's linears therefore see smoothed activations (models/layers/smoothing.py). The output
head needs no smoothing: its input is the final norm's output.
"""

from __future__ import annotations

import warnings
from functools import cache
from typing import Callable

import torch

from hybridserve.models.platform.cpu_features import has_int8_dot, has_int8_gemm, read_cpu_flags

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
    u8 x s8) is exact under the same bound (tests/models/test_int8_layers.py runs both under
    ONEDNN_MAX_CPU_ISA=AVX2)."""
    return INT8_LEVELS if has_int8_dot(read_cpu_flags()) else NARROW_WEIGHT_LEVELS


def quantize_rows_float(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / scale rounded, in -127..127 as float32 [S, K], float32 scale [S, 1]): symmetric per
    row, scale = the row's largest magnitude / 127. The levels of the other quantizers, and
    what fbgemm_matmul takes."""
    x = x if x.dtype == torch.float32 else x.float()  # a no-op .float() still costs a dispatch
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_(min=torch.finfo(torch.float32).tiny) / INT8_LEVELS
    return (x / scale).round_(), scale


def quantize_rows_uint8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 [S, K], float32 scale [S, 1]) with x ~= (values - 128) * scale: symmetric per
    row, 127 levels each side (so values are 1..255)."""
    levels, scale = quantize_rows_float(x)
    return levels.add_(UINT8_ZERO_POINT).to(torch.uint8), scale


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [S, K], float32 scale [S, 1]) with x ~= values * scale: the same levels as
    quantize_rows_uint8, signed."""
    levels, scale = quantize_rows_float(x)
    return levels.to(torch.int8), scale


def levels_for(path: str, levels: torch.Tensor) -> torch.Tensor:
    """Whole levels in -127..127 (float32, from quantize_rows_float's rule) stored as `path`'s
    kernel takes them: uint8 around 128 (packed), int8 (plain) or the float32 levels
    themselves (fbgemm). Out of place, so it can close a compiled chain of element-wise
    ops (models/arch/int8_chains.py) as well as QUANTIZERS' eager ones."""
    if path == PACKED:
        return (levels + UINT8_ZERO_POINT).to(torch.uint8)
    return levels.to(torch.int8) if path == PLAIN else levels


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
def fbgemm_available() -> bool:
    """Whether this torch packs and runs fbgemm's int8 linear with float32 in and out (x86
    builds do). Tried on a small weight: the quantized-tensor API it needs is deprecated,
    so a later torch may lack it, and then the other paths serve."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        packed = fbgemm_pack(torch.ones(2, 4, dtype=torch.int8), torch.ones(2))
        out = fbgemm_matmul(packed)(torch.ones(1, 4), torch.ones(1, 1))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return out.tolist() == [[4.0, 4.0]]


def fbgemm_pack(values: torch.Tensor, scale: torch.Tensor) -> torch.ScriptObject:
    """int8 weight rows (`values`, `scale` from quantize_gemm_weight) packed for fbgemm's
    GEMM: the int8 values re-laid out, one float scale per row (the same float32 values)."""
    zero_points = torch.zeros(len(scale), dtype=torch.int64)
    with warnings.catch_warnings():
        # torch warns at every quantized tensor that the API is deprecated; fbgemm_available
        # checks that it still works, and one warning per layer would only bury the log.
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        weight = torch._make_per_channel_quantized_tensor(values, scale.double(), zero_points, 0)
    # The engine setting picks the packed type; the packed weight then runs fbgemm's
    # kernel whatever the setting is later. Restored at once: it is process-wide.
    engine = torch.backends.quantized.engine
    torch.backends.quantized.engine = "fbgemm"
    try:
        return torch.ops.quantized.linear_prepack(weight, None)
    finally:
        torch.backends.quantized.engine = engine


def fbgemm_values(packed: torch.ScriptObject) -> torch.Tensor:
    """The int8 weight rows a fbgemm_pack result holds (for the other paths on demand)."""
    return torch.ops.quantized.linear_unpack(packed)[0].int_repr()


def fbgemm_matmul(packed: torch.ScriptObject) -> Int8Matmul:
    """The same product as w8a8_matmul through fbgemm's u8 x s8 GEMM: (levels as float32
    from quantize_rows_float, their row scale) -> x W^T in float32. The kernel quantizes
    its float input itself with one scale and zero point per tensor; given whole levels,
    scale 1 and zero point 128 it stores level + 128, as quantize_rows_uint8 does, so the
    int32 sums and the weight scales applied to them are w8a8_matmul's
    (tests/models/test_int8_layers.py compares them bit for bit). The levels come rounded because
    fbgemm's own rounding of exact halves differs between its kernels (0.5 went to 1 with
    17 rows and to 0 with 3). Why it exists: on AVX2 alone it is the fastest of the three
    at every row count (see choose_int8_paths)."""
    op = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32

    def matmul(x: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        return op(x, 1.0, UINT8_ZERO_POINT, packed).mul_(x_scale)

    return matmul


PACKED, PLAIN, FBGEMM = "packed", "plain", "fbgemm"  # the int8 x int8 paths, see int8_paths
QUANTIZERS = {PACKED: quantize_rows_uint8, PLAIN: quantize_rows_int8, FBGEMM: quantize_rows_float}


def choose_int8_paths(flags: frozenset[str] | set[str], fbgemm: bool) -> tuple[str, str]:
    """(the path for one row, the path for more rows) of the int8 x int8 matmuls on a CPU with
    these flags, `fbgemm` saying whether torch has fbgemm (fbgemm_available).

    With int8 dot products: plain (torch._int_mm on the plain weight) for one row, packed
    (oneDNN's packed GEMM) for more. The packed GEMM has a fixed cost per call whatever its
    size, much of a one-row product on a decoder-sized weight; from 2 rows on the plain
    path is no faster (`python benchmarks/int8_rows.py`, benchmarks/results/cpu_kernels.md).

    On AVX2 alone: fbgemm at every row count. There oneDNN's packed u8 x s8 GEMM is no
    faster than float32 up to 16 rows and torch._int_mm only somewhat faster, while
    fbgemm's GEMM is faster than both at every size (`python benchmarks/int8_rows.py --isa
    avx2 --rows 1,4,16,64 --repeat 7`, commit 8f35cd8, 2 AMD EPYC cores limited to AVX2,
    load 1.0; float32 / packed / plain / fbgemm ms per step: the 72 decoder matmuls at 1 row
    12.7 / 13.0 / 8.8 / 5.1, at 16 rows 27.0 / 28.0 / 16.7 / 12.0, at 64 rows 71.0 / 57.3 /
    48.2 / 41.6; the head's 8 chunks at 1 row 20.8 / 21.3 / 25.5 / 6.7, at 16 rows 44.8 /
    47.3 / 42.7 / 17.6). Without fbgemm in the build: plain."""
    if has_int8_dot(flags):
        return PLAIN, PACKED
    return (FBGEMM, FBGEMM) if fbgemm else (PLAIN, PLAIN)


@cache
def int8_paths() -> tuple[str, str]:
    """choose_int8_paths for this CPU and torch."""
    return choose_int8_paths(read_cpu_flags(), fbgemm_available())


def int8_matmul(path: str, values: torch.Tensor, scale: torch.Tensor) -> Int8Matmul:
    """The kernel of `path` for int8 weight rows (`values`, `scale` from quantize_gemm_weight);
    it takes what QUANTIZERS[path] makes of the activations."""
    if path == FBGEMM:
        return fbgemm_matmul(fbgemm_pack(values, scale))
    return (w8a8_matmul if path == PACKED else plain_matmul)(values, scale)


class W8A8Linear:
    """x [S, K] (float) -> x W^T in float32, int8 x int8: `x` quantized per row at each
    call, the int8 weight rows (`values`, `scale` from quantize_gemm_weight) fixed.

    Three paths, which sum the same int32 products and scale them the same way, so they
    agree bit for bit (tests/models/test_int8_layers.py): `general`, oneDNN's packed u8 x s8
    GEMM (w8a8_matmul); `plain`, torch._int_mm on signed activations and the plain int8
    weight (plain_matmul); `fbgemm`, fbgemm's u8 x s8 GEMM (fbgemm_matmul). Which ones
    serve is a matter of speed on this CPU (int8_paths); only their weights are made at
    load, the others' at the first call (tests, benchmarks). Where fbgemm alone serves (AVX2
    alone) the plain rows are not kept beside its packed copy: the decoder's int8 weights
    (100 MB for Gemma 3 270M) are held once.
    """

    def __init__(self, values: torch.Tensor, scale: torch.Tensor) -> None:
        self._scale = scale
        self._one_row, self._more_rows = int8_paths()
        self._fbgemm_packed: torch.ScriptObject | None = None
        self._kernels: dict[str, Int8Matmul] = {}
        for path in {self._one_row, self._more_rows}:
            if path == FBGEMM:  # kept: the other paths' weight rows can be unpacked from it
                self._fbgemm_packed = fbgemm_pack(values, scale)
                self._kernels[path] = fbgemm_matmul(self._fbgemm_packed)
            else:
                self._kernels[path] = int8_matmul(path, values, scale)
        self._values = None if self._kernels.keys() == {FBGEMM} else values

    def _kernel(self, path: str) -> Int8Matmul:
        if path not in self._kernels:  # a path that does not serve here (tests, benchmarks)
            values = self._values if self._values is not None else fbgemm_values(self._fbgemm_packed)
            self._kernels[path] = int8_matmul(path, values, self._scale)
        return self._kernels[path]

    def _run(self, path: str, x: torch.Tensor) -> torch.Tensor:
        return self._kernel(path)(*QUANTIZERS[path](x))

    @property
    def packed(self) -> Int8Matmul:
        """The packed GEMM on (unsigned activations, their scale)."""
        return self._kernel(PACKED)

    def path_for(self, rows: int) -> str:
        """The path that serves `rows` rows here (int8_paths)."""
        return self._one_row if rows == 1 else self._more_rows

    def quantized(self, path: str, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x W^T from x already quantized for `path` (values as levels_for(path, ...), per-row
        scale): for callers that quantize in one fused kernel with what produced x."""
        return self._kernel(path)(values, scale)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(self.path_for(x.shape[0]), x)

    def general(self, x: torch.Tensor) -> torch.Tensor:
        """oneDNN's packed GEMM on unsigned activations."""
        return self._run(PACKED, x)

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        """torch._int_mm on signed activations and the plain weight."""
        return self._run(PLAIN, x)

    def fbgemm(self, x: torch.Tensor) -> torch.Tensor:
        """fbgemm's GEMM on the levels as float32."""
        return self._run(FBGEMM, x)
