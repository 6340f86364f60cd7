"""Rows of a checkpoint tensor read from its file at each lookup (the embedding by token id).

Why not the mapped view: a page fault on a file mapping maps the faulting page and, where
they are in the page cache (as right after the load read them), the pages around it
(the kernel's fault-around, 64 KB by default; madvise(MADV_RANDOM) stops read-ahead, not
this). Each token id looked up in a mapped embedding then made tens of KB resident: about
80 MB of the default model's RSS after one 16 x 64 run of random prompts, growing towards
the whole table. Read with pread, a lookup maps nothing, and the rows cost only the output.

Cost: one pread per token per step (a few microseconds each; a decode step of 16 rows
makes 16), against one gather from the mapping. The mapped view stays the general path
(models/arch/decoder.StagedModel.stage_input); tests/models/test_file_rows.py checks they agree.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from hybridserve.core.errors import ConfigError


class FileRows:
    """ids (any shape, long) -> rows [*ids.shape, cols] of the [rows, cols] tensor of `dtype`
    stored contiguously at byte `offset` of `path`, read with pread. Invariant: equal, bit
    for bit, to F.embedding(ids, the stored tensor)."""

    def __init__(self, path: Path, offset: int, shape: tuple[int, int], dtype: torch.dtype) -> None:
        self.num_rows, self.cols = shape
        self.dtype = dtype
        self._offset = offset
        self._row_bytes = self.cols * torch.tensor([], dtype=dtype).element_size()
        self._fd = os.open(path, os.O_RDONLY)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).tolist()
        out = torch.empty(len(flat), self.cols, dtype=self.dtype)
        raw = out.view(torch.uint8).numpy()  # shares out's memory: rows are read straight into it
        for i, row in enumerate(flat):
            if not 0 <= row < self.num_rows:
                raise IndexError(f"index {row} is out of range for {self.num_rows} rows")
            if os.preadv(self._fd, [raw[i]], self._offset + row * self._row_bytes) != self._row_bytes:
                raise ConfigError(f"the checkpoint file ended inside row {row}: was it changed while loaded?")
        return out.view(*ids.shape, self.cols)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)


def file_rows_available() -> bool:
    """Whether this OS has pread into a buffer (os.preadv: Linux, the BSDs, macOS 11+)."""
    return hasattr(os, "preadv")
