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
The preads of a lookup run in one native call (file_rows.c) where it is built, else in the
Python loop here (`read_rows_native` False): the same rows and the same errors.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache
from pathlib import Path
from typing import Any, NoReturn

import torch

from hybridserve.core.errors import ConfigError
from hybridserve.models.platform.native_build import NativeBuildError, build

SOURCE = Path(__file__).with_name("file_rows.c")


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

    def __call__(self, ids: torch.Tensor, native: bool = True) -> torch.Tensor:
        """`native` False: the Python loop even where the native reader is built."""
        reader = read_rows_native() if native else None
        if reader is not None and ids.dtype == torch.int64 and ids.device.type == "cpu":
            flat = ids.reshape(-1).contiguous()
            out = torch.empty(flat.shape[0], self.cols, dtype=self.dtype)
            bad = reader(self._fd, self._offset, self._row_bytes, self.num_rows, flat.data_ptr(), flat.shape[0],
                         out.data_ptr())
            if bad >= 0:
                self._fail(int(flat[bad % flat.shape[0]]), missing=bad >= flat.shape[0])
            return out.view(*ids.shape, self.cols)
        rows = ids.reshape(-1).tolist()
        out = torch.empty(len(rows), self.cols, dtype=self.dtype)
        raw = out.view(torch.uint8).numpy()  # shares out's memory: rows are read straight into it
        for i, row in enumerate(rows):
            if not 0 <= row < self.num_rows:
                self._fail(row, missing=False)
            if os.preadv(self._fd, [raw[i]], self._offset + row * self._row_bytes) != self._row_bytes:
                self._fail(row, missing=True)
        return out.view(*ids.shape, self.cols)

    def _fail(self, row: int, missing: bool) -> NoReturn:
        if missing:
            raise ConfigError(f"the checkpoint file ended inside row {row}: was it changed while loaded?")
        raise IndexError(f"index {row} is out of range for {self.num_rows} rows")

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)


@cache
def read_rows_native() -> Any:
    """file_rows.c's read_rows, or None where it cannot be built (no compiler): FileRows
    then reads in Python."""
    try:
        fn = build("file_rows", SOURCE).read_rows
    except NativeBuildError:
        return None
    i64 = ctypes.c_int64
    fn.argtypes = [ctypes.c_int32, i64, i64, i64, ctypes.c_void_p, i64, ctypes.c_void_p]
    fn.restype = i64
    return fn


def file_rows_available() -> bool:
    """Whether this OS has pread into a buffer (os.preadv: Linux, the BSDs, macOS 11+)."""
    return hasattr(os, "preadv")
