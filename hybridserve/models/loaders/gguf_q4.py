"""GGUF Q4_K blocks as int4 groups: the form torch's packed int4 CPU kernel multiplies.

A Q4_K super-block covers QK_K = 256 consecutive weights of a row in 144 bytes: fp16 `d`
and `dmin`, 12 bytes of 6-bit sub-block scales `sc` and mins `m` (8 of each), and 128
bytes of 4-bit values `q`. Sub-block j (32 weights) dequantizes as w = d*sc_j*q - dmin*m_j.
The 64 weights of sub-blocks 2i and 2i+1 share 32 bytes of `q`: the low nibbles hold
sub-block 2i, the high nibbles sub-block 2i+1 (ggml's dequantize_row_q4_K).

That is int4 with one scale and one offset per group of 32: with the kernel's form
w = (q - 8) * scale + offset, scale = d*sc_j and offset = 8*scale - dmin*m_j. Both are
computed in float32 from an fp16 and a 6-bit integer, so they are exact in float32; the
kernel takes them in bf16, which rounds them (models/layers/int4.py).

`--quantization q4` does not read these blocks: it loads the GGUF's conversion to
dequantized tensors (gguf_loader.py) and quantizes those again per group by min and max
(`--quantization gguf-groups` reads them, as int8 groups: gguf_groups.py).
That gives back the file's 4-bit values for 79% of the default model's Q4_K groups (the
others span less than the full 0..15); reading these blocks instead needs the conversion to
keep them, as it keeps gpt-oss's MXFP4 experts.
"""

from __future__ import annotations

import numpy as np

from hybridserve.core.errors import ConfigError

Q4_K_TYPE = 12  # ggml_type GGML_TYPE_Q4_K
QK_K = 256  # weights per super-block
Q4_K_BLOCK_BYTES = 144  # 2 fp16 + 12 scale bytes + 128 value bytes
SUB_BLOCKS = 8  # sub-blocks of 32 weights per super-block
_MIDPOINT = 8  # the int4 kernel subtracts this from each value before scaling


def _scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of each super-block, from its 12 bytes [B, 12] (ggml's
    get_scale_min_k4): sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7
    (mins); sub-blocks 4-7 with their low 4 bits in the nibbles of bytes 8-11 and their
    top 2 bits in the top 2 bits of bytes 0-3 (scales) and 4-7 (mins)."""
    p = packed.astype(np.int32)
    scales = np.concatenate([p[:, 0:4] & 63, (p[:, 8:12] & 15) | ((p[:, 0:4] >> 6) << 4)], axis=1)
    mins = np.concatenate([p[:, 4:8] & 63, (p[:, 8:12] >> 4) | ((p[:, 4:8] >> 6) << 4)], axis=1)
    return scales, mins


def whole_blocks(raw: np.ndarray, rows: int, cols: int, weights: int, block_bytes: int, name: str,
                 unit: str = "blocks") -> np.ndarray:
    """A `name` tensor's bytes `raw` (rows x cols weights) as [blocks, block_bytes] uint8,
    `weights` per block; ConfigError where a row is not whole blocks or the size is not theirs."""
    if cols % weights:
        raise ConfigError(f"a {name} tensor's rows must be whole {unit} of {weights} weights, got {cols}")
    flat = np.asarray(raw, dtype=np.uint8).reshape(-1)
    expected = rows * cols // weights * block_bytes
    if flat.size != expected:
        raise ConfigError(f"a {rows} x {cols} {name} tensor takes {expected} bytes, got {flat.size}")
    return flat.reshape(-1, block_bytes)


def q4_k_parts(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values 0..15 uint8 [rows, cols], scale d*sc float32 [rows, cols/32], negative_min
    -dmin*m float32 [rows, cols/32]) with weight = values * scale + negative_min, from a Q4_K
    tensor's bytes `raw` (rows x cols weights, cols along the row as GGUF stores them).
    Both are exact in float32 (an fp16 times a 6-bit integer)."""
    blocks = whole_blocks(raw, rows, cols, QK_K, Q4_K_BLOCK_BYTES, "Q4_K", "super-blocks")
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [B, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = _scales_and_mins(blocks[:, 4:16])
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32)  # 4 pairs of sub-blocks, 32 bytes each
    values = np.concatenate([qs & 15, qs >> 4], axis=2)  # [B, 4, 2, 32]: sub-blocks 2i, 2i+1
    return (values.reshape(rows, cols), (d * sc).reshape(rows, cols // 32).astype(np.float32),
            (-(dmin * m)).reshape(rows, cols // 32).astype(np.float32))


def q4_k_groups(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values 0..15 uint8 [rows, cols], scale float32 [rows, cols/32], offset float32
    [rows, cols/32]) with weight = (values - 8) * scale + offset (the int4 kernel's form),
    from a Q4_K tensor's bytes `raw` (q4_k_parts)."""
    values, scale, negative_min = q4_k_parts(raw, rows, cols)
    return values, scale, _MIDPOINT * scale + negative_min


def int4_groups(ggml_type: int, type_name: str, raw: np.ndarray, rows: int, cols: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q4_k_groups for a Q4_K tensor; ConfigError naming `type_name` for any other type
    (their values are not 4-bit groups with a scale and an offset)."""
    if ggml_type != Q4_K_TYPE:
        raise ConfigError(f"int4 groups are read from Q4_K tensors only, not {type_name}")
    return q4_k_groups(raw, rows, cols)
