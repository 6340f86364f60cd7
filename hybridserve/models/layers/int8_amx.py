"""int8 x int8 matmuls on AMX's integer tiles: int8.py's `amx` path, where the CPU has
amx_int8 and the kernel (int8_amx.c) is built.

The product is int8.plain_matmul's, bit for bit: int32 sums of the signed activations'
levels times the weight's, each converted to float32 once and multiplied by its row's
scale. What differs is the speed at decode's row counts: the kernel streams the weight once
per call in the order it is stored (on huge pages) and multiplies up to 64 rows per loaded
tile; oneDNN's packed GEMM took 1.4-1.5x as long from 1 to 16 rows
(`python benchmarks/int8_rows.py`, benchmarks/results/int8_kernels.md). Two reductions of
the product run inside the kernel, for the output head (models/layers/head.py):
`argmax_chunks`, each row's maximum and first column over every chunk of the head in one
call (greedy decoding writes no logits), and `span_logits`,
the logits with each span's summary (span_logits.py) computed while they are in L1.

`AmxWeight` holds a weight in the kernel's tiles (`pack`, and `unpack` back to the rows for
the other paths); `AmxKernel` calls the library; `AmxProduct` is one weight's product with
its scale bound (what int8.py's amx path hands out); `amx_kernel()` builds and checks the
kernel once (None where it cannot run here: the other int8 paths serve then).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path
from typing import NamedTuple

import torch

from hybridserve.models.platform.cpu_features import read_cpu_flags
from hybridserve.models.platform.huge_pages import on_huge_pages
from hybridserve.models.layers.span_logits import SpanFill
from hybridserve.models.platform.native_build import build, checked

SOURCE = Path(__file__).with_name("int8_amx.c")
TILE = 16  # output rows of the weight per tile (int8_amx.c's TILE)
SPAN = 128  # outputs per span summary (span_summary.h's SPAN; models/layers/span_logits.SPAN)
K_BLOCK = 64  # int8 inputs per tile row (int8_amx.c's K_BLOCK)
QUAD = 4  # consecutive inputs AMX pairs per column in its B operand


class AmxWeight(NamedTuple):
    """A weight [n, k] of int8 values in int8_amx.c's tiles: `tiles` [N / TILE, K / K_BLOCK,
    K_BLOCK / QUAD, TILE, QUAD] with N, K padded to whole tiles and blocks by zero weights."""

    tiles: torch.Tensor
    n: int
    k: int

    @property
    def padded_k(self) -> int:
        return self.tiles.shape[1] * K_BLOCK


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


def pack(values: torch.Tensor) -> AmxWeight:
    """int8 weight rows [n, k] in the kernel's tiles (a copy; `values` is not kept), on
    transparent huge pages where Linux offers them (a step streams them whole:
    models/platform/huge_pages.py)."""
    if values.dtype != torch.int8 or values.dim() != 2:
        raise ValueError(f"an AMX int8 weight is a 2-d int8 tensor, got {values.dtype} {tuple(values.shape)}")
    n, k = values.shape
    pad_k, pad_n = _round_up(k, K_BLOCK) - k, _round_up(n, TILE) - n
    padded = torch.nn.functional.pad(values, (0, pad_k, 0, pad_n)) if pad_k or pad_n else values.contiguous()
    big_n, big_k = padded.shape
    # [tile, column, block, row, quad] -> [tile, block, row, column, quad]
    tiles = padded.view(big_n // TILE, TILE, big_k // K_BLOCK, K_BLOCK // QUAD, QUAD).permute(0, 2, 3, 1, 4)
    return AmxWeight(on_huge_pages(tiles), n, k)


def unpack(weight: AmxWeight) -> torch.Tensor:
    """The int8 weight rows [n, k] that `weight` holds."""
    tiles = weight.tiles
    rows = tiles.permute(0, 3, 1, 2, 4).reshape(tiles.shape[0] * TILE, weight.padded_k)
    return rows[: weight.n, : weight.k].contiguous()


class AmxKernel:
    """int8_amx.c's matmul: (int8 activations [S, k], the weight's tiles, float32 scale per
    weight row [n], float32 scale per activation row [S, 1] or None) -> float32 [S, n]."""

    def __init__(self) -> None:
        library = build("int8_amx", SOURCE)
        # Built with its AMX code (an x86-64 AVX-512 build), on this CPU, and Linux granted the
        # tile state (kernels before 5.16 do not): else the other int8 paths serve, silently.
        self.ready = bool(library.int8_amx_built()) and "amx_int8" in read_cpu_flags() and bool(
            library.int8_amx_ready())
        fn = library.int8_amx_matmul
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr, i64, ctypes.c_int32]
        fn.restype = ctypes.c_int
        self._fn = fn
        chunks = library.int8_amx_argmax_chunks
        chunks.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int32]
        chunks.restype = ctypes.c_int
        self._argmax_chunks = chunks
        spans = library.int8_amx_span_logits
        spans.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr, i64, ptr, ctypes.c_float, ptr, ptr,
                          ctypes.c_int32]
        spans.restype = ctypes.c_int
        self._span_logits = spans
        # what native samplers call for a span of logits that were summarised, not stored
        self.fill = SpanFill(library, "int8_amx_fill_span")

    def __call__(self, x: torch.Tensor, weight: AmxWeight, scale: torch.Tensor,
                 row_scale: torch.Tensor | None = None) -> torch.Tensor:
        x, scale, row_scale = self._operands(x, weight, scale, row_scale)
        out = torch.empty(x.shape[0], weight.n, dtype=torch.float32)
        failed = self._fn(x.data_ptr(), x.stride(0), x.shape[0], weight.padded_k, weight.tiles.data_ptr(),
                          scale.data_ptr(), None if row_scale is None else row_scale.data_ptr(), weight.n,
                          out.data_ptr(), out.stride(0), torch.get_num_threads())
        if failed:
            raise MemoryError(f"the AMX int8 kernel could not allocate its scratch (code {failed})")
        return out

    def argmax_chunks(self, x: torch.Tensor, products: list[AmxProduct], row_scale: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """(each row's largest output, float32 [S]; the first column holding it, int64 [S]) of
        the product of `products`' weights side by side (each one of this kernel's
        AmxProducts, all of one k, their columns consecutive columns of one product), without
        writing it: one call for every chunk of a head. NaN outputs never win (int8 sums
        times finite scales give none)."""
        if not products:
            raise ValueError("argmax_chunks needs at least one product")
        operands = [self._operands(x, p.weight, p.scale, row_scale) for p in products]
        x, _, row_scale = operands[0]
        rows, count = x.shape[0], len(products)
        tiles = (ctypes.c_void_p * count)(*[p.weight.tiles.data_ptr() for p in products])
        scales = (ctypes.c_void_p * count)(*[scale.data_ptr() for _, scale, _ in operands])
        widths = [p.weight.n for p in products]
        columns = (ctypes.c_int64 * count)(*widths)
        firsts = (ctypes.c_int64 * count)(*[sum(widths[:c]) for c in range(count)])
        best = torch.empty(rows, dtype=torch.float32)
        index = torch.empty(rows, dtype=torch.int64)
        failed = self._argmax_chunks(x.data_ptr(), x.stride(0), rows, products[0].weight.padded_k, count, tiles,
                                     scales, columns, firsts, None if row_scale is None else row_scale.data_ptr(),
                                     best.data_ptr(), index.data_ptr(), torch.get_num_threads())
        if failed == -2:
            raise ValueError(f"AMX argmax over {sum(widths)} columns: past int32, or k not whole blocks")
        if failed:
            raise MemoryError(f"the AMX int8 kernel could not allocate its scratch (code {failed})")
        return best, index

    def span_logits(self, x: torch.Tensor, weight: AmxWeight, scale: torch.Tensor, row_scale: torch.Tensor | None,
                    inv_temperature: torch.Tensor, exp_floor: float, out: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(__call__'s product, float32 [S, n]; and each span of SPAN of its columns summarised
        as models/layers/span_logits.py defines, span_max and span_sum [S, n / SPAN], at
        each row's inverse temperature, float32 [S]) in one pass: the summaries are those
        span_native's kernel gives for the same logits, bit for bit. n must be whole spans.
        `out`: where the product goes (float32 [S, n], unit column stride, any row stride:
        columns of a reused buffer, whose pages are resident; a fresh 8 MB tensor per chunk
        costs a page fault per 4 KB each step), else a new tensor."""
        rows = x.shape[0]
        if out is None:
            out = torch.empty(rows, weight.n, dtype=torch.float32)
        elif out.dtype != torch.float32 or out.shape != (rows, weight.n) or out.stride(1) != 1:
            raise ValueError(f"span logits' output must be float32 [{rows}, {weight.n}] with unit column stride, "
                             f"got {out.dtype} {tuple(out.shape)} strides {tuple(out.stride())}")
        peak, mass = self._spans(x, weight, scale, row_scale, inv_temperature, exp_floor, out)
        return out, peak, mass

    def span_summaries(self, x: torch.Tensor, weight: AmxWeight, scale: torch.Tensor,
                       row_scale: torch.Tensor | None, inv_temperature: torch.Tensor, exp_floor: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """span_logits' span_max and span_sum, bit for bit, without storing the product (at 64
        rows of Gemma 3's vocabulary, 67 MB a step): a sampler that reads a span or two of
        each row has them computed again (AmxSpanSource)."""
        return self._spans(x, weight, scale, row_scale, inv_temperature, exp_floor, None)

    def _spans(self, x: torch.Tensor, weight: AmxWeight, scale: torch.Tensor, row_scale: torch.Tensor | None,
               inv_temperature: torch.Tensor, exp_floor: float, out: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        x, scale, row_scale = self._operands(x, weight, scale, row_scale)
        rows = x.shape[0]
        if weight.n % SPAN:
            raise ValueError(f"span logits need whole spans of {SPAN} columns, not {weight.n}")
        inv_t = inv_temperature.to(torch.float32).contiguous()
        if inv_t.shape != (rows,):
            raise ValueError(f"the inverse temperatures must be [{rows}], got {tuple(inv_t.shape)}")
        peak = torch.empty(rows, weight.n // SPAN, dtype=torch.float32)
        mass = torch.empty(rows, weight.n // SPAN, dtype=torch.float32)
        failed = self._span_logits(x.data_ptr(), x.stride(0), rows, weight.padded_k, weight.tiles.data_ptr(),
                                   scale.data_ptr(), None if row_scale is None else row_scale.data_ptr(), weight.n,
                                   None if out is None else out.data_ptr(), 0 if out is None else out.stride(0),
                                   inv_t.data_ptr(), exp_floor, peak.data_ptr(), mass.data_ptr(),
                                   torch.get_num_threads())
        if failed:
            raise MemoryError(f"the AMX int8 kernel could not allocate its scratch (code {failed})")
        return peak, mass

    def _operands(self, x: torch.Tensor, weight: AmxWeight, scale: torch.Tensor, row_scale: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The inputs as the kernel reads them (checked; k and the scale padded to whole blocks)."""
        if x.dtype != torch.int8 or x.dim() != 2 or x.shape[1] != weight.k:
            raise ValueError(f"AMX int8 input must be int8 [rows, {weight.k}], got {x.dtype} {tuple(x.shape)}")
        if scale.dtype != torch.float32 or scale.shape != (weight.n,):
            raise ValueError(f"AMX int8 scale must be float32 [{weight.n}]")
        rows = x.shape[0]
        if row_scale is not None:
            if row_scale.dtype != torch.float32 or row_scale.numel() != rows:
                raise ValueError(f"AMX int8 row scale must be float32 [{rows}, 1]")
            row_scale = row_scale.contiguous()
        if weight.padded_k != weight.k:  # the kernel reads whole blocks of k: zero-padded rows
            x = torch.nn.functional.pad(x, (0, weight.padded_k - weight.k))
        elif x.stride(1) != 1:
            x = x.contiguous()
        if weight.n % TILE:  # the kernel reads a scale for each padded column (masked, never stored)
            scale = torch.nn.functional.pad(scale, (0, TILE - weight.n % TILE))
        return x, scale, row_scale


class AmxProduct:
    """One weight's product on the kernel, its scale bound: called, int8.Int8Matmul's
    contract ((int8 activations, their row scale or None) -> float32 [S, n]); `span_logits`
    and `span_summaries` the kernel's reductions of the same product (the kernel's
    `argmax_chunks` takes a head's products together: models/layers/head.py)."""

    def __init__(self, kernel: AmxKernel, weight: AmxWeight, scale: torch.Tensor) -> None:
        self.kernel, self.weight, self.scale = kernel, weight, scale

    def __call__(self, x: torch.Tensor, x_scale: torch.Tensor | None) -> torch.Tensor:
        return self.kernel(x, self.weight, self.scale, x_scale)

    def span_logits(self, x: torch.Tensor, x_scale: torch.Tensor | None, inv_temperature: torch.Tensor,
                    exp_floor: float, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.kernel.span_logits(x, self.weight, self.scale, x_scale, inv_temperature, exp_floor, out=out)

    def span_summaries(self, x: torch.Tensor, x_scale: torch.Tensor | None, inv_temperature: torch.Tensor,
                       exp_floor: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernel.span_summaries(x, self.weight, self.scale, x_scale, inv_temperature, exp_floor)


class _SourceFields(ctypes.Structure):
    """int8_amx.c's SpanSource."""

    _fields_ = [("x", ctypes.c_void_p), ("ldx", ctypes.c_int64), ("K", ctypes.c_int64),
                ("row_scale", ctypes.c_void_p), ("chunks", ctypes.c_int64), ("w", ctypes.c_void_p),
                ("scale", ctypes.c_void_p), ("first_span", ctypes.c_void_p)]


class AmxSpanSource:
    """The logits of products summarised without being stored (span_summaries), a span at a
    time: chunks[c] holds the columns after those of chunks[:c] (each whole spans, all of
    one k), x and x_scale the activations they were given. `span(row, j)` computes span j
    of a row in Python's thread; native code calls int8_amx_fill_span at `fill_address` with
    `address` (this object must outlive those calls). Bit for bit the values span_logits
    stores (int8_amx.c)."""

    def __init__(self, chunks: list[AmxProduct], x: torch.Tensor, x_scale: torch.Tensor | None) -> None:
        first = chunks[0]
        if any(c.kernel is not first.kernel or c.weight.k != first.weight.k or c.weight.n % SPAN for c in chunks):
            raise ValueError("a span source's chunks share one kernel and k, each whole spans")
        self.kernel = first.kernel
        x, _, x_scale = self.kernel._operands(x, first.weight, first.scale, x_scale)
        self.rows = x.shape[0]
        scales = [c.scale.contiguous() for c in chunks]
        self._held = (x, x_scale, chunks, scales)  # what the pointers below point into
        self._w = (ctypes.c_void_p * len(chunks))(*(c.weight.tiles.data_ptr() for c in chunks))
        self._scale = (ctypes.c_void_p * len(chunks))(*(scale.data_ptr() for scale in scales))
        self._first = (ctypes.c_int64 * (len(chunks) + 1))(0)
        for c, chunk in enumerate(chunks):
            self._first[c + 1] = self._first[c] + chunk.weight.n // SPAN
        self.spans = self._first[len(chunks)]
        self._fields = _SourceFields(x.data_ptr(), x.stride(0), first.weight.padded_k,
                                     None if x_scale is None else x_scale.data_ptr(), len(chunks),
                                     ctypes.cast(self._w, ctypes.c_void_p), ctypes.cast(self._scale, ctypes.c_void_p),
                                     ctypes.cast(self._first, ctypes.c_void_p))
        self.address: int = ctypes.addressof(self._fields)
        self.fill_address = self.kernel.fill.address

    def span(self, row: int, j: int) -> torch.Tensor:
        """Span j of row `row`, float32 [SPAN]."""
        return self.kernel.fill.span(self.address, self.rows, self.spans, row, j)


def _plain_product(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor
                   ) -> torch.Tensor:
    """What the kernel must give: int8.plain_matmul's product (torch._int_mm), without
    importing int8.py (which imports this module)."""
    return torch._int_mm(x, values.t()).mul(scale).mul_(row_scale)


def _mismatch(kernel: AmxKernel) -> str:
    """'' when the kernel gives torch._int_mm's product bit for bit on shapes that cross every
    padding and row tile boundary (including values of +-127 whose sums leave 24 bits), and
    its argmax and span summaries agree with torch's, else what differs ('' unchecked where
    the kernel cannot run)."""
    if not kernel.ready:
        return ""
    generator = torch.Generator().manual_seed(0)
    for rows, n, k in ((1, 48, 64), (17, 40, 200), (70, 256, 128), (33, 100, 640), (20, 384, 640)):
        values = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
        values[0] = 127
        x = torch.randint(-127, 128, (rows, k), dtype=torch.int8, generator=generator)
        x[0] = 127
        scale = torch.rand(n, generator=generator) + 0.5
        row_scale = torch.rand(rows, 1, generator=generator) + 0.5
        expected = _plain_product(x, values, scale, row_scale)
        got = kernel(x, pack(values), scale, row_scale)
        if not torch.equal(got, expected):
            return f"differs from torch._int_mm at {rows} x {n} x {k}"
        cut = n // 3  # two chunks, the first not whole tiles
        halves = [AmxProduct(kernel, pack(values[:cut]), scale[:cut]), AmxProduct(kernel, pack(values[cut:]), scale[cut:])]
        best, index = kernel.argmax_chunks(x, halves, row_scale)
        top = expected.max(dim=1)
        if not (torch.equal(best, top.values) and torch.equal(index, top.indices)):
            return f"its argmax differs from torch's at {rows} x {n} x {k}"
        if n % SPAN == 0:
            logits, peak, mass = kernel.span_logits(x, pack(values), scale, row_scale, torch.ones(rows), -87.0)
            spans = expected.view(rows, -1, SPAN)
            reference_mass = torch.exp(spans - spans.amax(dim=-1, keepdim=True)).sum(dim=-1)
            if not (torch.equal(logits, expected) and torch.equal(peak, spans.amax(dim=-1))
                    and torch.allclose(mass, reference_mass, rtol=1e-5, atol=0.0)):
                return f"its span logits differ from torch's at {rows} x {n} x {k}"
            summaries = kernel.span_summaries(x, pack(values), scale, row_scale, torch.ones(rows), -87.0)
            if not (torch.equal(summaries[0], peak) and torch.equal(summaries[1], mass)):
                return f"its span summaries alone differ from those beside the logits at {rows} x {n} x {k}"
            source = AmxSpanSource([AmxProduct(kernel, pack(values), scale)], x, row_scale)
            for r, j in ((0, 0), (rows - 1, n // SPAN - 1), (rows // 2, n // SPAN // 2)):
                if not torch.equal(source.span(r, j), spans[r, j]):
                    return f"a span computed again differs from the stored one at {rows} x {n} x {k}"
    return ""


@cache
def amx_kernel() -> AmxKernel | None:
    """The kernel, built and checked on first use; None where it cannot run here (no AMX,
    no compiler, or a result that differs), and the other int8 paths serve."""
    if "amx_int8" not in read_cpu_flags():
        return None
    kernel = checked(AmxKernel, _mismatch, "int8 matmuls take oneDNN's packed GEMM")
    return kernel if kernel is not None and kernel.ready else None
