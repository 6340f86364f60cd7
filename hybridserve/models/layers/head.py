"""The output head (hidden -> vocab logits): dense, int8 per channel or int4 group-wise.

With a large vocabulary the head is most of the model (Gemma 3 270M: 168M of 270M
parameters) and its bytes set the decode speed, so it gets its own representations:

- "none": the weight in the model dtype, oneDNN-packed (see linear.py) in chunks of
  vocabulary rows (OutputHead.chunk_rows). Packing chunk by chunk, and handing each
  chunk's source rows back to `release_rows` once packed, keeps the peak at one packed
  copy plus one chunk: the tied embedding stays a mapped view of the checkpoint whose
  rows are read only for the tokens looked up.
- "int8": one int8 per weight and one scale per vocabulary row (symmetric, round to
  nearest). The quantizer hands each block of source rows back to `release_rows` as soon
  as it has read it, so a chunk's bf16 source is never all resident beside its int8
  values and packed copy (the load's peak). On an x86 CPU with int8 dot products (VNNI / AMX-INT8) or AVX2 the hidden
  states are quantized too, per row (symmetric, 127 levels), and an int8 GEMM multiplies
  them (with AMX's integer tiles int8_amx.c, which also reduces each chunk to greedy's
  argmax or to sampling's span summaries as it goes; else int8_quads.c's u8 x s8
  products, by VNNI's dot products or, on AVX2 alone, with the weights narrowed to 63
  levels, which also reduces a greedy step to its argmax as it goes; where that kernel
  is not built, oneDNN's `onednn.qlinear_pointwise` (VNNI) or fbgemm's GEMM (AVX2):
  models/layers/int8.py, int8_quads.py): at a decode
  batch of 64 the head is compute-bound, and the int8 dot products run several times
  faster than bf16 ones without AMX (`benchmarks/int8_rows.py`). Elsewhere PyTorch's
  weight-only int8 kernel (`_weight_int8pack_mm`) multiplies bfloat16 activations.
- "int4": unsigned 4-bit values in groups of INT4_GROUP_SIZE along the hidden dimension,
  each group with its own scale and offset (asymmetric min/max), packed for PyTorch's CPU
  int4 kernel (`_weight_int4pack_mm_for_cpu`).

The weight-only kernels take bfloat16 activations; a float32 model's hidden states are
rounded to bfloat16 for them. The logits come back in the model dtype.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch

from hybridserve.core.errors import ConfigError
from hybridserve.models.layers.chunk_argmax import ChunkArgmax, chunk_argmax_kernel
from hybridserve.models.layers import int8
from hybridserve.models.layers.int8 import (FBGEMM, PACKED, QUANTIZERS, BlockDone, int8_gemm_available,
                                           int8_matmul, int8_path, quantize_gemm_weight, quantize_int8_rows,
                                           quantize_rows_uint8)
from hybridserve.models.layers.int8_amx import AmxProduct, AmxSpanSource
from hybridserve.models.layers.int8_quads import TILE as QUADS_TILE
from hybridserve.models.layers.int8_quads import (QuadsKernel, QuadsSpanSource, QuadsWeight, fill_quads, quads_fit,
                                                 quads_kernel, quads_matmul, unpack_quads, zero_quads)
from hybridserve.models.layers.linear import make_linear
from hybridserve.models.layers.row_levels import row_levels_kernel
from hybridserve.models.layers.span_kernel import KERNEL
from hybridserve.models.layers.span_logits import EXP_FLOOR, SPAN, LogitsBuffer, SpanLogits, padded_width
from hybridserve.models.platform.cpu_features import GGUF_GROUPS
from hybridserve.models.platform.heap import release_free_heap

# Vocabulary rows per packed / quantized chunk: small enough that one chunk's logits stay
# in a core's L2 for the argmax ([16, 32768] float32 is 2 MB) and packing one adds little
# to the load's peak memory, large enough that the GEMM streams its weight at full speed
# (`benchmarks/head_chunks.py`; benchmarks/results/head_chunks.md).
HEAD_CHUNK_ROWS = 32768
# Vocabulary rows per chunk on fbgemm's int8 path (AVX2 alone, models/layers/int8.int8_path):
# there [64, 32768] float32 logits (8 MB) fall out of cache before the argmax reads them, so
# 32768 loses at 64 rows, while each chunk's call costs its own fixed time, which smaller
# chunks repeat (`python benchmarks/head_chunks.py --isa avx2`; benchmarks/results/head_chunks.md).
FBGEMM_HEAD_CHUNK_ROWS = 16384
# Vocabulary rows per chunk of a head on int8_quads.c's kernel: as fbgemm's, and on VNNI
# 16384 was as fast as 32768 or faster at 1, 16 and 64 rows (`python benchmarks/head_chunks.py
# --chunks 16384,32768 --rows 1,16,64`; benchmarks/results/head_chunks.md, "VNNI").
QUADS_HEAD_CHUNK_ROWS = 16384
# Columns per span of row_max's first pass: short enough that searching the winning span
# again costs little, long enough that the span maxima are few.
ARGMAX_SPAN = 128
# Up to this many rows span_logits summarises its whole buffer at once, and greedy reduces
# whole rows once, not chunk by chunk.
FEW_ROWS = 4
# Up to this many rows a head on int8_quads.c's kernel (AVX2 alone or VNNI) multiplies the whole
# vocabulary in one call, a few rows' logits then reduced at once; more rows go chunk by
# chunk, each reduced while in cache (benchmarks/results/head_chunks.md, "one copy").
QUADS_WHOLE_MAX_ROWS = 8
# On oneDNN's path (VNNI without AMX), up to this many rows multiply on int8_quads.c's kernel
# (about half of oneDNN's time at one row, alike at 16); more rows on oneDNN's packed chunks,
# packed from the quads' values at the first such step, a second copy that only batches that
# large pay for: there oneDNN's GEMM took 0.75-0.85x the kernel's time
# (benchmarks/results/head_chunks.md, "VNNI").
QUADS_BESIDE_PACKED_MAX_ROWS = 16
INT4_GROUP_SIZE = 32  # hidden-dim weights sharing one int4 scale and offset (as GGUF's Q4_K sub-blocks)
INT4_LAYERS = "q4"  # --quantization: the decoder's linears as int4 groups (models/layers/int4.py)
# --quantization: the decoder's linears as the GGUF's own int8 groups (models/layers/int8_groups.py)
GROUP_LAYERS = GGUF_GROUPS
_INT4_LEVELS = 15  # largest 4-bit value
_INT4_MIDPOINT = 8  # the kernel subtracts this from each 4-bit value before scaling

ReleaseRows = Callable[[int, int], None]
# What a head's chunks take: the hidden states as the kernel wants them, and the per-row
# scale of quantized activations (None: not quantized).
HeadInput = tuple[torch.Tensor, "torch.Tensor | None"]


def quantize_int4_groups(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values 0..15 as int32 [N, K], scale [N, K/g], offset [N, K/g]) with
    weight ~= (values - 8) * scale + offset, per group of `group_size` columns."""
    n, k = weight.shape
    if k % group_size:
        raise ConfigError(f"int4 quantization needs the hidden size ({k}) to be a multiple of {group_size}")
    w = weight.float().view(n, k // group_size, group_size)
    low = w.amin(dim=-1, keepdim=True)
    scale = ((w.amax(dim=-1, keepdim=True) - low) / _INT4_LEVELS).clamp(min=torch.finfo(torch.float32).tiny)
    values = torch.round((w - low) / scale).clamp(0, _INT4_LEVELS).to(torch.int32).view(n, k)
    offset = low + _INT4_MIDPOINT * scale  # so that (values - 8) * scale + offset == values * scale + low
    return values, scale.view(n, -1), offset.view(n, -1)


def dequantize_int4_groups(values: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The float32 weight that int4 (values, scale, offset) stands for."""
    n, k = values.shape
    groups = scale.shape[1]
    grouped = (values.float().view(n, groups, -1) - _INT4_MIDPOINT) * scale[..., None] + offset[..., None]
    return grouped.view(n, k)


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, first index of the max) of each row of x [S, C], as `x.max(dim=-1)`, in two
    passes that vectorise: the maxima of spans of ARGMAX_SPAN columns (amax), then the
    first span holding the row's maximum, searched again. torch's fused value-and-index
    reduction (`max(dim)`, `argmax`) does not vectorise on CPU; `amax` does, about ten
    times faster (`benchmarks/head_chunks.py` times the greedy pass). Ties go to the first
    index: the first span with the maximum holds it, and `max(dim)` returns the first
    index within it. The general path (`max(dim)`) takes rows whose
    length is not a multiple of the span."""
    rows, cols = x.shape
    if cols % ARGMAX_SPAN:
        best = x.max(dim=-1)
        return best.values, best.indices
    spans = x.view(rows, cols // ARGMAX_SPAN, ARGMAX_SPAN)
    span_max, span = spans.amax(dim=-1).max(dim=-1)
    within = spans[torch.arange(rows, device=x.device), span].max(dim=-1).indices
    return span_max, span * ARGMAX_SPAN + within


def head_quantization(quantization: str) -> str:
    """The head's representation under a model-wide --quantization: "int8" (every linear),
    "int8-head" (the head only), INT4_LAYERS (the decoder's linears in int4; the head,
    a Q8_0 tensor in the default GGUF, keeps int8's accuracy) and GROUP_LAYERS (the
    decoder's linears as the GGUF's groups; the head as int8-head makes it) all quantize
    the head to int8."""
    return "int8" if quantization in ("int8-head", INT4_LAYERS, GROUP_LAYERS) else quantization


def _first_chunk_max(values: list[torch.Tensor], indices: list[torch.Tensor]) -> list[int]:
    """Each row's token from its chunks' (max, vocabulary index of the first max), chunks in
    vocabulary order: the first chunk holding the row's maximum, as one argmax over the
    whole row picks."""
    if len(values) == 1:
        return indices[0].tolist()
    winner = torch.stack(values, dim=1).max(dim=1).indices  # first chunk holding the maximum
    return torch.stack(indices, dim=1).gather(1, winner[:, None]).squeeze(1).tolist()


def _shifted(release_rows: ReleaseRows, offset: int, start: int, stop: int) -> None:
    """release_rows of a chunk's rows [start, stop), the chunk starting at row `offset`."""
    release_rows(offset + start, offset + stop)


def _quads_head(weight: torch.Tensor) -> tuple[QuadsKernel, QuadsWeight] | None:
    """(int8_quads.c's kernel, a zero quads weight of `weight`'s shape to fill chunk by chunk)
    where an int8 x int8 head on fbgemm's or oneDNN's path can take it instead: the kernel
    built, taking the weights' levels (int8.gemm_weight_levels: 127 with VNNI, 63 on AVX2
    alone), and the shape whole tiles and quads; else None (fbgemm's or oneDNN's chunks)."""
    n, k = weight.shape
    if weight.device.type != "cpu" or not quads_fit(n, k):
        return None
    kernel = quads_kernel()
    if kernel is None or int8.gemm_weight_levels() > kernel.max_level:
        return None
    return kernel, zero_quads(n, k)


class OutputHead:
    """hidden [S, K] -> logits [S, N] in the model dtype, from per-chunk kernels."""

    def __init__(self, weight: torch.Tensor, quantization: str, release_rows: ReleaseRows | None = None,
                 chunk_rows: int | None = None, column_factors: torch.Tensor | None = None) -> None:
        """`chunk_rows`: vocabulary rows per chunk (default: HEAD_CHUNK_ROWS, or
        QUADS_HEAD_CHUNK_ROWS on int8_quads.c's kernel, FBGEMM_HEAD_CHUNK_ROWS on fbgemm's).
        `column_factors`: the smoothing of
        an int8 x int8 head (models/layers/smoothing.py: what produces the input has divided
        it by them), multiplied into the weight's columns before they are quantized."""
        self.out_dtype = weight.dtype
        self.quantization = quantization
        self.vocab_size = weight.shape[0]
        self._int8_activations = quantization == "int8" and weight.device.type == "cpu" and int8_gemm_available()
        if column_factors is not None and not self._int8_activations:
            raise ConfigError("column factors (smoothing) apply to an int8 x int8 head only")
        self._column_factors = column_factors
        # The decoder's int8 path (models/layers/int8.int8_path), one for every row count:
        # the head's weights are held once.
        self._int8_path = int8_path()
        # On fbgemm's or oneDNN's path, int8_quads.c's kernel where it is built: the whole
        # vocabulary in one weight that every row count reads (chunks are views of it),
        # instead of packed chunks (int8_quads.py says why)
        on_quads_path = self._int8_activations and self._int8_path in (FBGEMM, PACKED)
        whole_tiles = (chunk_rows or QUADS_TILE) % QUADS_TILE == 0
        self._quads = _quads_head(weight) if on_quads_path and whole_tiles else None
        on_fbgemm = self._int8_activations and self._int8_path == FBGEMM
        self.chunk_rows = chunk_rows or (QUADS_HEAD_CHUNK_ROWS if self._quads is not None
                                         else FBGEMM_HEAD_CHUNK_ROWS if on_fbgemm else HEAD_CHUNK_ROWS)
        self._chunks: list[Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]] = []
        # oneDNN's packed chunks beside a quads head on its path, for steps of more than
        # QUADS_BESIDE_PACKED_MAX_ROWS rows: packed at the first such step (_chunks_for)
        self._packed_chunks: list[Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]] | None = None
        self._logits_buffer = LogitsBuffer(self.vocab_size)
        for start in range(0, self.vocab_size, self.chunk_rows):
            stop = min(start + self.chunk_rows, self.vocab_size)
            # A quantized chunk gives back each block of source rows once it is read (the
            # chunk's source pages are not all resident beside its int8 values and packed copy).
            block_done = None if release_rows is None else partial(_shifted, release_rows, start)
            kernel, reads_source = self._chunk_kernel(weight[start:stop], block_done, start)
            self._chunks.append(kernel)
            if release_rows is not None and not reads_source:
                release_rows(start, stop)
            # The chunk's unpacked values and temporaries are freed now, but glibc keeps
            # such holes resident in the heap: without this the default model's int8 head
            # cost 20 MB of RSS per 10 MB chunk (see models/platform/heap.py).
            release_free_heap()
        # Where every chunk's kernel is the AMX int8 one, its fused reductions (greedy_fused,
        # span_logits' fused pieces); else None.
        fused = [chunk for chunk in self._chunks if isinstance(chunk, AmxProduct)]
        self._fused: list[AmxProduct] | None = fused if len(fused) == len(self._chunks) else None

    def _chunk_kernel(self, w: torch.Tensor, block_done: BlockDone | None, first_row: int
                      ) -> tuple[Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor], bool]:
        """(the matmul of one chunk of rows, vocabulary rows first_row.., whether it still
        reads `w` itself); the int8 quantizers call `block_done` for each block of `w`'s
        rows they are done with. On int8_quads.c's kernel the chunk's int8 values fill its
        rows of the whole weight, and its product reads them there."""
        if self.quantization == "int8":
            if self._int8_activations:
                values, scale = quantize_gemm_weight(w, block_done, self._column_factors)
                if self._quads is not None:
                    kernel, whole = self._quads
                    fill_quads(whole, first_row, values, scale, kernel.max_level)
                    return quads_matmul(kernel, whole.rows(first_row, first_row + values.shape[0])), False
                return int8_matmul(self._int8_path, values, scale), False
            values, scale = quantize_int8_rows(w, block_done=block_done)
            scale_bf16 = scale.to(torch.bfloat16)
            return (lambda x, _: torch._weight_int8pack_mm(x, values, scale_bf16)), False
        if self.quantization == "int4":
            values, scale, offset = quantize_int4_groups(w)
            group_size = w.shape[1] // scale.shape[1]
            packed_values = torch._convert_weight_to_int4pack_for_cpu(values, 1)
            scale_offset = torch.stack([scale.t(), offset.t()], dim=-1).contiguous().to(torch.bfloat16)
            return (lambda x, _: torch._weight_int4pack_mm_for_cpu(x, packed_values, group_size, scale_offset)), False
        if self.quantization != "none":
            raise ConfigError(f"unknown head quantization {self.quantization!r}; use none, int8 or int4")
        # Packed where that pays (bf16 as float32 on CPUs without native bf16), else the plain
        # weight is the kernel's input and must stay.
        linear, _, packed = make_linear(w, None)
        return (lambda x, _: linear(x)), not packed

    def _input(self, hidden: torch.Tensor) -> HeadInput:
        """The chunks' input, made once per call (quantizing per chunk would repeat it)."""
        x = hidden.contiguous()
        if self.quantization == "none":
            return x, None
        if self.quantization == "int8" and self._int8_activations:
            if self._quads is None:
                return QUANTIZERS[self._int8_path](x)
            levels = self._quads_levels(x)
            return levels if levels is not None else quantize_rows_uint8(x)
        return x.to(torch.bfloat16), None

    @staticmethod
    def _quads_levels(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """quantize_rows_uint8(x), the quads head's input: by row_levels.c where it is built
        (one call, the same bits), else eagerly; None where a value of x is not finite."""
        native = row_levels_kernel()
        if native is not None and native.supports(x):
            return native(x)
        values, scale = quantize_rows_uint8(x)
        return (values, scale) if bool(torch.isfinite(scale).all()) else None

    def _chunks_for(self, rows: int) -> list[Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]]:
        """The chunks' products for a step of `rows` rows: the head's own chunks, or beside a
        quads head on oneDNN's path, above QUADS_BESIDE_PACKED_MAX_ROWS rows, oneDNN's packed
        chunks of the same rows and values (packed at the first such step): the same
        products, as plain_matmul's, bit for bit."""
        if self._quads is None or self._int8_path != PACKED or rows <= QUADS_BESIDE_PACKED_MAX_ROWS:
            return self._chunks
        if self._packed_chunks is None:
            _, whole = self._quads
            self._packed_chunks = []
            for start in range(0, self.vocab_size, self.chunk_rows):
                rows_of = whole.rows(start, min(start + self.chunk_rows, self.vocab_size))
                self._packed_chunks.append(int8_matmul(PACKED, unpack_quads(rows_of).contiguous(), rows_of.scale))
            release_free_heap()  # the unpacked values' holes (models/platform/heap.py)
        return self._packed_chunks

    def _products(self, hidden: torch.Tensor
                  ) -> tuple[list[Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]], HeadInput]:
        """The chunks' products for `hidden` and their input: up to QUADS_WHOLE_MAX_ROWS rows
        of a head on int8_quads.c's kernel one product of the whole vocabulary (the same
        values as its chunks'), else the chunks (_chunks_for)."""
        if self._quads is not None and hidden.shape[0] <= QUADS_WHOLE_MAX_ROWS:
            return [quads_matmul(*self._quads)], self._input(hidden)
        return self._chunks_for(hidden.shape[0]), self._input(hidden)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        chunks, x = self._products(hidden)
        if len(chunks) == 1:
            return chunks[0](*x).to(self.out_dtype)
        return torch.cat([chunk(*x) for chunk in chunks], dim=1).to(self.out_dtype)

    def greedy(self, hidden: torch.Tensor, softcap: float | None) -> list[int]:
        """argmax of each row's logits (the first index among equal maxima, as argmax):
        greedy_by_chunks, the general path, or up to FEW_ROWS rows (QUADS_WHOLE_MAX_ROWS on
        int8_quads.c's kernel) greedy_few_rows; where
        every chunk's kernel has its own argmax and nothing is soft-capped, greedy_fused;
        on int8_quads.c's kernel with nothing soft-capped, greedy_quads; else, where nothing
        is soft-capped and chunk_argmax.c is built, greedy_native."""
        if self._fused is not None and not softcap:
            return self.greedy_fused(hidden)
        if self._quads is not None and not softcap:
            tokens = self.greedy_quads(hidden)
            if tokens is not None:
                return tokens
        if hidden.shape[0] <= (FEW_ROWS if self._quads is None else max(FEW_ROWS, QUADS_WHOLE_MAX_ROWS)):
            return self.greedy_few_rows(hidden, softcap)
        kernel = None if softcap else chunk_argmax_kernel()
        return self.greedy_by_chunks(hidden, softcap) if kernel is None else self.greedy_native(hidden, kernel)

    def greedy_by_chunks(self, hidden: torch.Tensor, softcap: float | None) -> list[int]:
        """greedy's tokens without building the full logits: each chunk reduces to its (max,
        index) while it is in cache, through row_max (first maximal index, as argmax)."""
        x = self._input(hidden)
        values, indices = [], []
        for start, chunk in zip(range(0, self.vocab_size, self.chunk_rows), self._chunks_for(hidden.shape[0])):
            out = chunk(*x)
            if softcap:  # as logits(): tanh can make distinct logits equal, so argmax must see it
                out = torch.tanh(out.to(self.out_dtype) / softcap) * softcap
            best, index = row_max(out)
            values.append(best.float())
            indices.append(index + start)
        return _first_chunk_max(values, indices)

    def greedy_native(self, hidden: torch.Tensor, kernel: ChunkArgmax) -> list[int]:
        """greedy_by_chunks' tokens (no softcap), each float32 chunk reduced by `kernel` in one
        call (chunk_argmax.c: the max of its products times the row scale and the first
        index, which row_max gives for the scaled chunk) instead of row_max's eager ops, into
        one [chunks, rows] pair merged once; a chunk of another dtype takes row_max."""
        values, row_scale = self._input(hidden)
        rows = values.shape[0]
        chunks = self._chunks_for(rows)
        best = torch.empty(len(chunks), rows)
        index = torch.empty(len(chunks), rows, dtype=torch.int64)
        for c, (start, chunk) in enumerate(zip(range(0, self.vocab_size, self.chunk_rows), chunks)):
            out = chunk(values, None)
            if kernel.supports(out):
                kernel(out, row_scale, start, best[c], index[c])
                continue
            peak, first = row_max(out if row_scale is None else out.mul_(row_scale))
            best[c], index[c] = peak, first + start
        winner = best.max(dim=0).indices  # the first chunk holding each row's maximum
        return index.gather(0, winner[None]).squeeze(0).tolist()

    def greedy_fused(self, hidden: torch.Tensor) -> list[int]:
        """greedy_by_chunks' tokens from the AMX kernel's argmax (int8.py's amx path), which
        writes no logits: the first column holding each row's maximum of the same values the
        chunks' matmuls give, over every chunk in one call (the first chunk holding the
        maximum, as greedy_by_chunks merges them)."""
        assert self._fused is not None
        values, row_scale = self._input(hidden)
        return self._fused[0].kernel.argmax_chunks(values, self._fused, row_scale)[1].tolist()

    def greedy_quads(self, hidden: torch.Tensor) -> list[int] | None:
        """greedy_native's tokens from int8_quads.c's argmax (QuadsKernel.argmax: the same
        products times the same row scales, the first column among equal maxima) over the
        whole vocabulary in one call, which writes no logits: a step's [rows, vocab] float32
        no longer goes through memory and back (64 MB at 64 rows), and no oneDNN copy of
        the weights is packed for greedy steps of more than QUADS_BESIDE_PACKED_MAX_ROWS rows.
        None where a row scale is not finite (a NaN or inf hidden state): the other paths
        order NaN logits as torch's max does."""
        assert self._quads is not None and self.quantization == "int8" and self._int8_activations
        levels = self._quads_levels(hidden.contiguous())
        if levels is None:
            return None
        values, row_scale = levels
        kernel, whole = self._quads
        return kernel.argmax(values, whole, row_scale)[1].tolist()

    def greedy_few_rows(self, hidden: torch.Tensor, softcap: float | None) -> list[int]:
        """greedy_by_chunks' tokens, for a few rows (one stream's decode step): every chunk's
        product first, then one row_max over the whole rows (at one row 1 MB of float32, still in
        cache). Each chunk's product streams its weights through the caches, so the small
        ops after it find their code and data evicted (tens of microseconds each, against a
        few on warm caches); reducing once instead of per chunk runs those ops once. The
        same token: row_max takes the first maximal index of the whole row, as the first
        chunk holding the maximum and the first index within it. Where nothing is soft-capped
        and chunk_argmax.c is built, it reduces the float32 rows in one pass (row_max's eager
        ops over one stream's 1 MB of logits took ~1 ms of a 13 ms AVX2 step), the row scale
        applied as the eager multiply rounds it: the same token again."""
        chunks, (values, row_scale) = self._products(hidden)
        # int8 activations' row scale applied once to the whole rows: the same products
        products = [chunk(values, None) for chunk in chunks]
        out = products[0] if len(products) == 1 else torch.cat(products, dim=1)
        kernel = None if softcap else chunk_argmax_kernel()
        if kernel is not None and kernel.supports(out):
            best, index = torch.empty(out.shape[0]), torch.empty(out.shape[0], dtype=torch.int64)
            kernel(out, row_scale, 0, best, index)
            return index.tolist()
        if row_scale is not None:
            out.mul_(row_scale)
        if softcap:
            out = torch.tanh(out.to(self.out_dtype) / softcap) * softcap
        return row_max(out)[1].tolist()

    def span_logits(self, hidden: torch.Tensor, inv_temperature: torch.Tensor, softcap: float | None,
                    stored: bool = True) -> SpanLogits:
        """The logits as the chunks' kernels compute them (int8 kernels: float32; __call__
        rounds them to the model dtype, which sampling has no use for), soft-capped in
        float32, with their span summaries (models/layers/span_logits.py). Above FEW_ROWS rows,
        each chunk is summarised while it is still in cache (one pass over the vocabulary,
        as greedy() makes) and kept as a piece of the logits, the last one padded to whole
        spans: nothing copies the whole vocabulary. A few rows' logits are copied into the
        reused buffer and summarised at once (they stay in cache anyway, and one summary
        costs fewer parallel regions than one per chunk), as are chunks that are not whole
        spans. Where every chunk's kernel summarises its own spans: _span_logits_fused, which
        with `stored` False keeps only the summaries; so does _span_logits_quads on
        int8_quads.c's kernel (elsewhere `stored` changes nothing)."""
        inv_t = inv_temperature if inv_temperature.dtype == torch.float32 else inv_temperature.to(torch.float32)
        if self._fused is not None and not softcap and self.vocab_size % SPAN == 0:
            x = self._input(hidden)
            return self._span_logits_fused(x, inv_t) if stored else self._span_summaries_fused(x, inv_t)
        if self._quads is not None and not softcap and self.vocab_size % SPAN == 0:
            return self._span_logits_quads(hidden, inv_t, stored)
        chunks, x = self._products(hidden)
        if hidden.shape[0] > FEW_ROWS and self.chunk_rows % SPAN == 0:
            pad = padded_width(self.vocab_size) - self.vocab_size
            pieces, peaks, masses = [], [], []
            values, row_scale = x
            for i, chunk in enumerate(chunks):
                padded_chunk = pad and i == len(chunks) - 1
                if isinstance(chunk, AmxProduct) and not softcap and not padded_chunk:
                    # the kernel summarises each span as its logits come out (the same values)
                    out, peak, mass = chunk.span_logits(values, row_scale, inv_t, EXP_FLOOR)
                elif row_scale is not None and not softcap and not padded_chunk:
                    # int8 activations: their row scale applied in the summaries' own pass
                    # (one pass less over a chunk that no longer fits in cache at 64 rows)
                    out = chunk(values, None)
                    peak, mass = KERNEL.scale_and_summarise(out, row_scale, inv_t)
                else:
                    out = self._chunk_logits(chunk, x, softcap)
                    if padded_chunk:
                        out = torch.nn.functional.pad(out.float(), (0, pad), value=float("-inf"))
                    peak, mass = KERNEL.summarise(out, inv_t)  # the native or compiled kernel, or span_stats
                pieces.append(out)
                peaks.append(peak)
                masses.append(mass)
            return SpanLogits(vocab_size=self.vocab_size, inv_temperature=inv_t, span_max=torch.cat(peaks, dim=1),
                              span_sum=torch.cat(masses, dim=1), buffer=self._logits_buffer, pieces=pieces)
        padded = self._logits_buffer.rows(hidden.shape[0])
        for start, chunk in zip(range(0, self.vocab_size, self.chunk_rows), chunks):
            out = self._chunk_logits(chunk, x, softcap)
            padded[:, start : start + out.shape[1]].copy_(out)
        peak, mass = KERNEL.summarise(padded, inv_t)
        return SpanLogits(vocab_size=self.vocab_size, inv_temperature=inv_t, span_max=peak, span_sum=mass,
                          buffer=self._logits_buffer, padded=padded)

    def _span_logits_fused(self, x: HeadInput, inv_t: torch.Tensor) -> SpanLogits:
        """span_logits where every chunk's kernel summarises its own spans (the AMX int8
        one) and the vocabulary is whole spans: each chunk writes its logits straight into
        its columns of the reused buffer, so the logits are dense with no copy, and no
        step faults in fresh pages for them."""
        assert self._fused is not None
        values, row_scale = x
        padded = self._logits_buffer.rows(values.shape[0])
        peaks, masses = [], []
        for start, chunk in zip(range(0, self.vocab_size, self.chunk_rows), self._fused):
            _, peak, mass = chunk.span_logits(values, row_scale, inv_t, EXP_FLOOR,
                                              out=padded[:, start : start + chunk.weight.n])
            peaks.append(peak)
            masses.append(mass)
        return SpanLogits(vocab_size=self.vocab_size, inv_temperature=inv_t, span_max=torch.cat(peaks, dim=1),
                          span_sum=torch.cat(masses, dim=1), buffer=self._logits_buffer, padded=padded)

    def _span_logits_quads(self, hidden: torch.Tensor, inv_t: torch.Tensor, stored: bool = True) -> SpanLogits:
        """span_logits on int8_quads.c's kernel (QuadsKernel.span_logits): the whole
        vocabulary's products, scaled and summarised span by span while in cache, into the
        reused buffer: the same logits and summaries as its product followed by
        scale_and_summarise, with no [rows, vocabulary] float32 read back from memory and,
        above QUADS_BESIDE_PACKED_MAX_ROWS rows, no oneDNN copy of the weights. With
        `stored` False the summaries alone, the logits computed again where they are read
        (QuadsSpanSource): no [rows, vocabulary] float32 written either (67 MB a step at 64
        rows of Gemma 3's vocabulary)."""
        assert self._quads is not None
        values, row_scale = self._input(hidden)
        assert row_scale is not None  # int8 activations: the quads head's input
        kernel, whole = self._quads
        if not inv_t.is_contiguous():
            inv_t = inv_t.contiguous()
        if not stored:
            # the source first: its checks are torch calls, cheaper before the kernel streams
            # the head's weights through the caches than after
            source = QuadsSpanSource(kernel, values, whole, row_scale, inv_t, EXP_FLOOR)
            peak, mass = kernel.span_logits(values, whole, row_scale, inv_t, EXP_FLOOR, None)
            return SpanLogits(vocab_size=self.vocab_size, inv_temperature=inv_t, span_max=peak, span_sum=mass,
                              buffer=self._logits_buffer, source=source)
        padded = self._logits_buffer.rows(values.shape[0])
        peak, mass = kernel.span_logits(values, whole, row_scale, inv_t, EXP_FLOOR, padded)
        return SpanLogits(vocab_size=self.vocab_size, inv_temperature=inv_t, span_max=peak, span_sum=mass,
                          buffer=self._logits_buffer, padded=padded)

    def _span_summaries_fused(self, x: HeadInput, inv_t: torch.Tensor) -> SpanLogits:
        """_span_logits_fused's summaries, bit for bit, without storing the logits (67 MB a
        step at 64 rows of Gemma 3's vocabulary): they are computed again where they are
        read (_ChunkSource), a span at a time or, at the first dense need, all at once."""
        assert self._fused is not None
        values, row_scale = x
        found = [chunk.span_summaries(values, row_scale, inv_t, EXP_FLOOR) for chunk in self._fused]
        return SpanLogits(vocab_size=self.vocab_size, inv_temperature=inv_t,
                          span_max=torch.cat([peak for peak, _ in found], dim=1),
                          span_sum=torch.cat([mass for _, mass in found], dim=1), buffer=self._logits_buffer,
                          source=_ChunkSource(self._fused, values, row_scale, inv_t, self.chunk_rows))

    @staticmethod
    def _chunk_logits(chunk: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor], x: HeadInput,
                      softcap: float | None) -> torch.Tensor:
        out = chunk(*x)
        return torch.tanh(out.float() / softcap) * softcap if softcap else out


class _ChunkSource:
    """The logits of an AMX head's chunks that _span_summaries_fused did not store
    (span_logits.LogitsSource): all of them by the chunks' kernels, as _span_logits_fused
    stores them; a span at a time by AmxSpanSource, built on the first native request."""

    def __init__(self, chunks: list[AmxProduct], values: torch.Tensor, row_scale: torch.Tensor | None,
                 inv_t: torch.Tensor, chunk_rows: int) -> None:
        self._chunks, self._values, self._row_scale, self._inv_t = chunks, values, row_scale, inv_t
        self._chunk_rows = chunk_rows
        self._spans: AmxSpanSource | None = None

    def materialize(self, padded: torch.Tensor) -> None:
        for start, chunk in zip(range(0, padded.shape[1], self._chunk_rows), self._chunks):
            chunk.span_logits(self._values, self._row_scale, self._inv_t, EXP_FLOOR,
                              out=padded[:, start : start + chunk.weight.n])

    def native(self) -> tuple[int, int]:
        if self._spans is None:
            self._spans = AmxSpanSource(self._chunks, self._values, self._row_scale)
        return self._spans.fill_address, self._spans.address
