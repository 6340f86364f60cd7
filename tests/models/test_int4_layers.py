"""int4 groups: a Q4_K block read by hand (models/loaders/gguf_q4.py), the int4 linear's two
paths against float32 products (models/layers/int4.py), and the errors of bad input."""

from __future__ import annotations

import numpy as np
import pytest

from hybridserve.core.errors import ConfigError
from hybridserve.models.loaders.gguf_q4 import Q4_K_BLOCK_BYTES, Q4_K_TYPE, QK_K, int4_groups, q4_k_groups

torch = pytest.importorskip("torch")

# One hand-made Q4_K super-block (ggml's block_q4_K): d = 0.5, dmin = 0.25, six-bit scales
# and mins per sub-block of 32, sub-blocks 4-7 with bits above the low 4 (stored in the top
# 2 bits of bytes 0-7), and a few 4-bit values set.
D, DMIN = 0.5, 0.25
SCALES = [1, 2, 3, 4, 33, 40, 63, 5]
MINS = [0, 1, 2, 3, 17, 48, 63, 6]


def _q4_k_block(values: dict[int, int]) -> np.ndarray:
    """The 144 bytes of the super-block above, `values` {position in 0..255: 4-bit value}
    (others 0), laid out as GGUF's spec says: bytes 0-3 scales 0-3 (low 6 bits) with the top
    2 bits of scales 4-7; bytes 4-7 the same for the mins; bytes 8-11 low nibble scale 4+i,
    high nibble min 4+i; then 128 bytes, 32 per pair of sub-blocks (2i low nibbles, 2i+1 high)."""
    block = np.zeros(Q4_K_BLOCK_BYTES, np.uint8)
    block[0:2] = np.frombuffer(np.float16(D).tobytes(), np.uint8)
    block[2:4] = np.frombuffer(np.float16(DMIN).tobytes(), np.uint8)
    for i in range(4):
        block[4 + i] = SCALES[i] | (SCALES[4 + i] >> 4) << 6
        block[8 + i] = MINS[i] | (MINS[4 + i] >> 4) << 6
        block[12 + i] = (SCALES[4 + i] & 15) | (MINS[4 + i] & 15) << 4
    for position, value in values.items():
        sub_block, within = divmod(position, 32)
        byte = 16 + 32 * (sub_block // 2) + within
        block[byte] |= value << (4 * (sub_block % 2))
    return block


def test_q4_k_block_unpacks_to_the_hand_computed_groups() -> None:
    # Position 133: sub-block 4 (scale 33, min 17), value 3; position 165: sub-block 5
    # (scale 40, min 48), value 10, in the high nibble of the same byte; 7: sub-block 0.
    block = _q4_k_block({133: 3, 165: 10, 7: 15, 255: 9})
    values, scale, offset = q4_k_groups(block, 1, QK_K)
    assert values[0, 133] == 3 and values[0, 165] == 10 and values[0, 7] == 15 and values[0, 255] == 9
    assert values.sum() == 3 + 10 + 15 + 9
    assert scale[0].tolist() == [0.5, 1.0, 1.5, 2.0, 16.5, 20.0, 31.5, 2.5]  # d * sc
    weight = (values.astype(np.float32) - 8) * np.repeat(scale, 32, 1) + np.repeat(offset, 32, 1)
    assert weight[0, 133] == 0.5 * 33 * 3 - 0.25 * 17 == 45.25
    assert weight[0, 165] == 0.5 * 40 * 10 - 0.25 * 48 == 188.0
    assert weight[0, 7] == 0.5 * 1 * 15 - 0 == 7.5
    assert weight[0, 255] == 0.5 * 5 * 9 - 0.25 * 6 == 21.0
    assert weight[0, 0] == 0.0 and weight[0, 200] == -0.25 * 63  # value 0: minus the sub-block's min


def test_q4_k_groups_match_the_gguf_package_dequantizer() -> None:
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (4, 2 * Q4_K_BLOCK_BYTES), dtype=np.uint8)  # 4 rows x 512 weights
    for row in raw:  # finite fp16 d and dmin (random bytes could be inf / nan)
        for start in (0, Q4_K_BLOCK_BYTES):
            row[start:start + 4] = np.frombuffer(np.float16([0.01, 0.002]).tobytes(), np.uint8)
    values, scale, offset = q4_k_groups(raw, 4, 2 * QK_K)
    ours = (values.astype(np.float32) - 8) * np.repeat(scale, 32, 1) + np.repeat(offset, 32, 1)
    theirs = gguf.dequantize(raw, gguf.GGMLQuantizationType.Q4_K).reshape(4, 2 * QK_K)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6 * np.abs(theirs).max())


