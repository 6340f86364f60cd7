"""Greedy's per-chunk reduction of an int8 head by the C kernel of chunk_argmax.c (it says
why and how), built by models/platform/native_build.py: each row's (max, first index) of a
chunk's logits times their row scale, as torch's max(dim=-1) gives for the scaled chunk,
which head.row_max, the general path, also equals (checked on first use;
tests/models/test_head.py)."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from hybridserve.models.platform.native_build import build, checked

SOURCE = Path(__file__).with_name("chunk_argmax.c")


class ChunkArgmax:
    """(chunk [rows, cols] float32, row_scale [rows, 1] or None, start) -> writes each row's
    max of chunk * row_scale into best [rows] and start + its first column into index [rows]."""

    def __init__(self) -> None:
        fn = build("chunk_argmax", SOURCE).chunk_argmax
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int32]
        fn.restype = None
        self._fn = fn

    @staticmethod
    def supports(chunk: torch.Tensor) -> bool:
        """float32 rows on the CPU, unit column stride, at least one column."""
        return (chunk.device.type == "cpu" and chunk.dtype == torch.float32 and chunk.dim() == 2
                and chunk.stride(1) == 1 and chunk.shape[1] > 0)

    def __call__(self, chunk: torch.Tensor, row_scale: torch.Tensor | None, start: int, best: torch.Tensor,
                 index: torch.Tensor) -> None:
        rows, cols = chunk.shape
        if not self.supports(chunk):
            raise ValueError(f"chunk_argmax reads float32 CPU rows, not {chunk.dtype} {tuple(chunk.shape)}")
        if best.shape != (rows,) or best.dtype != torch.float32 or index.shape != (rows,) or index.dtype != torch.int64:
            raise ValueError(f"outputs for {rows} rows: float32 best and int64 index [{rows}], each contiguous")
        if not (best.is_contiguous() and index.is_contiguous()):
            raise ValueError(f"outputs for {rows} rows: float32 best and int64 index [{rows}], each contiguous")
        if row_scale is not None and (row_scale.dtype != torch.float32 or row_scale.numel() != rows
                                      or not row_scale.is_contiguous()):
            raise ValueError(f"row_scale: {rows} contiguous float32 values")
        if rows:
            self._fn(chunk.data_ptr(), rows, cols, chunk.stride(0), None if row_scale is None else row_scale.data_ptr(),
                     start, best.data_ptr(), index.data_ptr(), torch.get_num_threads())


@cache
def chunk_argmax_kernel() -> ChunkArgmax | None:
    """The kernel, built and checked against torch's max on first use; None where it cannot
    be built or disagrees (a warning says why): the head then reduces each chunk eagerly."""
    return checked(ChunkArgmax, _mismatch, "greedy's per-chunk reduction stays eager")


def _mismatch(kernel: ChunkArgmax) -> str:
    """'' when the kernel gives max(dim=-1)'s values and indices of the scaled chunk on
    made-up rows with ties (few distinct values), a NaN and a tail past whole vectors; else
    what differs."""
    g = torch.Generator().manual_seed(0)
    rows, cols = 9, 1000
    chunk = torch.randint(-3, 4, (rows, cols), generator=g).float() * 0.37
    chunk[4, 700] = float("nan")
    scale = torch.rand(rows, 1, generator=g) + 0.5
    best, index = torch.empty(rows), torch.empty(rows, dtype=torch.int64)
    kernel(chunk, scale, 5, best, index)
    want_best, want_index = (chunk * scale).max(dim=-1)
    if not (torch.equal(index, want_index + 5) and torch.equal(best.isnan(), want_best.isnan())
            and torch.equal(best[~best.isnan()], want_best[~want_best.isnan()])):
        return "differs from torch's max"
    return ""
