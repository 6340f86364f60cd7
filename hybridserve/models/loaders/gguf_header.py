"""A fast reader for a GGUF file's header: metadata and the tensor table, never the tensor data.

Why not `gguf.GGUFReader`: it builds a numpy view per array *element* while opening a file, so a
262,144-token vocabulary costs about 24 s before the first tensor is touched. This reader walks the
same layout with `struct`, keeps numeric arrays as single numpy views, and skips string arrays
(the vocabulary goes to transformers' tokenizer builder, which reads it itself), so opening the
Gemma 3 270M file takes milliseconds. The bytes it returns are dequantized with the `gguf`
package's own kernels (`gguf.quants.dequantize`); the type codes and block sizes come from the
package's constants, so nothing here re-states ggml's quantization formats.

Layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64 metadata
count, the metadata pairs, the tensor table (name, u32 n_dims, u64 dims fastest-first, u32 ggml
type, u64 offset), then padding to `general.alignment` and the data section.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hybridserve.core.errors import ConfigError

GGUF_MAGIC_BYTES = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value type code -> struct format of one scalar (GGUFValueType in the gguf package).
_SCALAR_FORMATS: dict[int, str] = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}
_NUMPY_DTYPES: dict[int, str] = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor table.

    Invariants: `shape` is in numpy/torch order (slowest dimension first, i.e. ggml's dims
    reversed), `data_offset` is absolute in the file, and `byte_count` bytes from there hold
    exactly this tensor's (possibly quantized) blocks.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    data_offset: int
    byte_count: int


@dataclass(frozen=True)
class GGUFHeader:
    """Metadata and tensor table of one GGUF file.

    `metadata` maps keys to Python scalars, strings, or 1-D numpy arrays (numeric arrays).
    String arrays (vocabulary, merges) are not decoded: `string_array_lengths` holds their
    element counts instead, and they do not appear in `metadata`.
    """

    path: Path
    version: int
    metadata: dict[str, Any]
    string_array_lengths: dict[str, int]
    tensors: tuple[GGUFTensorInfo, ...]

    @property
    def architecture(self) -> str:
        """The `general.architecture` value (for example "gemma3" or "llama")."""
        return str(self.metadata.get("general.architecture", ""))

    def arch_value(self, key: str, default: Any = None) -> Any:
        """The metadata value `<architecture>.<key>`, or `default` when the file lacks it."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


class _Cursor:
    """A read position over the memory-mapped file; every read advances it."""

    def __init__(self, blob: np.ndarray, path: Path) -> None:
        self.blob = blob
        self.pos = 0
        self.path = path

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.blob):
            raise ConfigError(f"{self.path} is truncated: its GGUF header runs past the end of the file")
        values = struct.unpack_from(fmt, self.blob, self.pos)
        self.pos += size
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        length = self.unpack("<Q")
        raw = bytes(self.blob[self.pos : self.pos + length])
        if len(raw) != length:
            raise ConfigError(f"{self.path} is truncated: a GGUF string runs past the end of the file")
        self.pos += length
        return raw.decode("utf-8", errors="replace")