def _bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """|error| allowed per output: the output's rounding to bf16 and the weight's (for the
    dequantized path) are each at most 2^-9 relative, so 2^-8 of sum |x| |w|."""
    return 2.0 ** -8 * (x.float().abs() @ weight.abs().t()) + 1e-6


@pytest.mark.parametrize("rows", [1, 3, 200])  # 200 > KERNEL_MAX_ROWS: the dequantized path
def test_int4_linear_equals_the_float32_product_of_its_groups(rows: int) -> None:
    from hybridserve.models.layers.head import dequantize_int4_groups, quantize_int4_groups
    from hybridserve.models.layers.int4 import KERNEL_MAX_ROWS, Int4Linear, packed_layout_known

    g = torch.Generator().manual_seed(0)
    values, scale, offset = quantize_int4_groups(torch.randn(80, 96, generator=g))  # 64 + 16 rows: both layouts
    linear = Int4Linear(values, scale, offset)
    weight = dequantize_int4_groups(values, scale.bfloat16().float(), offset.bfloat16().float())  # as held
    x = torch.randn(rows, 96, generator=g).bfloat16()
    reference = x.float() @ weight.t()
    # The dequantized path reads torch's packed bytes in the layout its AVX-512 kernels
    # write; where this CPU's kernels write another (AVX2 alone), every row count takes the
    # kernel and that path is never called.
    known = packed_layout_known()
    for path in (linear, linear.kernel) + ((linear.dequantized,) if known else ()):
        got = path(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 80)
        assert ((got.float() - reference).abs() <= _bound(x, weight)).all()
    assert (rows > KERNEL_MAX_ROWS) == (rows == 200)
    if known:
        assert torch.equal(linear.weight(), weight.bfloat16())  # the unpacked layout is the one packed


def test_int4_linear_holds_a_q4_k_tensor_up_to_the_bf16_rounding_of_its_scales() -> None:
    from hybridserve.models.layers.int4 import Int4Linear

    rows = 16
    block = _q4_k_block({i: (7 * i) % 16 for i in range(QK_K)})
    values, scale, offset = q4_k_groups(np.tile(block, rows), rows, QK_K)
    weight = torch.from_numpy((values.astype(np.float32) - 8) * np.repeat(scale, 32, 1) + np.repeat(offset, 32, 1))
    linear = Int4Linear(*(torch.from_numpy(a) for a in (values.astype(np.int32), scale, offset)))
    x = torch.randn(2, QK_K, generator=torch.Generator().manual_seed(1)).bfloat16()
    # Each weight moves by the bf16 rounding of its scale and offset: at most
    # 2^-9 * (8 * scale + |offset|); then the output's own rounding (_bound).
    moved = 2.0 ** -9 * torch.from_numpy(np.repeat(8 * scale + np.abs(offset), 32, 1))
    allowed = _bound(x, weight) + x.float().abs() @ moved.t()
    assert ((linear.kernel(x).float() - x.float() @ weight.t()).abs() <= allowed).all()


def test_bad_input_is_a_config_error_naming_it() -> None:
    from hybridserve.models.layers.int4 import Int4Linear, make_int4_linear

    with pytest.raises(ConfigError, match=r"hidden size \(100\) to be a multiple of 32"):
        make_int4_linear(torch.randn(64, 100), None)
    with pytest.raises(ConfigError, match="multiple of 16.*got 40"):
        make_int4_linear(torch.randn(40, 64), None)
    with pytest.raises(ConfigError, match="Q4_K tensors only, not Q5_0"):
        int4_groups(6, "Q5_0", np.zeros(22, np.uint8), 1, 32)
    with pytest.raises(ConfigError, match="whole super-blocks of 256 weights, got 128"):
        int4_groups(Q4_K_TYPE, "Q4_K", np.zeros(72, np.uint8), 1, 128)
    with pytest.raises(ConfigError, match="takes 144 bytes, got 100"):
        q4_k_groups(np.zeros(100, np.uint8), 1, QK_K)
    assert Int4Linear  # the class the factory builds


def test_q4_mode_is_a_named_quantization() -> None:
    from hybridserve.config import QUANTIZATIONS, EngineConfig
    from hybridserve.models.layers.head import INT4_LAYERS

    assert INT4_LAYERS in QUANTIZATIONS
    with pytest.raises(ConfigError, match="quantization must be one of .*q4"):
        EngineConfig(quantization="q5")
