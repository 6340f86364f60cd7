"""GGUF Q8_0, Q5_0, Q6_K and Q4_K blocks as int8 groups: the file's values exactly.

Each of these block formats stores a row's weights as small integers times a float scale
per group (plus an offset per group for Q4_K); `Int8Groups` holds them so:
weight = values * scale[group] (+ offset[group]), values int8, one group per
`group_size` consecutive weights of a row. The scales are products of an fp16 and an
integer of at most 8 bits (Q6_K, Q4_K), so float32 holds them exactly; `weight` rounds
once in float32, as ggml's own dequantizer does (the gguf package's `dequantize` gives the
same float32 values: tests/models/test_gguf_groups.py).

ggml's layouts (ggml-quants.c, dequantize_row_*):
- Q8_0, 34 bytes per 32 weights: fp16 d, 32 int8 q; w = d * q.
- Q5_0, 22 bytes per 32 weights: fp16 d, 32 high bits qh (little-endian uint32), 16 bytes
  of low nibbles: weight j < 16 in byte j's low nibble with bit j of qh, weight j + 16 in
  its high nibble with bit j + 16; w = d * (q - 16), q in 0..31.
- Q6_K, 210 bytes per 256 weights: 128 bytes ql (low 4 bits), 64 bytes qh (2 high bits
  each), 16 int8 sub-block scales (one per 16 weights), fp16 d; w = d * sc * (q - 32).
  Each half of 128 weights takes 64 bytes of ql and 32 of qh: weight l (l < 32) of the
  half from ql[l]'s low nibble and qh[l] bits 0-1, l + 32 from ql[l + 32]'s low nibble and
  qh[l] bits 2-3, l + 64 from ql[l]'s high nibble and bits 4-5, l + 96 from ql[l + 32]'s
  high nibble and bits 6-7.
- Q4_K: models/loaders/gguf_q4.py; w = d * sc * q - dmin * m per 32, q in 0..15.

On the load path under `--quantization gguf-groups`: the conversion (gguf_loader.py) keeps
each decoder linear's groups in the cached checkpoint as `<weight name>_values` (int8),
`_scale` and, for Q4_K, `_offset` (float32), in place of its dequantized weight
(`group_parts`); the loader (loader.py) reads them back as the layers' GroupWeights.
"""

from __future__ import annotations

import re
from typing import Callable, NamedTuple

import numpy as np

from hybridserve.core.errors import ConfigError
from hybridserve.models.loaders.gguf_q4 import Q4_K_TYPE, q4_k_parts, whole_blocks

Q8_0_TYPE, Q5_0_TYPE, Q6_K_TYPE = 8, 6, 14  # ggml_type
_BLOCK = 32  # weights per Q8_0 / Q5_0 block
_Q6_K_WEIGHTS, _Q6_K_BYTES, _Q6_K_GROUP = 256, 210, 16


class Int8Groups(NamedTuple):
    """A [rows, cols] tensor as int8 `values` times float32 `scale` [rows, cols / group_size]
    per group, plus `offset` (same shape) where the format has one (Q4_K), else None."""

    values: np.ndarray
    scale: np.ndarray
    offset: np.ndarray | None
    group_size: int

    def weight(self) -> np.ndarray:
        """The float32 values the groups stand for (one rounding per weight: the product,
        and with an offset the sum)."""
        rows, cols = self.values.shape
        grouped = self.values.reshape(rows, -1, self.group_size).astype(np.float32) * self.scale[..., None]
        if self.offset is not None:
            grouped += self.offset[..., None]
        return grouped.reshape(rows, cols)


