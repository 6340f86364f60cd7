"""int8 x int8 matmuls on AMX's integer tiles (models/layers/int8_amx.py, int8_amx.c): the
tile layout by hand (every CPU), which CPUs take the path, and where the kernel runs, its
products by hand and against the other int8 paths bit for bit, for all shapes and row
counts across the kernel's row tiles and paddings (hypothesis)."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from hybridserve.models.layers.int8 import (  # noqa: E402
    AMX,
    PACKED,
    W8A8Linear,
    choose_int8_path,
    int8_gemm_available,
    quantize_gemm_weight,
    quantize_rows_int8,
    quantize_rows_uint8,
)
from hybridserve.models.layers import int8_amx  # noqa: E402
from hybridserve.models.layers.int8_amx import AmxWeight, amx_kernel, pack, unpack  # noqa: E402

KERNEL = amx_kernel()
needs_amx = pytest.mark.skipif(KERNEL is None or not int8_gemm_available(),
                               reason="no AMX int8 tiles (or no compiler): the kernel does not run here")


def test_the_tiles_hold_each_weight_where_the_kernel_reads_it() -> None:
    # w[n, k] = a distinct value per (n, k) mod 127; tile t, block b, row r, column c,
    # quad j holds w[16 t + c, 64 b + 4 r + j]; n and k are padded with zeros to 32 x 128
    n, k = 20, 70
    w = ((torch.arange(n)[:, None] * 31 + torch.arange(k)[None, :] * 7) % 127).to(torch.int8)
    packed = pack(w)
    assert packed.tiles.shape == (2, 2, 16, 16, 4) and (packed.n, packed.k, packed.padded_k) == (20, 70, 128)
    tiles = packed.tiles
    assert int(tiles[0, 0, 0, 0, 0]) == 0  # w[0, 0]
    assert int(tiles[0, 0, 0, 1, 0]) == 31  # w[1, 0]
    assert int(tiles[0, 0, 1, 0, 2]) == (6 * 7) % 127  # w[0, 6]: row 1, quad 2
    assert int(tiles[1, 0, 3, 2, 1]) == (18 * 31 + 13 * 7) % 127  # w[18, 13]
    assert int(tiles[0, 1, 1, 5, 1]) == (5 * 31 + 69 * 7) % 127  # w[5, 69]: block 1, row 1, quad 1
    assert int(tiles[0, 1, 1, 5, 2]) == 0  # k = 70: padding
    assert int(tiles[1, 0, 0, 4, 0]) == 0  # n = 20: padding
    assert torch.equal(unpack(packed), w)


def test_the_amx_path_is_taken_only_with_amx_int8_and_its_kernel() -> None:
    amx, vnni = {"avx2", "avx512f", "avx512_vnni", "amx_int8"}, {"avx2", "avx512f", "avx512_vnni"}
    assert choose_int8_path(amx, fbgemm=True, amx=True) == AMX
    assert choose_int8_path(amx, fbgemm=True, amx=False) == PACKED  # no kernel built
    assert choose_int8_path(vnni, fbgemm=True, amx=True) == PACKED  # no tiles on this CPU


def test_without_the_tile_state_there_is_no_kernel_and_no_warning(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    # A CPU with amx_int8 under a Linux that does not grant the tile state (before 5.16):
    # the other int8 paths serve, which is not worth a warning
    class Denied:
        ready = False

    monkeypatch.setattr(int8_amx, "AmxKernel", Denied)
    monkeypatch.setattr(int8_amx, "read_cpu_flags", lambda: frozenset({"avx512f", "amx_int8"}))
    with caplog.at_level(logging.WARNING):
        assert int8_amx.amx_kernel.__wrapped__() is None
    assert not caplog.records


def test_a_weight_that_is_not_int8_rows_is_refused() -> None:
    with pytest.raises(ValueError, match="2-d int8"):
        pack(torch.zeros(4, 4))


@needs_amx
def test_products_by_hand() -> None:
    assert KERNEL is not None
    # all-ones x all-twos over k = 64: 128 per output, times scale 0.5 -> 64; row 2 has -1s
    x = torch.ones(3, 64, dtype=torch.int8)
    x[2] = -1
    w = torch.full((17, 64), 2, dtype=torch.int8)
    out = KERNEL(x, pack(w), torch.full((17,), 0.5))
    assert out.shape == (3, 17) and out[:2].eq(64.0).all() and out[2].eq(-64.0).all()
    # with the input rows' scales 1, 2, 0.25: 64, 128, -16
    scaled = KERNEL(x, pack(w), torch.full((17,), 0.5), torch.tensor([[1.0], [2.0], [0.25]]))
    assert scaled[0].eq(64.0).all() and scaled[1].eq(128.0).all() and scaled[2].eq(-16.0).all()
    # 127 x 127 over k = 1089: 17,564,481, past float32's 2^24, rounds to even: 17,564,480
    big = KERNEL(torch.full((1, 1089), 127, dtype=torch.int8), pack(torch.full((16, 1089), 127, dtype=torch.int8)),
                 torch.ones(16))
    assert big.eq(17_564_480.0).all()


@needs_amx
def test_bad_input_is_refused() -> None:
    assert KERNEL is not None
    weight = pack(torch.ones(16, 64, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"int8 \[rows, 64\]"):
        KERNEL(torch.ones(2, 32, dtype=torch.int8), weight, torch.ones(16))
    with pytest.raises(ValueError, match="scale"):
        KERNEL(torch.ones(2, 64, dtype=torch.int8), weight, torch.ones(8))
    with pytest.raises(ValueError, match="row scale"):
        KERNEL(torch.ones(2, 64, dtype=torch.int8), weight, torch.ones(16), torch.ones(3, 1))
    assert isinstance(weight, AmxWeight)


@needs_amx
@settings(max_examples=30, deadline=None)
@given(st.integers(1, 80), st.sampled_from([8, 64, 100, 640]), st.sampled_from([7, 16, 96, 200]),
       st.integers(0, 2**31))
def test_the_amx_path_agrees_with_the_other_paths_bit_for_bit(rows: int, k: int, n: int, seed: int) -> None:
    # rows past each 16-row tile and 64-row block, k and n past whole blocks and tiles
    g = torch.Generator().manual_seed(seed)
    linear = W8A8Linear(*quantize_gemm_weight(torch.randn(n, k, generator=g)))
    x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 10
    expected = linear.packed(*quantize_rows_uint8(x))
    assert torch.equal(linear.amx(x), expected)
    assert torch.equal(linear.plain(x), expected)
    values, scale = quantize_rows_int8(x)
    assert torch.equal(linear.quantized(AMX, values, scale), expected)


def _raw_kernel() -> int8_amx.AmxKernel | None:
    """The kernel as built, without amx_kernel()'s own check (which these tests stand beside)."""
    if "amx_int8" not in int8_amx.read_cpu_flags():
        return None
    try:
        kernel = int8_amx.AmxKernel()
    except (OSError, RuntimeError):  # no compiler here
        return None
    return kernel if kernel.ready else None


