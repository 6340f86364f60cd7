"""Decoder linears as int4 groups (`--quantization q4`): torch's packed int4 CPU kernel.

A weight [N, K] is held as unsigned 4-bit values with one scale and one offset per group
of INT4_GROUP_SIZE along K, w = (q - 8) * scale + offset (models/layers/head.py's
quantize_int4_groups; a GGUF Q4_K tensor has this form exactly: models/loaders/gguf_q4.py),
packed once for `_weight_int4pack_mm_for_cpu`, scales and offsets in bf16: half the bytes of
int8 per weight, plus 4 bytes per group of 32.

The kernel reads those bytes at one row faster than the int8 x int8 GEMMs read theirs, but
its time grows with the rows (`python benchmarks/int4_rows.py`,
benchmarks/results/int4_kernels.md: about int8's time at 2 rows, 1.1-5x it at 16).
So Int4Linear has two paths over the same bytes:
- `kernel`, the int4 kernel, for up to KERNEL_MAX_ROWS rows (decode);
- `dequantized`, the values expanded to a bf16 weight at each call and multiplied by
  F.linear, for more rows (prefill): one temporary weight per call, never a second copy
  held. It reads the kernel's packed bytes, whose layout is torch's and checked once
  (packed_layout_known); where it differs, every row count takes the kernel.
Both multiply bf16 activations by the same bf16-rounded groups in float32 sums; they
differ by summation order and the rounding of the dequantized weight to bf16
(tests/models/test_int4_layers.py bounds it).
"""

from __future__ import annotations

from functools import cache
from typing import Callable

import torch
import torch.nn.functional as F

from hybridserve.core.errors import ConfigError
from hybridserve.models.layers.head import INT4_GROUP_SIZE, quantize_int4_groups

# Rows up to which the int4 kernel is taken rather than the weight expanded to bf16 per
# call: the kernel's time grows with the rows, the expansion's hardly does; at 64 rows the
# two were about even on Gemma 3 270M's shapes, at 256 the expansion won on every one
# (benchmarks/results/int4_kernels.md).
KERNEL_MAX_ROWS = 64
_PACK_ROWS = 16  # the kernel's output sizes are multiples of this
_WIDE_BLOCK = 64  # rows per block of the packed layout where N is a multiple of it (see _unpack)
_MIDPOINT = 8  # the kernel subtracts this from each 4-bit value before scaling


def _unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The 4-bit values [N, K] (uint8) of `_convert_weight_to_int4pack_for_cpu`'s output
    [N, K/2], laid out as torch 2.x packs it: the first rows in blocks of _WIDE_BLOCK, each
    block K-major with one byte per row pair (j, j + 32), row j in the low nibble; the
    remaining N % 64 rows after them, K-major, one byte per pair (2j, 2j + 1)."""
    flat = packed.view(-1)
    wide = n - n % _WIDE_BLOCK
    blocks = flat[: wide * k // 2].view(wide // _WIDE_BLOCK, k, _WIDE_BLOCK // 2)
    rows = torch.cat([blocks & 15, blocks >> 4], dim=-1).transpose(1, 2).reshape(wide, k)  # rows j, then j + 32
    if wide == n:
        return rows
    pairs = flat[wide * k // 2 :].view(k, (n - wide) // 2)
    rest = torch.stack([pairs & 15, pairs >> 4], dim=-1).view(k, n - wide).t()
    return torch.cat([rows, rest])


@cache
def packed_layout_known() -> bool:
    """Whether this torch packs int4 as _unpack reads it (checked on small patterns of both forms)."""
    for n in (2 * _WIDE_BLOCK, _WIDE_BLOCK + _PACK_ROWS):
        values = ((torch.arange(n * 64).view(n, 64) * 7 + torch.arange(n)[:, None]) % 16).to(torch.int32)
        try:
            packed = torch._convert_weight_to_int4pack_for_cpu(values, 1)
            if not torch.equal(_unpack(packed, n, 64).to(torch.int32), values):
                return False
        except (RuntimeError, AttributeError):
            return False
    return True


class Int4Linear:
    """x [S, K] -> x W^T in bf16, W [N, K] as int4 groups (`values` 0..15 int32, `scale`
    and `offset` [N, K/32] float) held once, packed for torch's int4 CPU kernel. Inputs
    are taken in bf16 (the kernel's only fast input dtype)."""

    def __init__(self, values: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> None:
        self.out_features, self.in_features = values.shape
        if self.out_features % _PACK_ROWS:
            raise ConfigError(f"int4 layers need every linear's output size to be a multiple of {_PACK_ROWS} "
                              f"(the packed kernel's rows), got {self.out_features}")
        self.group_size = self.in_features // scale.shape[1]
        self._packed = torch._convert_weight_to_int4pack_for_cpu(values.to(torch.int32), 1)
        self._scale_offset = torch.stack([scale.t(), offset.t()], dim=-1).contiguous().to(torch.bfloat16)
        self._many_rows = self.dequantized if packed_layout_known() else self.kernel

    @property
    def nbytes(self) -> int:
        return self._packed.numel() + self._scale_offset.numel() * self._scale_offset.element_size()

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """The int4 kernel on bf16 `x`."""
        return torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), self._packed,
                                                self.group_size, self._scale_offset)

    def weight(self) -> torch.Tensor:
        """The bf16 weight [N, K] the groups stand for, (q - 8) * scale + offset in float32
        rounded once to bf16."""
        n, k = self.out_features, self.in_features
        groups = _unpack(self._packed, n, k).view(n, k // self.group_size, self.group_size).float()
        scale, offset = self._scale_offset.float().unbind(-1)  # [K/g, N] each
        return groups.sub_(_MIDPOINT).mul_(scale.t()[..., None]).add_(offset.t()[..., None]).view(n, k).bfloat16()

    def dequantized(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 `x` times the weight expanded to bf16 for this call (models/layers/int4.py)."""
        return F.linear(x.to(torch.bfloat16), self.weight())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x) if x.shape[0] <= KERNEL_MAX_ROWS else self._many_rows(x)


def make_int4_linear(weight: torch.Tensor, bias: torch.Tensor | None
                     ) -> tuple[Callable[[torch.Tensor], torch.Tensor],
                                Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """(linear, residual_linear) of `weight` [out, in] quantized to int4 groups of
    INT4_GROUP_SIZE (min/max per group: quantize_int4_groups; ConfigError where `in` is no
    multiple of it). Outputs in `weight`'s dtype; bias and residual added in float32
    before the one rounding to it."""
    matmul = Int4Linear(*quantize_int4_groups(weight, INT4_GROUP_SIZE))
    out_dtype = weight.dtype
    bias32 = None if bias is None else bias.detach().float()

    def product(x: torch.Tensor) -> torch.Tensor:
        out = matmul(x).float()
        return out if bias32 is None else out.add_(bias32)

    def linear(x: torch.Tensor) -> torch.Tensor:
        if bias32 is None and out_dtype == torch.bfloat16:  # the kernel's own dtype: no conversion
            return matmul(x)
        return product(x).to(out_dtype)

    def residual(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return product(x).add_(h).to(out_dtype)

    return linear, residual
