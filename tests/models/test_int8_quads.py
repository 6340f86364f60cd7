"""models/layers/int8_quads.py: the layout by hand, the kernel's products by hand, at the
int16 pairs' saturation edge (AVX2) and at the full 127 levels (AVX512-VNNI, where the build
has it), against exact sums for all shapes (hypothesis), bad input; sampling's span logits from the product
equal to the product then the summary kernel's pass, bit for bit; the summaries alone equal
to them, and the logits they leave unstored computed again a span at a time or whole, bit for
bit."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from hybridserve.models.layers.int8_quads import (  # noqa: E402
    QUAD,
    TILE,
    QuadsSpanSource,
    fill_quads,
    pack_quads,
    quads_fit,
    quads_kernel,
    quads_matmul,
    unpack_quads,
    zero_quads,
)
from hybridserve.models.layers.span_logits import EXP_FLOOR, SPAN  # noqa: E402
from hybridserve.models.layers.span_native import NativeSummaries  # noqa: E402

KERNEL = quads_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no int8_quads kernel here (no AVX2 or no compiler)")


def test_layout_by_hand() -> None:
    # value (n, k) = 10 * (n % 4) + k
    values = torch.tensor([[(n % 4) * 10 + k for k in range(8)] for n in range(TILE)], dtype=torch.int8)
    weight = pack_quads(values, torch.ones(TILE))
    assert weight.values.shape == (1, 2, TILE, QUAD)  # [N / TILE, K / QUAD, TILE, QUAD]
    assert weight.values[0, 0, 5].tolist() == [10, 11, 12, 13]  # column 5 (5 % 4 = 1), k 0..3
    assert weight.values[0, 1, 2].tolist() == [24, 25, 26, 27]  # column 2, k 4..7
    # column n's sum: 8 * 10 * (n % 4) + (0 + ... + 7)
    assert weight.colsum.tolist() == [80 * (n % 4) + 28 for n in range(TILE)]
    assert torch.equal(unpack_quads(weight), values)
    assert torch.equal(unpack_quads(weight.rows(0, TILE)), values)


def test_fill_in_parts_and_views() -> None:
    values = torch.arange(3 * TILE * 4, dtype=torch.int32).remainder(127).sub(63).to(torch.int8).view(3 * TILE, 4)
    scale = torch.arange(3 * TILE, dtype=torch.float32)
    weight = zero_quads(3 * TILE, 4)
    fill_quads(weight, 2 * TILE, values[2 * TILE :], scale[2 * TILE :])  # any order, a block at a time
    fill_quads(weight, 0, values[: 2 * TILE], scale[: 2 * TILE])
    assert torch.equal(unpack_quads(weight), values)
    assert torch.equal(weight.scale, scale)
    middle = weight.rows(TILE, 2 * TILE)
    assert torch.equal(unpack_quads(middle), values[TILE : 2 * TILE])
    assert middle.values.data_ptr() == weight.values.data_ptr() + TILE * 4  # a view, no copy


def test_shapes_and_levels_it_refuses() -> None:
    assert quads_fit(TILE, QUAD) and not quads_fit(TILE + 1, QUAD) and not quads_fit(TILE, QUAD + 2)
    with pytest.raises(ValueError, match="whole tiles"):
        zero_quads(TILE + 8, 8)
    weight = zero_quads(TILE, 8)
    with pytest.raises(ValueError, match="at most 63 levels"):  # 64 x 255 x 2 = 32,640 would saturate int16
        fill_quads(weight, 0, torch.full((TILE, 8), 64, dtype=torch.int8), torch.ones(TILE))
    with pytest.raises(ValueError, match="at most 63 levels"):
        fill_quads(weight, 0, torch.full((TILE, 8), -64, dtype=torch.int8), torch.ones(TILE))
    with pytest.raises(ValueError, match="do not fit"):
        fill_quads(weight, 8, torch.zeros(TILE, 8, dtype=torch.int8), torch.ones(TILE))
    # a VNNI build's kernel takes every level but -128 (max_level 127)
    fill_quads(weight, 0, torch.full((TILE, 8), -127, dtype=torch.int8), torch.ones(TILE), max_level=127)
    assert unpack_quads(weight).eq(-127).all() and weight.colsum.eq(-127 * 8).all()
    with pytest.raises(ValueError, match="at most 127 levels"):
        fill_quads(weight, 0, torch.full((TILE, 8), -128, dtype=torch.int8), torch.ones(TILE), max_level=127)
    with pytest.raises(ValueError, match="whole tiles"):
        weight.rows(0, 8)


@needs_kernel
def test_products_by_hand() -> None:
    # two rows of activations (levels 1, -2, 3, 0 and 127, 127, -127, 1) against column 0 =
    # [5, -1, 2, 7] (scale 0.5) and column 1 = [63, 63, 63, -63] (scale 2); the rest zero
    values = torch.zeros(TILE, 4, dtype=torch.int8)
    values[0] = torch.tensor([5, -1, 2, 7])
    values[1] = torch.tensor([63, 63, 63, -63])
    scale = torch.ones(TILE)
    scale[0], scale[1] = 0.5, 2.0
    x = torch.tensor([[1, -2, 3, 0], [127, 127, -127, 1]]) + 128
    out = KERNEL(x.to(torch.uint8), pack_quads(values, scale))
    # row 0: 5 + 2 + 6 + 0 = 13 -> 6.5; 63 - 126 + 189 - 0 = 126 -> 252
    # row 1: 635 - 127 - 254 + 7 = 261 -> 130.5; 63 * (127 + 127 - 127 - 1) = 7938 -> 15876
    assert out[:, :2].tolist() == [[6.5, 252.0], [130.5, 15876.0]]
    assert out[:, 2:].eq(0).all()


@needs_kernel
def test_products_at_the_int16_pairs_edge() -> None:
    # Every pair at its largest: activations 127 (stored 255) against weights 63, and -127
    # (stored 1) against -63, over 640 k: each column's sum is 640 x 127 x 63 = 5,120,640
    k = 640
    values = torch.full((TILE, k), 63, dtype=torch.int8)
    values[1::2] = -63
    x = torch.full((2, k), 255, dtype=torch.uint8)
    x[1] = 1
    out = KERNEL(x, pack_quads(values, torch.ones(TILE)))
    sign = torch.tensor([1.0, -1.0] * (TILE // 2))
    assert torch.equal(out, torch.stack([sign, -sign]) * 5_120_640.0)


def test_the_kernels_levels_follow_its_build() -> None:
    # 127 where the build has AVX512-VNNI (it is built for this CPU's flags, where the
    # compiler takes them), else 63
    if KERNEL is None:
        pytest.skip("no int8_quads kernel here (no AVX2 or no compiler)")
    from hybridserve.models.platform import native_build
    from hybridserve.models.platform.cpu_features import read_cpu_flags

    flags = native_build._accepted(native_build._compiler(), native_build.isa_flags(read_cpu_flags()))
    assert KERNEL.max_level == (127 if "-mavx512vnni" in flags else 63)


@needs_kernel
def test_products_at_the_full_levels() -> None:
    # VNNI's dot products add u8 x s8 straight into int32: activations 127 (stored 255)
    # against weights 127 and -127 (stored 1) against -127 over 640 k make each column's
    # sum 640 x 127 x 127 = 10,322,560 (exact in float32: below 2^24)
    if KERNEL.max_level < 127:
        pytest.skip("this build of the kernel takes 63 levels (AVX2 alone)")
    k = 640
    values = torch.full((TILE, k), 127, dtype=torch.int8)
    values[1::2] = -127
    x = torch.full((9, k), 255, dtype=torch.uint8)  # a register block of 8 rows and one more
    x[1::2] = 1
    out = KERNEL(x, pack_quads(values, torch.ones(TILE), 127))
    sign = torch.tensor([1.0, -1.0] * (TILE // 2))
    rows = torch.stack([sign if r % 2 == 0 else -sign for r in range(9)])
    assert torch.equal(out, rows * 10_322_560.0)


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 19), tiles=st.integers(1, 4), quads=st.integers(1, 40), seed=st.integers(0, 2**31 - 1),
       scaled=st.booleans())
def test_products_equal_the_exact_sums_times_the_scales(rows: int, tiles: int, quads: int, seed: int, scaled: bool) -> None:
    # Any row count (register blocks and their remainders), tile count and depth: torch's
    # int32 sums times the weight's scale, bit for bit; the activations' row scale after
    g = torch.Generator().manual_seed(seed)
    n, k = tiles * TILE, quads * QUAD
    top = KERNEL.max_level  # the build's levels: 127 with VNNI, 63 on AVX2 alone
    values = torch.randint(-top, top + 1, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) + 0.01
    levels = torch.randint(-127, 128, (rows, k), generator=g, dtype=torch.int32)
    x_scale = torch.rand(rows, 1, generator=g) if scaled else None
    got = quads_matmul(KERNEL, pack_quads(values, scale, top))((levels + 128).to(torch.uint8), x_scale)
    want = (levels.double() @ values.double().t()).float().mul(scale)  # exact sums (< 2^24), rounded once
    if x_scale is not None:
        want = want.mul(x_scale)
    assert torch.equal(got, want)


@needs_kernel
def test_strided_activations_and_output() -> None:
    g = torch.Generator().manual_seed(3)
    values = torch.randint(-63, 64, (2 * TILE, 8), generator=g, dtype=torch.int8)
    weight = pack_quads(values, torch.ones(2 * TILE))
    wide = torch.randint(1, 256, (3, 20), generator=g, dtype=torch.uint8)
    x = wide[:, 4:12]  # rows 20 apart
    out = torch.full((3, 40), -1.0)
    KERNEL(x, weight, out[:, 4:36])
    assert torch.equal(out[:, 4:36], KERNEL(x.contiguous(), weight))
    assert out[:, :4].eq(-1).all() and out[:, 36:].eq(-1).all()  # nothing written outside


@needs_kernel
def test_bad_inputs_are_named() -> None:
    weight = zero_quads(TILE, 8)
    with pytest.raises(ValueError, match="uint8"):
        KERNEL(torch.zeros(2, 8), weight)
    with pytest.raises(ValueError, match=r"\[rows, 8\]"):
        KERNEL(torch.zeros(2, 12, dtype=torch.uint8), weight)
    with pytest.raises(ValueError, match="output"):
        KERNEL(torch.zeros(2, 8, dtype=torch.uint8), weight, torch.empty(2, TILE + 1))
    assert KERNEL(torch.zeros(0, 8, dtype=torch.uint8), weight).shape == (0, TILE)


def _span_operands(rows: int, spans: int, quads: int, seed: int) -> tuple:
    """A quads weight of `spans` spans and `quads` quads of depth at the build's levels, rows
    of activations, each row's scale and inverse temperature: all from `seed`."""
    assert KERNEL is not None
    g = torch.Generator().manual_seed(seed)
    n, k = spans * SPAN, quads * QUAD
    top = KERNEL.max_level
    weight = pack_quads(torch.randint(-top, top + 1, (n, k), generator=g, dtype=torch.int8),
                        torch.rand(n, generator=g) + 0.01, top)
    x = torch.randint(1, 256, (rows, k), generator=g, dtype=torch.uint8)
    return weight, x, torch.rand(rows, generator=g) * 0.1, torch.rand(rows, generator=g) + 0.25


