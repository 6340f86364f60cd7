"""Safetensors files mapped into memory: tensors are views of the file, read on first touch.

Why our own reader: loading a checkpoint with `safetensors.torch.load_file` copies every
tensor into process memory, and the loader then builds fused and packed copies of most of
them, so the weights existed twice at start. Here a tensor is a view of a private
(copy-on-write) file mapping: a weight used as stored (the embedding table) costs memory
only for the rows actually read, and a weight the loader transforms (fuses, packs,
quantizes) gives its pages back with `release` once the transformed copy exists.

Format (the published safetensors layout): 8 bytes little-endian header length N, N bytes
of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": ...},
then the data; offsets count from the end of the header.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch

from hybridserve.core.errors import ConfigError
from hybridserve.models.loaders.file_rows import FileRows

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_PAGE = mmap.PAGESIZE


class MappedFile:
    """One .safetensors file, mapped; `tensor(name)` views it without copying."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with path.open("rb") as f:
                size = path.stat().st_size
                (header_len,) = struct.unpack("<Q", f.read(8))
                if header_len > size - 8:
                    raise ValueError("header longer than the file")
                header = json.loads(f.read(header_len))
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > 8 + header_len else None
        except (OSError, ValueError, struct.error) as error:
            raise ConfigError(f"{path} is not a readable safetensors file: {error}") from None
        self._data_start = 8 + header_len
        header.pop("__metadata__", None)
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            dtype = _DTYPES.get(info.get("dtype"))
            if dtype is None:
                raise ConfigError(f"{path}: tensor {name} has unsupported dtype {info.get('dtype')!r}")
            begin, end = info["data_offsets"]
            self.entries[name] = (dtype, tuple(info["shape"]), self._data_start + begin, self._data_start + end)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8) if self._map is not None else None

    def tensor(self, name: str) -> torch.Tensor:
        dtype, shape, begin, end = self.entries[name]
        if begin == end:
            return torch.empty(shape, dtype=dtype)
        assert self._bytes is not None
        return self._bytes[begin:end].view(dtype).view(shape)

    def row_reader(self, name: str) -> FileRows:
        """`name`'s rows (a 2-D tensor) read from the file at each lookup (file_rows.py)."""
        dtype, shape, begin, _ = self.entries[name]
        rows, cols = shape
        return FileRows(self.path, begin, (rows, cols), dtype)

    def release(self, name: str, rows: tuple[int, int] | None = None) -> None:
        """Give back the resident pages of `name`'s bytes, or of its rows [start, stop) (they
        are re-read from the file if touched again; the mapping is private and never written,
        so nothing is lost)."""
        dtype, shape, begin, end = self.entries[name]
        if rows is not None and shape:
            row_bytes = (end - begin) // shape[0] if shape[0] else 0
            begin, end = begin + rows[0] * row_bytes, begin + rows[1] * row_bytes
        first = -(-begin // _PAGE) * _PAGE  # only pages wholly inside: neighbours may be in use
        last = end // _PAGE * _PAGE
        if self._map is not None and last > first and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED, first, last - first)


class MappedCheckpoint:
    """Every tensor of a checkpoint's .safetensors files by name (sharded or not)."""

    def __init__(self, files: list[Path]) -> None:
        self._owner: dict[str, MappedFile] = {}
        for path in files:
            mapped = MappedFile(path)
            for name in mapped.entries:
                self._owner[name] = mapped

    def names(self) -> list[str]:
        return list(self._owner)

    def tensor(self, name: str) -> torch.Tensor:
        return self._owner[name].tensor(name)

    def release(self, name: str, rows: tuple[int, int] | None = None) -> None:
        self._owner[name].release(name, rows)

    def row_reader(self, name: str) -> FileRows:
        return self._owner[name].row_reader(name)
