"""GGUF blocks as int8 groups (models/loaders/gguf_groups.py): the gguf package's dequantizer
reproduced exactly, single blocks read by hand, and the errors of bad input."""

from __future__ import annotations

import numpy as np
import pytest

from hybridserve.core.errors import ConfigError
from hybridserve.models.loaders.gguf_groups import (Q5_0_TYPE, Q6_K_TYPE, Q8_0_TYPE, Int8Groups, int8_groups,
                                                    q5_0_groups, q6_k_groups)
from hybridserve.models.loaders.gguf_q4 import Q4_K_TYPE

# ggml_type: (weights per block, bytes per block, byte offsets of the block's fp16 fields)
FORMATS = {Q8_0_TYPE: (32, 34, (0,)), Q5_0_TYPE: (32, 22, (0,)), Q6_K_TYPE: (256, 210, (208,)),
           Q4_K_TYPE: (256, 144, (0, 2))}


def _random_blocks(ggml_type: int, rows: int, blocks_per_row: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes of `rows` rows, each `blocks_per_row` blocks, with finite fp16 fields
    (random bytes there could be inf or NaN) of either sign and several binades."""
    _, block_bytes, fp16_fields = FORMATS[ggml_type]
    raw = rng.integers(0, 256, (rows * blocks_per_row, block_bytes), dtype=np.uint8)
    for start in fp16_fields:
        values = (rng.uniform(-1, 1, len(raw)) * 2.0 ** rng.integers(-14, 2, len(raw))).astype(np.float16)
        raw[:, start:start + 2] = values.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("ggml_type", sorted(FORMATS))
def test_groups_reproduce_the_gguf_package_dequantizer_exactly(ggml_type: int) -> None:
    gguf = pytest.importorskip("gguf")
    rows, blocks_per_row = 3, 2
    weights_per_block = FORMATS[ggml_type][0]
    raw = _random_blocks(ggml_type, rows, blocks_per_row, np.random.default_rng(ggml_type))
    groups = int8_groups(ggml_type, "test", raw, rows, blocks_per_row * weights_per_block)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(ggml_type))
    assert groups.values.dtype == np.int8 and groups.scale.dtype == np.float32
    assert expected.shape == groups.values.shape
    np.testing.assert_array_equal(groups.weight(), expected)


def test_q5_0_block_read_by_hand() -> None:
    # d = 0.5; weight 3: low nibble 5 of byte 3 with bit 3 of qh set: (5 + 16 - 16) * 0.5;
    # weight 19: high nibble 2 of byte 3, bit 19 clear: (2 - 16) * 0.5; weight 31: high
    # nibble 15 of byte 15 with bit 31 set: (31 - 16) * 0.5; every other value 0: -16 * 0.5.
    block = np.zeros(22, np.uint8)
    block[0:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    block[2:6] = np.frombuffer(np.uint32((1 << 3) | (1 << 31)).tobytes(), np.uint8)
    block[6 + 3] = 5 | 2 << 4
    block[6 + 15] = 15 << 4
    weight = q5_0_groups(block, 1, 32).weight()[0]
    assert weight[3] == 2.5 and weight[19] == -7.0 and weight[31] == 7.5
    assert weight[0] == -8.0 and weight[16] == -8.0


def test_q6_k_block_read_by_hand() -> None:
    # d = 0.25, sub-block scales 1..16 (scale 16 is sub-block 15: weights 240-255). Weight
    # 128 + 64 + 5 = 197 (second half, third quarter, l = 5): ql[64 + 5]'s high nibble 9,
    # qh[32 + 5] bits 4-5 = 2: q = 9 + 32 - 32 = 9 in sub-block 12: 0.25 * 13 * 9.
    # Weight 255 (second half, fourth quarter, l = 31): ql[64 + 32 + 31]'s high nibble 0,
    # qh[32 + 31] bits 6-7 = 0: q = -32 in sub-block 15: 0.25 * 16 * -32.
    block = np.zeros(210, np.uint8)
    block[64 + 5] = 9 << 4
    block[128 + 32 + 5] = 2 << 4
    block[192:208] = np.arange(1, 17, dtype=np.int8).view(np.uint8)
    block[208:210] = np.frombuffer(np.float16(0.25).tobytes(), np.uint8)
    groups = q6_k_groups(block, 1, 256)
    assert groups.group_size == 16 and groups.scale[0].tolist() == [0.25 * s for s in range(1, 17)]
    weight = groups.weight()[0]
    assert weight[197] == 0.25 * 13 * 9 and weight[255] == 0.25 * 16 * -32


def test_q4_k_groups_carry_the_minimum_as_offset() -> None:
    raw = _random_blocks(Q4_K_TYPE, 1, 1, np.random.default_rng(1))
    groups = int8_groups(Q4_K_TYPE, "Q4_K", raw, 1, 256)
    assert groups.offset is not None and groups.group_size == 32
    assert groups.values.min() >= 0 and groups.values.max() <= 15


def test_bad_input_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="not F16"):
        int8_groups(1, "F16", np.zeros(64, np.uint8), 1, 32)
    with pytest.raises(ConfigError, match="whole blocks of 32"):
        int8_groups(Q8_0_TYPE, "Q8_0", np.zeros(34, np.uint8), 1, 40)
    with pytest.raises(ConfigError, match="takes 44 bytes, got 22"):
        int8_groups(Q5_0_TYPE, "Q5_0", np.zeros(22, np.uint8), 1, 64)
    with pytest.raises(ConfigError, match="whole blocks of 256"):
        int8_groups(Q6_K_TYPE, "Q6_K", np.zeros(210, np.uint8), 1, 128)


def test_weight_adds_the_offset_per_group() -> None:
    values = np.array([[1, -2, 3, 4]], np.int8)
    groups = Int8Groups(values, np.array([[0.5, 2.0]], np.float32), np.array([[1.0, -1.0]], np.float32), 2)
    assert groups.weight().tolist() == [[1.5, 0.0, 5.0, 7.0]]