@needs_kernel
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 19), spans=st.integers(1, 3), quads=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
def test_span_logits_are_the_products_scaled_and_summarised(rows: int, spans: int, quads: int, seed: int) -> None:
    # Any row count (register blocks, groups of summarised rows and their remainders), span
    # count and depth: the products times the row scales, and span_native's summaries of
    # them, bit for bit; the row scales and inverse temperatures differ per row
    weight, x, row_scale, inv_t = _span_operands(rows, spans, quads, seed)
    n = spans * SPAN
    out = torch.full((rows, n + 8), -1.0)[:, 4 : 4 + n]  # rows n + 8 apart: the strided case
    peak, mass = KERNEL.span_logits(x, weight, row_scale, inv_t, EXP_FLOOR, out)
    want = KERNEL(x, weight)
    want_peak, want_mass = NativeSummaries().scale_and_summarise(want, row_scale[:, None], inv_t)
    assert torch.equal(out, want) and torch.equal(peak, want_peak) and torch.equal(mass, want_mass)
    assert peak.shape == (rows, spans)


@needs_kernel
def test_span_logits_refuse_what_they_do_not_read() -> None:
    weight = zero_quads(SPAN + TILE, 8)
    x, ones = torch.zeros(2, 8, dtype=torch.uint8), torch.ones(2)
    with pytest.raises(ValueError, match="not whole spans"):
        KERNEL.span_logits(x, weight, ones, ones, EXP_FLOOR, torch.empty(2, SPAN + TILE))
    weight = zero_quads(SPAN, 8)
    with pytest.raises(ValueError, match="row scale"):
        KERNEL.span_logits(x, weight, torch.ones(3), ones, EXP_FLOOR, torch.empty(2, SPAN))
    with pytest.raises(ValueError, match="inverse temperature"):
        KERNEL.span_logits(x, weight, ones, ones.double(), EXP_FLOOR, torch.empty(2, SPAN))
    with pytest.raises(ValueError, match="span logits"):
        KERNEL.span_logits(x, weight, ones, ones, EXP_FLOOR, torch.empty(2, SPAN, dtype=torch.bfloat16))