def _read_value(cur: _Cursor, value_type: int) -> tuple[Any, int | None]:
    """Read one metadata value. Returns (value, string array length or None)."""
    if value_type in _SCALAR_FORMATS:
        return cur.unpack(_SCALAR_FORMATS[value_type]), None
    if value_type == _STRING:
        return cur.string(), None
    if value_type != _ARRAY:
        raise ConfigError(f"{cur.path} holds GGUF metadata of unknown type {value_type}")
    element_type, count = cur.unpack("<IQ")
    if element_type in _NUMPY_DTYPES:
        dtype = np.dtype(_NUMPY_DTYPES[element_type])
        values = np.frombuffer(cur.blob, dtype=dtype, count=count, offset=cur.pos).copy()
        cur.pos += count * dtype.itemsize
        return values, None
    if element_type == _STRING:
        # Walk past the strings without decoding them: only their count is kept.
        for _ in range(count):
            (length,) = struct.unpack_from("<Q", cur.blob, cur.pos)
            cur.pos += 8 + length
        return None, count
    # Arrays of arrays do not occur in model files; skip them element by element.
    for _ in range(count):
        _read_value(cur, element_type)
    return None, count


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Parse the header of the GGUF file at `path` (no tensor data is read).

    Raises ConfigError when the file is not a GGUF file, is big-endian, is of an unsupported
    version, or is truncated.
    """
    path = Path(path)
    blob = np.memmap(path, mode="r", dtype=np.uint8) if path.stat().st_size else np.zeros(0, np.uint8)
    if bytes(blob[:4]) != GGUF_MAGIC_BYTES:
        raise ConfigError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        return _parse_header(path, blob)
    except (struct.error, ValueError) as error:  # a length or count pointing past the end
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(f"{path} is truncated or corrupt: its GGUF header cannot be parsed") from None


def _parse_header(path: Path, blob: np.ndarray) -> GGUFHeader:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # the block sizes of every ggml type

    cur = _Cursor(blob, path)
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in _SUPPORTED_VERSIONS:
        raise ConfigError(f"{path} is GGUF version {version}; only little-endian versions 2 and 3 are supported")
    tensor_count, kv_count = cur.unpack("<QQ")
    metadata: dict[str, Any] = {}
    string_array_lengths: dict[str, int] = {}
    for _ in range(kv_count):
        key = cur.string()
        value, string_count = _read_value(cur, cur.unpack("<I"))
        if string_count is not None:
            string_array_lengths[key] = string_count
        else:
            metadata[key] = value
    table: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(tensor_count):
        name = cur.string()
        n_dims = cur.unpack("<I")
        dims_fastest_first = struct.unpack_from(f"<{n_dims}Q", blob, cur.pos)
        cur.pos += 8 * n_dims
        ggml_type, relative_offset = cur.unpack("<IQ")
        table.append((name, tuple(reversed(dims_fastest_first)), ggml_type, relative_offset))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = (cur.pos + alignment - 1) // alignment * alignment
    tensors = []
    for name, shape, ggml_type, relative_offset in table:
        try:
            block_size, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise ConfigError(f"{path}: tensor {name} has unknown ggml type {ggml_type}") from None
        element_count = int(np.prod(shape, dtype=np.int64))
        byte_count = element_count // block_size * block_bytes
        if data_start + relative_offset + byte_count > len(blob):
            raise ConfigError(f"{path} is truncated: tensor {name} runs past the end of the file")
        tensors.append(GGUFTensorInfo(name, shape, ggml_type, data_start + relative_offset, byte_count))
    return GGUFHeader(path, version, metadata, string_array_lengths, tuple(tensors))


def tensor_bytes(header: GGUFHeader, info: GGUFTensorInfo) -> np.ndarray:
    """The tensor `info` as stored, uint8 of shape (*info.shape[:-1], bytes per row), mapped."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block_size, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
    blob = np.memmap(header.path, mode="r", dtype=np.uint8, offset=info.data_offset, shape=(info.byte_count,))
    return blob.reshape(*info.shape[:-1], info.shape[-1] // block_size * block_bytes)


def dequantize_tensor(header: GGUFHeader, info: GGUFTensorInfo, rows: tuple[int, int] | None = None) -> np.ndarray:
    """The tensor `info` as a float32 array of shape `info.shape`, via `gguf.quants.dequantize`;
    with `rows` = (start, stop) only those indices of its first dimension."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    ggml_type = GGMLQuantizationType(info.ggml_type)
    raw = tensor_bytes(header, info)  # dequantize() wants the raw bytes with rows intact
    shape = info.shape
    if rows is not None:
        raw = raw[rows[0]:rows[1]]
        shape = (raw.shape[0], *info.shape[1:])
    try:
        values = dequantize(raw, ggml_type)
    except NotImplementedError:
        raise ConfigError(f"{header.path}: ggml type {ggml_type.name} of {info.name} cannot be dequantized") from None
    return np.asarray(values, dtype=np.float32).reshape(shape)
