"""The output head (hidden -> vocab logits): dense, int8 per channel or int4 group-wise.

With a large vocabulary the head is most of the model (Gemma 3 270M: 168M of 270M
parameters) and its bytes set the decode speed, so it gets its own representations:

- "none": the weight in the model dtype, oneDNN-packed (see linear.py) in chunks of
  HEAD_CHUNK_ROWS vocabulary rows. Packing chunk by chunk, and handing each chunk's source
  rows back to `release_rows` once packed, keeps the peak at one packed copy plus one
  chunk: the tied embedding stays a mapped view of the checkpoint whose rows are read only
  for the tokens looked up.
- "int8": one int8 per weight and one scale per vocabulary row (symmetric, round to
  nearest). On a CPU with int8 dot products (VNNI / AMX-INT8) the hidden states are
  quantized too, per row (symmetric, 127 levels, stored as uint8 around 128), and oneDNN's
  int8 GEMM multiplies them (`onednn.qlinear_pointwise`): at a decode batch of 64 the head
  is compute-bound, and the int8 dot products run several times faster than bf16 ones
  without AMX (Gemma 3 270M head chunk on one Sapphire Rapids core: 2.9 vs 17 ms at 64
  rows, 0.6 vs 1.0 ms at 1 row). Elsewhere PyTorch's weight-only int8 kernel
  (`_weight_int8pack_mm`) multiplies bfloat16 activations.
- "int4": unsigned 4-bit values in groups of INT4_GROUP_SIZE along the hidden dimension,
  each group with its own scale and offset (asymmetric min/max), packed for PyTorch's CPU
  int4 kernel (`_weight_int4pack_mm_for_cpu`).

The weight-only kernels take bfloat16 activations; a float32 model's hidden states are
rounded to bfloat16 for them. The logits come back in the model dtype.
"""

from __future__ import annotations

from functools import cache
from typing import Callable

import torch

from hybridserve.core.errors import ConfigError
from hybridserve.models.cpu_features import has_int8_dot, read_cpu_flags
from hybridserve.models.heap import release_free_heap
from hybridserve.models.linear import pack

# Vocabulary rows per packed / quantized chunk: small enough that quantizing one (float32
# temporaries) adds little to the load's peak memory, large enough that per-call overhead
# stays small (16 calls per step for a 262k vocabulary).
HEAD_CHUNK_ROWS = 16384
# Rows quantized at a time within a chunk: float32 temporaries of 2048 x hidden (5 MB at
# Gemma 3's 640), small beside the chunk's own int8 copy.
QUANTIZE_BLOCK_ROWS = 2048
INT4_GROUP_SIZE = 32  # hidden-dim weights sharing one int4 scale and offset (as GGUF's Q4_K sub-blocks)
_INT4_LEVELS = 15  # largest 4-bit value
_INT4_MIDPOINT = 8  # the kernel subtracts this from each 4-bit value before scaling
_INT8_LEVELS = 127

_UINT8_ZERO_POINT = 128  # a symmetric int8 activation stored as uint8 (oneDNN's u8 x s8 GEMM)

ReleaseRows = Callable[[int, int], None]
# What a head's chunks take: the hidden states as the kernel wants them, and the per-row
# scale of quantized activations (None: not quantized).
HeadInput = tuple[torch.Tensor, "torch.Tensor | None"]


@cache
def int8_activations_native() -> bool:
    """Whether int8 x int8 GEMMs are the fast path here: oneDNN's quantized linear exists
    and the CPU has int8 dot-product instructions (without them the u8 x s8 step can
    saturate)."""
    return hasattr(torch.ops.onednn, "qlinear_pointwise") and has_int8_dot(read_cpu_flags())


def quantize_rows_uint8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 [S, K], float32 scale [S, 1]) with x ~= (values - 128) * scale: symmetric per
    row, 127 levels each side (so values are 1..255)."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_(min=torch.finfo(torch.float32).tiny) / _INT8_LEVELS
    return (x / scale).round_().add_(_UINT8_ZERO_POINT).to(torch.uint8), scale