@needs_kernel
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 19), spans=st.integers(1, 3), quads=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
def test_summaries_alone_and_the_spans_computed_again_are_the_stored_ones(rows: int, spans: int, quads: int,
                                                                          seed: int) -> None:
    # Without an output the same summaries, bit for bit; the source gives every span of every
    # row as span_logits stores it (a row alone, whichever register block stored it), and
    # all of them at once
    assert KERNEL is not None
    weight, x, row_scale, inv_t = _span_operands(rows, spans, quads, seed)
    n = spans * SPAN
    out = torch.empty(rows, n)
    peak, mass = KERNEL.span_logits(x, weight, row_scale, inv_t, EXP_FLOOR, out)
    alone_peak, alone_mass = KERNEL.span_logits(x, weight, row_scale, inv_t, EXP_FLOOR, None)
    assert torch.equal(alone_peak, peak) and torch.equal(alone_mass, mass)
    source = QuadsSpanSource(KERNEL, x, weight, row_scale, inv_t, EXP_FLOOR)
    for r in range(rows):
        for j in range(spans):
            assert torch.equal(source.span(r, j), out[r, j * SPAN : (j + 1) * SPAN])
    padded = torch.full((rows, n), float("nan"))
    source.materialize(padded)
    assert torch.equal(padded, out)
    with pytest.raises(IndexError):
        source.span(rows, 0)

