"""An int8 x int8 product for CPUs without AMX: int8_quads.c (its comment says how), built
by models/platform/native_build.py, one weight layout for every row count.

Where it serves: the output head (models/layers/head.py) on AVX2 alone, in place of fbgemm's
GEMM, and on AVX512-VNNI without AMX, in place of oneDNN's packed GEMM. fbgemm's packed matrix
is 1.6x the int8 values (a [262144, 640] head packs into 259 MB), and its GEMM reads one
row's head at well under the memory's speed, so a head that served both one stream and
batches held its weights twice (168 MB of values on the i16 path, 259 MB packed for fbgemm).
This kernel reads the one copy at the memory's speed for a row and is faster than fbgemm's
GEMM from 4 rows to 64 (benchmarks/results/head_chunks.md, "One copy"); on VNNI it reads a
row's head in about half of oneDNN's time (head_chunks.md, "VNNI").

Built for AVX512-VNNI (vpdpbusd: u8 x s8 straight into int32) it takes weights of all 127
levels; built for AVX2 alone (vpmaddubsw's int16 pairs) at most NARROW_WEIGHT_LEVELS, as
int8.gemm_weight_levels narrows them there. QuadsKernel.max_level says which.

The product is plain_matmul's (int8.py) bit for bit: exact int32 sums of the activations'
levels times the weight's, times the weight row's float32 scale; the activations' row
scale after it. QuadsKernel.argmax reduces the same products to greedy's tokens as they
come out (chunk_argmax.c's reduction), writing no logits. Checked once against
torch._int_mm on made-up extremes before first use; where it cannot be built or differs,
the head keeps fbgemm's or oneDNN's GEMM (one warning says why).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path
from typing import NamedTuple

import torch

from hybridserve.models.layers.int8 import NARROW_WEIGHT_LEVELS, UINT8_ZERO_POINT, Int8Matmul
from hybridserve.models.layers.span_logits import SPAN, SpanFill
from hybridserve.models.platform.huge_pages import zeros_on_huge_pages
from hybridserve.models.platform.native_build import NativeBuildError, build, checked

SOURCE = Path(__file__).with_name("int8_quads.c")
TILE = 16  # weight rows (output columns) per tile of the layout (int8_quads.c's TILE)
QUAD = 4  # consecutive k of a column side by side
# Rows whose sums fill_quads takes at a time: torch sums int8 into int32 through an int32
# copy of its input, which for a whole head chunk (16384 x 640) would be 40 MB at the load's peak.
_SUM_ROWS = 1024


class QuadsWeight(NamedTuple):
    """int8 weight rows [N, K] (at most the kernel's max_level levels) in int8_quads.c's
    layout: values [N / TILE, K / QUAD, TILE, QUAD]; colsum int32 [N], each row's sum of
    values; scale float32 [N], each row's scale."""

    values: torch.Tensor
    colsum: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        tiles, quads, _, _ = self.values.shape
        return tiles * TILE, quads * QUAD

    def rows(self, start: int, stop: int) -> QuadsWeight:
        """Rows start .. stop (whole tiles) as views: a chunk of the same memory."""
        if start % TILE or stop % TILE or not 0 <= start <= stop <= self.shape[0]:
            raise ValueError(f"rows {start}..{stop} of a quads weight {self.shape} (whole tiles of {TILE})")
        return QuadsWeight(self.values[start // TILE : stop // TILE], self.colsum[start:stop], self.scale[start:stop])


def quads_fit(rows: int, cols: int) -> bool:
    """Whether a [rows, cols] weight has the layout's shape: whole tiles, whole quads."""
    return rows > 0 and cols > 0 and rows % TILE == 0 and cols % QUAD == 0


def zero_quads(rows: int, cols: int) -> QuadsWeight:
    """A [rows, cols] quads weight of zeros (values on huge pages), to be filled a block of
    rows at a time by fill_quads: a weight made in parts, as a head's chunks are, without a
    whole copy beside it."""
    if not quads_fit(rows, cols):
        raise ValueError(f"a quads weight of {rows} x {cols}: rows whole tiles of {TILE}, columns whole quads")
    return QuadsWeight(zeros_on_huge_pages((rows // TILE, cols // QUAD, TILE, QUAD), torch.int8),
                       torch.zeros(rows, dtype=torch.int32), torch.zeros(rows, dtype=torch.float32))


def fill_quads(weight: QuadsWeight, first_row: int, values: torch.Tensor, scale: torch.Tensor,
               max_level: int = NARROW_WEIGHT_LEVELS) -> None:
    """Rows first_row .. of zero_quads' `weight` from int8 `values` [rows, K] of at most
    `max_level` levels (the kernel's: QuadsKernel.max_level) and their float32 `scale` [rows]
    (first_row and rows whole tiles)."""
    rows, cols = values.shape
    if (values.dtype != torch.int8 or cols != weight.shape[1] or first_row % TILE or rows % TILE
            or first_row + rows > weight.shape[0] or scale.shape != (rows,)):
        raise ValueError(f"int8 rows {first_row}..{first_row + rows} of {cols} do not fit quads {weight.shape}")
    if rows and not -max_level <= int(values.min()) <= int(values.max()) <= max_level:
        why = " (int16 pairs must not saturate)" if max_level == NARROW_WEIGHT_LEVELS else ""
        raise ValueError(f"quads weights take at most {max_level} levels{why}")
    weight.values[first_row // TILE : (first_row + rows) // TILE] = (
        values.view(rows // TILE, TILE, cols // QUAD, QUAD).permute(0, 2, 1, 3))
    for start in range(0, rows, _SUM_ROWS):  # the int32 copy a sum makes, a block at a time
        stop = min(start + _SUM_ROWS, rows)
        weight.colsum[first_row + start : first_row + stop] = values[start:stop].sum(dim=1, dtype=torch.int32)
    weight.scale[first_row : first_row + rows] = scale


def pack_quads(values: torch.Tensor, scale: torch.Tensor, max_level: int = NARROW_WEIGHT_LEVELS) -> QuadsWeight:
    """int8 values [N, K] of at most `max_level` levels and float32 scale [N] as one quads weight."""
    weight = zero_quads(*values.shape)
    fill_quads(weight, 0, values, scale, max_level)
    return weight


def unpack_quads(weight: QuadsWeight) -> torch.Tensor:
    """The int8 values [N, K] fill_quads was given."""
    tiles, quads, _, _ = weight.values.shape
    return weight.values.permute(0, 2, 1, 3).reshape(tiles * TILE, quads * QUAD)


class QuadsKernel:
    """(uint8 activations [M, K], levels + 128, unit column stride; a QuadsWeight [N, K])
    -> float32 [M, N]: the exact int32 sums times each weight row's scale. `max_level`: the
    largest |weight level| its build takes (127 with AVX512-VNNI, NARROW_WEIGHT_LEVELS with
    AVX2 alone)."""

    def __init__(self) -> None:
        library = build("int8_quads", SOURCE)
        if not library.quads_available():
            raise NativeBuildError("int8_quads.c was built without AVX2")
        tile = library.quads_tile
        tile.restype = ctypes.c_int32
        if tile() != TILE:
            raise ValueError(f"int8_quads.c's tiles are {tile()} columns, int8_quads.py's {TILE}")
        levels = library.quads_levels
        levels.restype = ctypes.c_int32
        self.max_level = int(levels())
        fn = library.quads_matmul
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr, i64, ctypes.c_int32]
        fn.restype = None
        self._fn = fn
        argmax = library.quads_argmax
        argmax.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr, i64, ptr, ptr, ctypes.c_int32]
        argmax.restype = ctypes.c_int32
        self._argmax = argmax
        span_logits = library.quads_span_logits
        span_logits.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, ctypes.c_float, ptr, i64, ptr, ptr,
                                ctypes.c_int32]
        span_logits.restype = ctypes.c_int32
        self._span_logits = span_logits
        self.fill = SpanFill(library, "quads_fill_span")  # a span of unstored logits (QuadsSpanSource)

    def __call__(self, x: torch.Tensor, weight: QuadsWeight, out: torch.Tensor | None = None) -> torch.Tensor:
        n, k = weight.shape
        rows = _rows_of(x, k)
        if out is None:
            out = torch.empty(rows, n)
        elif out.dtype != torch.float32 or out.shape != (rows, n) or out.stride(1) != 1:
            raise ValueError(f"quads output: float32 [{rows}, {n}] with unit column stride")
        if rows:
            self._fn(x.data_ptr(), x.stride(0), rows, k, weight.values.data_ptr(), weight.colsum.data_ptr(),
                     weight.scale.data_ptr(), n, out.data_ptr(), out.stride(0), torch.get_num_threads())
        return out

    def argmax(self, x: torch.Tensor, weight: QuadsWeight, row_scale: torch.Tensor, start: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(best float32 [rows], index int64 [rows]): each row's largest product times its
        row scale, as __call__'s products times `row_scale` [rows] (float32, every value
        finite) round, and the first column holding it, plus `start`: chunk_argmax's
        reduction of those products, without writing them."""
        n, k = weight.shape
        rows = _rows_of(x, k)
        scale = _per_row(row_scale, rows, "row scale")
        best, index = torch.empty(rows), torch.empty(rows, dtype=torch.int64)
        if rows and self._argmax(x.data_ptr(), x.stride(0), rows, k, weight.values.data_ptr(),
                                 weight.colsum.data_ptr(), weight.scale.data_ptr(), n, scale.data_ptr(), start,
                                 best.data_ptr(), index.data_ptr(), torch.get_num_threads()):
            raise MemoryError(f"int8_quads: no memory for a {rows}-row argmax's scratch")
        return best, index

    def span_logits(self, x: torch.Tensor, weight: QuadsWeight, row_scale: torch.Tensor, inv_t: torch.Tensor,
                    exp_floor: float, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampling's span logits from the product: __call__'s products times `row_scale`
        ([rows] float32: as the eager multiply rounds them) into `out` (float32 [rows, N],
        unit column stride; N whole spans of span_logits.SPAN), and each span's (maximum,
        mass) at its row's inverse temperature inv_t [rows] (float32 [rows, N / SPAN] each):
        span_native's scale_and_summarise of __call__'s output, bit for bit, in one pass.
        With out None the summaries alone, the logits written nowhere (QuadsSpanSource
        computes them again)."""
        n, k = weight.shape
        rows = _rows_of(x, k)
        scale, temperature = _per_row(row_scale, rows, "row scale"), _per_row(inv_t, rows, "inverse temperature")
        if out is not None and (out.dtype != torch.float32 or out.shape != (rows, n) or out.stride(1) != 1):
            raise ValueError(f"quads span logits: float32 [{rows}, {n}] with unit column stride")
        if n % SPAN:
            raise ValueError(f"quads span logits: {n} columns are not whole spans of {SPAN}")
        spans = n // SPAN
        peak, mass = torch.empty(rows, spans), torch.empty(rows, spans)
        if rows and self._span_logits(x.data_ptr(), x.stride(0), rows, k, weight.values.data_ptr(),
                                      weight.colsum.data_ptr(), weight.scale.data_ptr(), n, scale.data_ptr(),
                                      temperature.data_ptr(), exp_floor, None if out is None else out.data_ptr(),
                                      0 if out is None else out.stride(0), peak.data_ptr(), mass.data_ptr(),
                                      torch.get_num_threads()):
            raise MemoryError(f"int8_quads: no memory for a {rows}-row span scratch")
        return peak, mass


class _QuadsSpans(ctypes.Structure):
    """int8_quads.c's QuadsSpans."""

    _fields_ = [("x", ctypes.c_void_p), ("ldx", ctypes.c_int64), ("K", ctypes.c_int64), ("w", ctypes.c_void_p),
                ("colsum", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("N", ctypes.c_int64),
                ("row_scale", ctypes.c_void_p)]


class QuadsSpanSource:
    """The logits QuadsKernel.span_logits summarised without storing (out None), exactly as
    it stores them (span_logits.LogitsSource): all of them by span_logits again, or a span
    at a time by int8_quads.c's quads_fill_span at `fill_address` with `address` (this
    object holds the operands those point into, and must outlive the calls)."""

    def __init__(self, kernel: QuadsKernel, x: torch.Tensor, weight: QuadsWeight, row_scale: torch.Tensor,
                 inv_t: torch.Tensor, exp_floor: float) -> None:
        n, k = weight.shape
        self.rows = _rows_of(x, k)
        self.spans = n // SPAN
        scale = _per_row(row_scale, self.rows, "row scale")
        self._held = (kernel, x, weight, scale, inv_t, exp_floor)
        self._fields = _QuadsSpans(x.data_ptr(), x.stride(0), k, weight.values.data_ptr(), weight.colsum.data_ptr(),
                                   weight.scale.data_ptr(), n, scale.data_ptr())
        self.address: int = ctypes.addressof(self._fields)
        self.fill_address = kernel.fill.address

    def materialize(self, padded: torch.Tensor) -> None:
        kernel, x, weight, scale, inv_t, exp_floor = self._held
        kernel.span_logits(x, weight, scale, inv_t, exp_floor, padded[:, : weight.shape[0]])

    def native(self) -> tuple[int, int]:
        return self.fill_address, self.address

    def span(self, row: int, j: int) -> torch.Tensor:
        """Span j of row `row`, float32 [SPAN], computed in Python's thread."""
        return self._held[0].fill.span(self.address, self.rows, self.spans, row, j)


def _rows_of(x: torch.Tensor, k: int) -> int:
    """The row count of quads activations x: uint8 [rows, k] with unit column stride
    (ValueError otherwise)."""
    if x.dtype != torch.uint8 or x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"quads activations: uint8 [rows, {k}] with unit column stride, not {x.dtype} "
                         f"{tuple(x.shape)}")
    return x.shape[0]


def _per_row(t: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    """t as [rows] float32, one value a row, contiguous (ValueError naming `name` otherwise)."""
    flat = t.reshape(-1)
    if flat.dtype != torch.float32 or flat.shape != (rows,) or not flat.is_contiguous():
        raise ValueError(f"quads {name}: float32 [{rows}], contiguous")
    return flat


@cache
def quads_kernel() -> QuadsKernel | None:
    """The kernel, built and checked against torch._int_mm on first use; None where it
    cannot be built, the CPU lacks AVX2, or it differs (a warning says why)."""
    return checked(QuadsKernel, _mismatch, "the int8 head stays on fbgemm's or oneDNN's GEMM")


def quads_matmul(kernel: QuadsKernel, weight: QuadsWeight) -> Int8Matmul:
    """int8.Int8Matmul's contract on `weight`: (uint8 activations, their row scale or None)
    -> float32 products, the row scale applied after the weight's as plain_matmul does."""

    def matmul(x: torch.Tensor, x_scale: torch.Tensor | None) -> torch.Tensor:
        out = kernel(x, weight)
        return out if x_scale is None else out.mul_(x_scale)

    return matmul


def _mismatch(kernel: QuadsKernel) -> str:
    """'' when the kernel gives torch._int_mm's sums times the scale bit for bit on made-up
    extremes (activation levels -127 and 127 against weights of the kernel's largest levels,
    every row count up to a register block and a remainder, two tiles); else what differs."""
    g = torch.Generator().manual_seed(0)
    rows, n, k, top = 11, 2 * TILE, 64, kernel.max_level
    values = torch.randint(-top, top + 1, (n, k), generator=g, dtype=torch.int8)
    values[0] = top
    values[1] = -top
    levels = torch.randint(-127, 128, (rows, k), generator=g, dtype=torch.int32)
    levels[0], levels[1] = 127, -127
    scale = torch.rand(n, generator=g) + 0.5
    got = kernel((levels + UINT8_ZERO_POINT).to(torch.uint8), pack_quads(values, scale, top))
    want = torch._int_mm(levels.to(torch.int8), values.t()).mul(scale)
    return "" if torch.equal(got, want) else "differs from torch._int_mm's sums times the scale"
