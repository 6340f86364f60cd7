"""MXFP4 unpacking (models/loaders/mxfp4.py) against values worked out by hand from the format:
e2m1 nibbles (sign bit 3, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), low nibble first, one
e8m0 scale 2^(s - 127) per 32 values."""

from __future__ import annotations

import pytest
import torch

from hybridserve.core.errors import ConfigError
from hybridserve.models.loaders.mxfp4 import dequantize_mxfp4
from tests.helpers import mxfp4_pack


def _block(first_bytes: list[int]) -> list[int]:
    return first_bytes + [0] * (16 - len(first_bytes))


def test_hand_made_blocks() -> None:
    # Row 0, scale 127 (2^0): 0x10 -> low 0 (0.0), high 1 (0.5); 0xF9 -> low 9 (-0.5), high 15 (-6);
    # 0x8A -> low 10 (-1.0), high 8 (-0.0); 0x73 -> low 3 (1.5), high 7 (6.0).
    # Row 1, scale 125 (2^-2): 0x54 -> low 4 (2.0 -> 0.5), high 5 (3.0 -> 0.75); 0xE6 -> low 6
    # (4.0 -> 1.0), high 14 (-4.0 -> -1.0). Row 2, scale 130 (2^3): 0x2C -> low 12 (-2 -> -16), high 2 (1 -> 8).
    blocks = torch.tensor([[_block([0x10, 0xF9, 0x8A, 0x73])], [_block([0x54, 0xE6])], [_block([0x2C])]],
                          dtype=torch.uint8)
    scales = torch.tensor([[127], [125], [130]], dtype=torch.uint8)
    out = dequantize_mxfp4(blocks, scales)
    assert out.shape == (3, 32) and out.dtype == torch.float32
    assert out[0, :8].tolist() == [0.0, 0.5, -0.5, -6.0, -1.0, -0.0, 1.5, 6.0]
    assert torch.signbit(out[0, 5])  # code 8 is negative zero
    assert out[1, :4].tolist() == [0.5, 0.75, 1.0, -1.0]
    assert out[2, :2].tolist() == [-16.0, 8.0]
    assert out[:, 8:].abs().sum().item() == 0.0 and out[1:, 4:].abs().sum().item() == 0.0


def test_second_block_of_a_row_uses_its_own_scale() -> None:
    blocks = torch.tensor([[_block([0x11]), _block([0x11])]], dtype=torch.uint8)  # both 0.5, 0.5
    scales = torch.tensor([[127, 129]], dtype=torch.uint8)  # 1 and 4
    out = dequantize_mxfp4(blocks, scales)
    assert out.shape == (1, 64)
    assert out[0, :2].tolist() == [0.5, 0.5] and out[0, 32:34].tolist() == [2.0, 2.0]


def test_extreme_scales_and_bfloat16() -> None:
    blocks = torch.tensor([[_block([0x77])], [_block([0x22])]], dtype=torch.uint8)  # 6, 6 and 1, 1
    scales = torch.tensor([[127 + 100], [127 - 120]], dtype=torch.uint8)
    out = dequantize_mxfp4(blocks, scales, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert out[0, 0].item() == 6.0 * 2.0**100 and out[1, 1].item() == 2.0**-120


def test_packed_random_matrix_round_trips() -> None:
    codes, exps = mxfp4_pack.random_codes((3, 5, 96), torch.Generator().manual_seed(0))
    blocks, scales = mxfp4_pack.pack(codes, exps)
    assert blocks.shape == (3, 5, 3, 16) and scales.shape == (3, 5, 3)
    assert torch.equal(dequantize_mxfp4(blocks, scales), mxfp4_pack.values(codes, exps))


@pytest.mark.parametrize("blocks_shape,scales_shape,dtype", [
    ((2, 3, 16), (2, 4), torch.uint8),
    ((2, 3, 8), (2, 3), torch.uint8),
    ((2, 3, 16), (2, 3), torch.int8),
])
def test_malformed_tensors_are_config_errors(blocks_shape: tuple, scales_shape: tuple, dtype: torch.dtype) -> None:
    with pytest.raises(ConfigError, match="MXFP4"):
        dequantize_mxfp4(torch.zeros(blocks_shape, dtype=dtype), torch.zeros(scales_shape, dtype=torch.uint8))
