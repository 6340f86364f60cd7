"""int8 x int8 matmuls on x86 CPUs: the quantizers and the kernel call.

Weights are int8 per output row (symmetric, scale = row max / levels; 127 levels each side,
63 on a CPU without int8 dot products: gemm_weight_levels). Activations are quantized per
row at every call (symmetric, 127 levels) and stored as uint8 around 128 because
oneDNN's int8 GEMM (`onednn.qlinear_pointwise`) takes unsigned activations. The GEMM
returns float32 with the weight scales applied; the per-row activation scale is applied
after it, since the kernel takes only one activation scale per tensor. Beside it run three
more paths with the same result bit for bit (W8A8Linear): `torch._int_mm` on signed int8
activations and the plain weight rows; fbgemm's int8 GEMM
(`quantized.linear_with_input_q_dq_qweight_dq_output_fp32`), which quantizes its float
input itself; and this project's kernel on AMX's integer tiles (int8_amx.py, signed
activations, both scales applied in its epilogue). One path serves every row count on a
given CPU (int8_path), so each weight is held in one layout only.

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

from hybridserve.models.layers.int8_amx import AmxProduct, AmxWeight, amx_kernel, pack, unpack
from hybridserve.models.platform.cpu_features import has_int8_dot, has_int8_gemm, read_cpu_flags

# Rows quantized at a time: float32 temporaries of 512 x hidden (1.3 MB each at Gemma 3's
# 640), small beside the weight's own int8 copy, and the source rows a block may give back.
QUANTIZE_BLOCK_ROWS = 512
INT8_LEVELS = 127
NARROW_WEIGHT_LEVELS = 63  # weights' levels without int8 dot products (gemm_weight_levels)
UINT8_ZERO_POINT = 128  # a symmetric int8 activation stored as uint8 (oneDNN's u8 x s8 GEMM)

# (int8 activations [S, K] as the kernel takes them, their float32 per-row scale [S, 1], or None
# to leave it to the caller) -> float32 [S, N]
Int8Matmul = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
# (first row, row past the last) of a weight the quantizer has read for the last time
BlockDone = Callable[[int, int], None]


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
    kernel takes them: uint8 around 128 (packed), int8 (plain, amx) or the float32 levels
    themselves (fbgemm). Out of place, so it can close a compiled chain of element-wise
    ops (models/arch/int8_chains.py) as well as QUANTIZERS' eager ones."""
    if path == PACKED:
        return (levels + UINT8_ZERO_POINT).to(torch.uint8)
    return levels.to(torch.int8) if path in (PLAIN, AMX) else levels