def quantize_int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values [N, K], float32 scale per row [N]) with weight ~= values * scale[:, None].
    Rows are independent, so they are quantized QUANTIZE_BLOCK_ROWS at a time: the float32
    temporaries then cost a few MB instead of several copies of the whole chunk (three
    float32 copies of a 16k x 640 chunk were 120 MB of the default model's peak RSS)."""
    n = weight.shape[0]
    values = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(n, dtype=torch.float32, device=weight.device)
    for start in range(0, n, QUANTIZE_BLOCK_ROWS):
        stop = min(start + QUANTIZE_BLOCK_ROWS, n)
        w = weight[start:stop].float()
        block_scale = w.abs().amax(dim=1).clamp_(min=torch.finfo(torch.float32).tiny) / _INT8_LEVELS
        scale[start:stop] = block_scale
        values[start:stop] = torch.round(w / block_scale[:, None]).clamp_(-_INT8_LEVELS, _INT8_LEVELS)
    return values, scale


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


class OutputHead:
    """hidden [S, K] -> logits [S, N] in the model dtype, from per-chunk kernels."""

    def __init__(self, weight: torch.Tensor, quantization: str, release_rows: ReleaseRows | None = None) -> None:
        self.out_dtype = weight.dtype
        self.quantization = quantization
        self.vocab_size = weight.shape[0]
        self._int8_activations = quantization == "int8" and weight.device.type == "cpu" and int8_activations_native()
        self._chunks: list[Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]] = []
        for start in range(0, self.vocab_size, HEAD_CHUNK_ROWS):
            stop = min(start + HEAD_CHUNK_ROWS, self.vocab_size)
            kernel, reads_source = self._chunk_kernel(weight[start:stop])
            self._chunks.append(kernel)
            if release_rows is not None and not reads_source:
                release_rows(start, stop)
            # The chunk's unpacked values and temporaries are freed now, but glibc keeps
            # such holes resident in the heap: without this the default model's int8 head
            # cost 20 MB of RSS per 10 MB chunk (see models/heap.py).
            release_free_heap()

    def _chunk_kernel(self, w: torch.Tensor) -> tuple[Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor], bool]:
        """(the matmul of one chunk of rows, whether it still reads `w` itself)."""
        if self.quantization == "int8":
            values, scale = quantize_int8_rows(w)
            if self._int8_activations:
                packed = torch.ops.onednn.qlinear_prepack(values, None)
                zero_points = torch.zeros(len(scale), dtype=torch.int64)
                qlinear = torch.ops.onednn.qlinear_pointwise

                def w8a8(x: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
                    out = qlinear(x, 1.0, _UINT8_ZERO_POINT, packed, scale, zero_points, None, 1.0, 0,
                                  torch.float32, "none", [None], "")
                    return out.mul_(row_scale)

                return w8a8, False
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
        packed = pack(w)
        if packed is None:  # small or not packable here: the plain weight is the kernel's input
            return (lambda x, _: torch.nn.functional.linear(x, w)), True
        linear = torch.ops.mkldnn._linear_pointwise
        return (lambda x, _: linear(x, packed, None, "none", [], "")), False

    def _input(self, hidden: torch.Tensor) -> HeadInput:
        """The chunks' input, made once per call (quantizing per chunk would repeat it)."""
        x = hidden.contiguous()
        if self.quantization == "none":
            return x, None
        if self.quantization == "int8" and self._int8_activations:
            return quantize_rows_uint8(x)
        return x.to(torch.bfloat16), None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self._input(hidden)
        if len(self._chunks) == 1:
            return self._chunks[0](*x).to(self.out_dtype)
        return torch.cat([chunk(*x) for chunk in self._chunks], dim=1).to(self.out_dtype)

    def greedy(self, hidden: torch.Tensor, softcap: float | None) -> list[int]:
        """argmax of each row's logits (the first index among equal maxima, as argmax), without
        building the full logits: each chunk reduces to its (max, index) while it is in cache.
        `max(dim)` rather than `argmax`: one pass that returns both, 2-3x faster on bfloat16
        rows of 262k; it picks the first maximal index too (tests/test_head.py checks)."""
        x = self._input(hidden)
        values, indices = [], []
        for start, chunk in zip(range(0, self.vocab_size, HEAD_CHUNK_ROWS), self._chunks):
            out = chunk(*x)
            if softcap:  # as logits(): tanh can make distinct logits equal, so argmax must see it
                out = torch.tanh(out.to(self.out_dtype) / softcap) * softcap
            best = out.max(dim=-1)
            values.append(best.values.float())
            indices.append(best.indices + start)
        if len(values) == 1:
            return indices[0].tolist()
        winner = torch.stack(values, dim=1).max(dim=1).indices  # first chunk holding the maximum
        return torch.stack(indices, dim=1).gather(1, winner[:, None]).squeeze(1).tolist()