RAW = _raw_kernel()


@pytest.mark.skipif(RAW is None, reason="no AMX int8 tiles (or no compiler): the kernel does not run here")
@pytest.mark.parametrize("k", [640, 200])  # whole blocks of k; padded to 256
@pytest.mark.parametrize("with_row_scale", [True, False])
def test_a_span_computed_again_is_the_product_bit_for_bit(k: int, with_row_scale: bool) -> None:
    # Two chunks (2 and 3 spans) of weights and inputs reaching +-127 (sums past 24 bits):
    # each span of each row as int8_amx_fill_span computes it, against torch._int_mm's
    # product with the same two scalings, and the summaries-only call against span_logits'.
    assert RAW is not None
    g = torch.Generator().manual_seed(k)
    rows = 5
    weights = [torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g) for n in (256, 384)]
    weights[0][3] = 127
    scales = [torch.rand(w.shape[0], generator=g) + 0.5 for w in weights]
    x = torch.randint(-127, 128, (rows, k), dtype=torch.int8, generator=g)
    x[1] = 127
    x[2] = -127
    row_scale = torch.rand(rows, 1, generator=g) + 0.5 if with_row_scale else None
    chunks = [int8_amx.AmxProduct(RAW, pack(w), s) for w, s in zip(weights, scales)]
    source = int8_amx.AmxSpanSource(chunks, x, row_scale)
    assert source.spans == 5 and source.rows == rows
    product = torch.cat([torch._int_mm(x, w.t()).float().mul(s) for w, s in zip(weights, scales)], dim=1)
    if row_scale is not None:
        product.mul_(row_scale)
    for r in range(rows):
        for j in range(5):
            assert torch.equal(source.span(r, j), product[r, j * 128 : (j + 1) * 128]), (r, j)
    inv_t = torch.linspace(0.5, 2.0, rows)
    for chunk in chunks:
        _, peak, mass = chunk.span_logits(x, row_scale, inv_t, -87.0)
        alone = chunk.span_summaries(x, row_scale, inv_t, -87.0)
        assert torch.equal(alone[0], peak) and torch.equal(alone[1], mass)


@pytest.mark.skipif(RAW is None, reason="no AMX int8 tiles (or no compiler): the kernel does not run here")
def test_a_span_source_refuses_chunks_it_cannot_serve() -> None:
    assert RAW is not None
    w = torch.ones(128, 64, dtype=torch.int8)
    x = torch.ones(2, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="whole spans"):
        int8_amx.AmxSpanSource([int8_amx.AmxProduct(RAW, pack(w[:100]), torch.ones(100))], x, None)
    with pytest.raises(ValueError, match="share one kernel and k"):
        int8_amx.AmxSpanSource([int8_amx.AmxProduct(RAW, pack(w), torch.ones(128)),
                                int8_amx.AmxProduct(RAW, pack(torch.ones(128, 128, dtype=torch.int8)), torch.ones(128))],
                               x, None)