def quantize_int8_rows(weight: torch.Tensor, levels: int = INT8_LEVELS, block_done: BlockDone | None = None,
                       column_factors: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values [N, K] in -levels..levels, float32 scale per row [N]) with
    weight ~= values * scale[:, None], or with `column_factors` (float32 [K]: a smoothed
    input's, models/layers/smoothing.py) weight * column_factors ~= values * scale[:, None].
    Rows are independent, so they are quantized QUANTIZE_BLOCK_ROWS at a time: the float32
    temporaries then cost a few MB instead of several copies of the whole weight (three
    float32 copies of a 16k x 640 head chunk were 120 MB of the default model's peak RSS).
    `block_done(start, stop)` is called once rows [start, stop) of `weight` are read for
    the last time: a mapped source can give their pages back then, not after the whole
    weight (models/layers/head.py)."""
    n = weight.shape[0]
    values = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(n, dtype=torch.float32, device=weight.device)
    for start in range(0, n, QUANTIZE_BLOCK_ROWS):
        stop = min(start + QUANTIZE_BLOCK_ROWS, n)
        w = weight[start:stop].to(torch.float32, copy=True)  # a copy even of float32: divided in place
        if column_factors is not None:
            w.mul_(column_factors)
        block_scale = w.abs().amax(dim=1).clamp_(min=torch.finfo(torch.float32).tiny) / levels
        scale[start:stop] = block_scale
        values[start:stop] = w.div_(block_scale[:, None]).round_().clamp_(-levels, levels)
        if block_done is not None:
            block_done(start, stop)
    return values, scale


def quantize_gemm_weight(weight: torch.Tensor, block_done: BlockDone | None = None,
                         column_factors: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_int8_rows with this CPU's levels for the int8 x int8 GEMMs (gemm_weight_levels)."""
    return quantize_int8_rows(weight, gemm_weight_levels(), block_done, column_factors)


def onednn_pack(values: torch.Tensor) -> torch.Tensor:
    """int8 weight rows [N, K] (from quantize_gemm_weight) in oneDNN's packed layout, what
    w8a8_matmul multiplies."""
    return torch.ops.onednn.qlinear_prepack(values, None)


def onednn_values(packed: torch.Tensor) -> torch.Tensor:
    """The int8 weight rows [N, K] an onednn_pack result holds (for the other paths on
    demand): oneDNN reorders its layout back to the plain [K, N], whose transpose they are."""
    return packed.to_dense().t().contiguous()


def w8a8_matmul(packed: torch.Tensor, scale: torch.Tensor) -> Int8Matmul:
    """The int8 x int8 product with int8 weight rows packed for oneDNN (onednn_pack of
    `values`, `scale` from quantize_gemm_weight): (x_values, x_scale) -> x W^T in float32,
    both scales applied."""
    zero_points = torch.zeros(len(scale), dtype=torch.int64)
    qlinear = torch.ops.onednn.qlinear_pointwise

    def matmul(x: torch.Tensor, x_scale: torch.Tensor | None) -> torch.Tensor:
        out = qlinear(x, 1.0, UINT8_ZERO_POINT, packed, scale, zero_points, None, 1.0, 0,
                      torch.float32, "none", [None], "")
        return out if x_scale is None else out.mul_(x_scale)

    return matmul


def plain_matmul(values: torch.Tensor, scale: torch.Tensor) -> Int8Matmul:
    """The same product as w8a8_matmul through torch._int_mm on the plain weight rows (a
    transposed view, no copy): (signed x_values from quantize_rows_int8, x_scale) -> x W^T
    in float32, scaled in the same order, so equal to w8a8_matmul's bit for bit."""
    values_t = values.t()  # [K, N] with strides (1, K): _int_mm reads the rows as they are

    def matmul(x: torch.Tensor, x_scale: torch.Tensor | None) -> torch.Tensor:
        out = torch._int_mm(x, values_t).mul(scale)
        return out if x_scale is None else out.mul_(x_scale)

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
    at every row count (see choose_int8_path)."""
    op = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32

    def matmul(x: torch.Tensor, x_scale: torch.Tensor | None) -> torch.Tensor:
        out = op(x, 1.0, UINT8_ZERO_POINT, packed)
        return out if x_scale is None else out.mul_(x_scale)

    return matmul


PACKED, PLAIN, FBGEMM, AMX = "packed", "plain", "fbgemm", "amx"  # the int8 x int8 paths, see int8_path
QUANTIZERS = {PACKED: quantize_rows_uint8, PLAIN: quantize_rows_int8, FBGEMM: quantize_rows_float,
              AMX: quantize_rows_int8}


def amx_matmul(weight: AmxWeight, scale: torch.Tensor) -> AmxProduct:
    """The same product as plain_matmul, bit for bit, on AMX's integer tiles (int8_amx.py):
    (signed x_values from quantize_rows_int8, x_scale) -> x W^T in float32, x_scale applied
    in the kernel; with the kernel's fused reductions beside it (AmxProduct)."""
    kernel = amx_kernel()
    if kernel is None:
        raise ValueError("the amx int8 path needs amx_int8 and its kernel built")
    return AmxProduct(kernel, weight, scale)


def choose_int8_path(flags: frozenset[str] | set[str], fbgemm: bool, amx: bool = False) -> str:
    """The path of the int8 x int8 matmuls, at every row count, on a CPU with these flags,
    `fbgemm` saying whether torch has fbgemm (fbgemm_available). One path, so that each
    weight is held in one layout: a second layout for some row counts would double the
    int8 weights' memory (the plain and the packed decoder of Gemma 3 270M were 2 x 100 MB).

    With AMX's int8 tiles and their kernel built (`amx`: int8_amx.amx_kernel): amx, where
    oneDNN's packed GEMM took 1.4-1.5x as long from 1 to 16 rows (Gemma 3 270M's decoder
    and head; at 64 rows 0.9-1.1x, and the head's greedy argmax, which the amx kernel
    takes without writing the logits, 0.8x: `python benchmarks/int8_rows.py`,
    benchmarks/results/int8_kernels.md).

    Else with int8 dot products: packed (oneDNN's packed GEMM). It is the fastest from 2 rows
    on; torch._int_mm on the plain rows was faster at one row on an idle machine, by the
    packed GEMM's fixed cost per call, which is all that one path gives up
    (`python benchmarks/int8_rows.py`, benchmarks/results/cpu_kernels.md,
    benchmarks/results/memory_peak.md).

    On AVX2 alone: fbgemm. There oneDNN's packed u8 x s8 GEMM is no faster than float32 up
    to 16 rows and torch._int_mm only somewhat faster, while fbgemm's GEMM is faster than
    both at every size (`python benchmarks/int8_rows.py --isa avx2 --rows 1,4,16,64
    --repeat 7`, benchmarks/results/cpu_kernels.md). Without fbgemm in the build: plain."""
    if amx and "amx_int8" in flags:
        return AMX
    if has_int8_dot(flags):
        return PACKED
    return FBGEMM if fbgemm else PLAIN


@cache
def int8_path() -> str:
    """choose_int8_path for this CPU and torch."""
    flags = read_cpu_flags()
    return choose_int8_path(flags, fbgemm_available(), "amx_int8" in flags and amx_kernel() is not None)


def int8_matmul(path: str, values: torch.Tensor, scale: torch.Tensor) -> Int8Matmul:
    """The kernel of `path` for int8 weight rows (`values`, `scale` from quantize_gemm_weight);
    it takes what QUANTIZERS[path] makes of the activations."""
    return _kernel(path, _layout(path, values, scale), scale)


WeightLayout = torch.Tensor | torch.ScriptObject | AmxWeight  # the weight as one path's kernel holds it


def _layout(path: str, values: torch.Tensor, scale: torch.Tensor) -> WeightLayout:
    """The weight as `path`'s kernel holds it: packed for oneDNN, fbgemm or AMX, or the plain rows."""
    if path == FBGEMM:
        return fbgemm_pack(values, scale)
    if path == AMX:
        return pack(values)
    return onednn_pack(values) if path == PACKED else values


def _kernel(path: str, layout: WeightLayout, scale: torch.Tensor) -> Int8Matmul:
    if path == FBGEMM:
        return fbgemm_matmul(layout)
    if path == AMX:
        assert isinstance(layout, AmxWeight)
        return amx_matmul(layout, scale)
    return (w8a8_matmul if path == PACKED else plain_matmul)(layout, scale)


def _plain_values(path: str, layout: WeightLayout) -> torch.Tensor:
    """The int8 weight rows [N, K] that `path`'s layout holds."""
    if path == FBGEMM:
        return fbgemm_values(layout)
    if path == AMX:
        assert isinstance(layout, AmxWeight)
        return unpack(layout)
    return onednn_values(layout) if path == PACKED else layout


class W8A8Linear:
    """x [S, K] (float) -> x W^T in float32, int8 x int8: `x` quantized per row at each
    call, the int8 weight rows (`values`, `scale` from quantize_gemm_weight) fixed.

    Four paths, which sum the same int32 products and scale them the same way, so they
    agree bit for bit (tests/models/test_int8_layers.py, test_int8_amx.py): `general`,
    oneDNN's packed u8 x s8 GEMM (w8a8_matmul); `plain`, torch._int_mm on signed activations
    and the plain int8 weight (plain_matmul); `fbgemm`, fbgemm's u8 x s8 GEMM (fbgemm_matmul);
    `amx`, AMX's s8 x s8 tiles (amx_matmul, where the CPU has them). One serves every
    row count on this CPU (int8_path). Invariant: once built, it holds the weight in that
    path's layout alone (`weight_layouts` == 1; the decoder of Gemma 3 270M is 100 MB of
    int8 once, not twice); another path's layout is made from it on first call (tests,
    benchmarks) and kept beside it.
    """

    def __init__(self, values: torch.Tensor, scale: torch.Tensor) -> None:
        self._scale = scale
        self._path = int8_path()
        self._layouts: dict[str, WeightLayout] = {self._path: _layout(self._path, values, scale)}
        self._kernels: dict[str, Int8Matmul] = {self._path: _kernel(self._path, self._layouts[self._path], scale)}

    @property
    def weight_layouts(self) -> int:
        """How many copies of the weight, one per layout, this linear holds."""
        return len(self._layouts)

    def _kernel_for(self, path: str) -> Int8Matmul:
        if path not in self._kernels:  # a path that does not serve here (tests, benchmarks)
            built = next(iter(self._layouts))  # the layout made at load
            values = _plain_values(built, self._layouts[built])
            self._layouts[path] = _layout(path, values, self._scale)
            self._kernels[path] = _kernel(path, self._layouts[path], self._scale)
        return self._kernels[path]

    def _run(self, path: str, x: torch.Tensor) -> torch.Tensor:
        return self._kernel_for(path)(*QUANTIZERS[path](x))

    @property
    def packed(self) -> Int8Matmul:
        """The packed GEMM on (unsigned activations, their scale)."""
        return self._kernel_for(PACKED)

    @property
    def path(self) -> str:
        """The path that serves every row count here (int8_path)."""
        return self._path

    def quantized(self, path: str, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x W^T from x already quantized for `path` (values as levels_for(path, ...), per-row
        scale): for callers that quantize in one fused kernel with what produced x."""
        return self._kernel_for(path)(values, scale)

    def product(self, path: str, values: torch.Tensor) -> torch.Tensor:
        """`quantized` without the activations' per-row scale, which the caller multiplies in:
        the chain that reads the product does it in the same pass (models/arch/int8_chains.py)."""
        return self._kernel_for(path)(values, None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(self._path, x)

    def general(self, x: torch.Tensor) -> torch.Tensor:
        """oneDNN's packed GEMM on unsigned activations."""
        return self._run(PACKED, x)

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        """torch._int_mm on signed activations and the plain weight."""
        return self._run(PLAIN, x)

    def fbgemm(self, x: torch.Tensor) -> torch.Tensor:
        """fbgemm's GEMM on the levels as float32."""
        return self._run(FBGEMM, x)

    def amx(self, x: torch.Tensor) -> torch.Tensor:
        """AMX's integer tiles on signed activations (int8_amx.c; where the CPU has them)."""
        return self._run(AMX, x)