def _fp16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at bytes [start, start + 2) of each block, as float32 [B, 1]."""
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def q8_0_groups(raw: np.ndarray, rows: int, cols: int) -> Int8Groups:
    blocks = whole_blocks(raw, rows, cols, _BLOCK, 2 + _BLOCK, "Q8_0")
    return Int8Groups(blocks[:, 2:].view(np.int8).reshape(rows, cols), _fp16(blocks, 0).reshape(rows, -1), None,
                      _BLOCK)


def q5_0_groups(raw: np.ndarray, rows: int, cols: int) -> Int8Groups:
    blocks = whole_blocks(raw, rows, cols, _BLOCK, 2 + 4 + _BLOCK // 2, "Q5_0")
    high = np.unpackbits(blocks[:, 2:6], axis=1, bitorder="little")  # [B, 32]: bit j of qh
    low = blocks[:, 6:]
    q = np.concatenate([low & 15, low >> 4], axis=1) | (high << 4)
    return Int8Groups((q.astype(np.int8) - 16).reshape(rows, cols), _fp16(blocks, 0).reshape(rows, -1), None, _BLOCK)


def q6_k_groups(raw: np.ndarray, rows: int, cols: int) -> Int8Groups:
    blocks = whole_blocks(raw, rows, cols, _Q6_K_WEIGHTS, _Q6_K_BYTES, "Q6_K")
    ql = blocks[:, :128].reshape(-1, 2, 2, 32)  # [B, half, ql[l] or ql[l + 32], l]
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)  # [B, half, 1, l]
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)  # [B, 16]
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)  # quarters l, l + 32, l + 64, l + 96
    low = np.concatenate([ql & 15, ql >> 4], axis=2)  # [B, half, 4 quarters, 32]
    q = low | (((np.repeat(qh, 4, axis=2) >> shifts) & 3) << 4)
    values = (q.astype(np.int8) - 32).reshape(rows, cols)
    return Int8Groups(values, (_fp16(blocks, 208) * sc).reshape(rows, -1), None, _Q6_K_GROUP)


def q4_k_int8_groups(raw: np.ndarray, rows: int, cols: int) -> Int8Groups:
    values, scale, negative_min = q4_k_parts(raw, rows, cols)
    return Int8Groups(values.astype(np.int8), scale, negative_min, _BLOCK)


_READERS = {Q8_0_TYPE: q8_0_groups, Q5_0_TYPE: q5_0_groups, Q6_K_TYPE: q6_k_groups, Q4_K_TYPE: q4_k_int8_groups}
# Per type: the weights per group, and whether the format has an offset per group.
_LAYOUTS = {Q8_0_TYPE: (_BLOCK, False), Q5_0_TYPE: (_BLOCK, False), Q6_K_TYPE: (_Q6_K_GROUP, False),
            Q4_K_TYPE: (_BLOCK, True)}
# The decoder linears (HF names) that --quantization gguf-groups keeps as groups.
_DECODER_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
GROUP_PARTS = ("values", "scale", "offset")  # stored as `<weight name>_<part>`, in this order
# The families whose layers the decoder loader fills (models/loaders/loader._fill): their
# linears are the plain q, k, v, o, gate, up, down that the groups replace.
GROUP_FAMILIES = ("gemma3", "llama", "cohere2", "olmo3", "exaone4")


def int8_groups(ggml_type: int, type_name: str, raw: np.ndarray, rows: int, cols: int) -> Int8Groups:
    """The groups of a Q8_0, Q5_0, Q6_K or Q4_K tensor's bytes `raw` (rows x cols weights,
    cols along the row as GGUF stores them); ConfigError naming `type_name` for any other
    type (not int8 values with a scale per group)."""
    reader = _READERS.get(ggml_type)
    if reader is None:
        raise ConfigError(f"int8 groups are read from Q8_0, Q5_0, Q6_K and Q4_K tensors, not {type_name}")
    return reader(raw, rows, cols)


def check_group_family(family: str, architecture: str) -> None:
    """ConfigError unless `family` is one of GROUP_FAMILIES (`architecture`: the GGUF's name)."""
    if family not in GROUP_FAMILIES:
        raise ConfigError(f"--quantization gguf-groups serves {', '.join(GROUP_FAMILIES)} models, "
                          f"not {architecture}")


def is_decoder_linear(hf_name: str) -> bool:
    """Whether `hf_name` is a decoder layer's q, k, v, o, gate, up or down weight."""
    return _DECODER_LINEAR.fullmatch(hf_name) is not None


def group_parts(hf_name: str, gguf_name: str, type_name: str, ggml_type: int, rows: int, cols: int
                ) -> list[tuple[str, tuple[int, int], str]]:
    """(name, shape, numpy dtype) of each part a `rows` x `cols` tensor of `ggml_type` is
    stored as, in GROUP_PARTS order; ConfigError naming the GGUF tensor and its type where
    that type is not int8 groups."""
    layout = _LAYOUTS.get(ggml_type)
    if layout is None:
        raise ConfigError(f"--quantization gguf-groups reads Q8_0, Q5_0, Q6_K and Q4_K tensors; "
                          f"{gguf_name} is {type_name}")
    group_size, has_offset = layout
    if cols % group_size:
        raise ConfigError(f"{gguf_name}: rows of {cols} weights are not whole groups of {group_size}")
    shapes = [(rows, cols), (rows, cols // group_size)] + ([(rows, cols // group_size)] if has_offset else [])
    return [(f"{hf_name}_{part}", shape, dtype)
            for part, shape, dtype in zip(GROUP_PARTS, shapes, ("int8", "float32", "float32"))]


def row_order(fix: Callable[[np.ndarray], np.ndarray], gguf_name: str, rows: int) -> np.ndarray | None:
    """The row permutation the conversion's fix-up `fix` (values [rows, cols] -> values)
    applies, found by fixing the row indices themselves; None where it leaves the rows as
    they are. ConfigError where it does more than reorder rows (groups cannot follow a
    change of values)."""
    index = np.arange(rows, dtype=np.float32).reshape(rows, 1)  # exact in float32 below 2**24 rows
    fixed = np.asarray(fix(index)).reshape(-1)
    order = fixed.astype(np.int64)
    if fixed.shape != (rows,) or not np.array_equal(order, fixed) or not np.array_equal(np.sort(order), index[:, 0]):
        raise ConfigError(f"--quantization gguf-groups cannot keep {gguf_name} as groups: "
                          "its conversion changes values, not only the order of its rows")
    return None if np.array_equal(order, index[:, 0]) else order
