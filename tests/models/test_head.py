"""models/layers/head.py and models/loaders/safetensors_map.py: quantizers on hand-derived numbers, the chunked
head against plain matmuls, greedy == argmax (ties included), mapped tensors and page release
(the loader's too)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

import torch.nn.functional as F  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from hybridserve.models.layers.head import (  # noqa: E402
    ARGMAX_SPAN,
    FBGEMM_HEAD_CHUNK_ROWS,
    FEW_ROWS,
    HEAD_CHUNK_ROWS,
    QUADS_BESIDE_PACKED_MAX_ROWS,
    QUADS_HEAD_CHUNK_ROWS,
    QUADS_WHOLE_MAX_ROWS,
    OutputHead,
    dequantize_int4_groups,
    quantize_int4_groups,
    row_max,
)
from hybridserve.models.layers.int8 import (  # noqa: E402
    AMX,
    FBGEMM,
    PACKED,
    PLAIN,
    QUANTIZE_BLOCK_ROWS,
    fbgemm_available,
    gemm_weight_levels,
    int8_gemm_available,
    quantize_gemm_weight,
    quantize_int8_rows,
    quantize_rows_uint8,
)
from hybridserve.models.layers.chunk_argmax import chunk_argmax_kernel  # noqa: E402
from hybridserve.models.layers.int8_amx import amx_kernel  # noqa: E402
from hybridserve.models.layers.int8_quads import quads_kernel  # noqa: E402
from hybridserve.models.loaders.safetensors_map import MappedCheckpoint  # noqa: E402
from hybridserve.models.layers.span_logits import SPAN  # noqa: E402
from hybridserve.models.layers.span_native import NativeSummaries  # noqa: E402

VOCAB = HEAD_CHUNK_ROWS + 7232  # two chunks, the second partial
HIDDEN = 64


def test_int8_rows_by_hand() -> None:
    w = torch.tensor([[1.27, -0.64, 0.0], [2.54, 1.0, -0.02]])
    values, scale = quantize_int8_rows(w)
    assert values.dtype == torch.int8
    assert values.tolist() == [[127, -64, 0], [127, 50, -1]]
    assert scale.tolist() == pytest.approx([0.01, 0.02], rel=1e-6)
    # 63 levels (AVX2's int8 GEMM): scales 1.27/63, 2.54/63; -0.64 * 63/1.27 = -31.75 -> -32,
    # 1.0 * 63/2.54 = 24.80 -> 25, -0.02 * 63/2.54 = -0.496 -> 0
    narrow, narrow_scale = quantize_int8_rows(w, 63)
    assert narrow.tolist() == [[63, -32, 0], [63, 25, 0]]
    assert narrow_scale.tolist() == pytest.approx([1.27 / 63, 2.54 / 63], rel=1e-6)


def test_int8_rows_by_hand_across_quantization_blocks() -> None:
    """Rows are quantized QUANTIZE_BLOCK_ROWS at a time: every block gets its own rows'
    scales, and a float32 weight is left as it was (no in-place temporaries on it)."""
    rows = 2 * QUANTIZE_BLOCK_ROWS + 3  # two whole blocks and a partial one
    w = torch.tensor([1.27, -0.64, 0.0]).repeat(rows, 1) * torch.arange(1, rows + 1, dtype=torch.float32)[:, None]
    before = w.clone()
    values, scale = quantize_int8_rows(w)
    assert values.tolist() == [[127, -64, 0]] * rows  # row i is (i + 1) x [1.27, -0.64, 0]: scale 0.01 (i + 1)
    assert scale.tolist() == pytest.approx([0.01 * (i + 1) for i in range(rows)], rel=1e-5)
    assert torch.equal(w, before)


def test_uint8_rows_by_hand() -> None:
    x = torch.tensor([[1.27, -0.64, 0.0], [-2.54, 1.0, 0.02]])
    values, scale = quantize_rows_uint8(x)
    assert values.dtype == torch.uint8
    assert values.tolist() == [[255, 64, 128], [1, 178, 129]]  # round(x / scale) + 128
    assert scale.squeeze(1).tolist() == pytest.approx([0.01, 0.02], rel=1e-6)


def test_int4_groups_by_hand() -> None:
    ramp = torch.arange(16, dtype=torch.float32)  # low 0, high 15: scale 1, values == weights
    shifted = 2 * ramp - 3  # low -3, high 27: scale 2
    w = torch.stack([torch.cat([ramp, ramp]), torch.cat([shifted, shifted])])
    values, scale, offset = quantize_int4_groups(w, group_size=32)
    assert values[0].tolist() == list(range(16)) * 2
    assert values[1].tolist() == list(range(16)) * 2
    assert scale.tolist() == [[1.0], [2.0]]
    assert offset.tolist() == [[8.0], [13.0]]  # low + 8 * scale
    assert torch.equal(dequantize_int4_groups(values, scale, offset), w)


def test_int4_rejects_a_hidden_size_off_the_group() -> None:
    from hybridserve.core.errors import ConfigError

    with pytest.raises(ConfigError, match="multiple of 32"):
        quantize_int4_groups(torch.zeros(4, 48))


@pytest.fixture(scope="module")
def weight() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(VOCAB, HIDDEN, generator=g) * 0.05


def _hidden(rows: int) -> torch.Tensor:
    return torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_dense_head_equals_f_linear(weight: torch.Tensor, rows: int) -> None:
    x = _hidden(rows)
    got = OutputHead(weight, "none")(x)
    assert got.shape == (rows, VOCAB)
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_int8_weight_only_head_equals_matmul_of_its_dequantized_weight(weight: torch.Tensor, monkeypatch) -> None:
    monkeypatch.setattr("hybridserve.models.layers.head.int8_gemm_available", lambda: False)
    x = _hidden(3)
    values, scale = quantize_int8_rows(weight)
    expected = F.linear(x.bfloat16().float(), values.float() * scale.bfloat16().float()[:, None])
    got = OutputHead(weight, "int8")(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-3)  # bf16 output rounding


@pytest.mark.skipif(not int8_gemm_available(), reason="no int8 GEMM here (x86 with AVX2 or VNNI)")
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_int8_head_with_int8_activations_equals_matmul_of_both_dequantized(weight: torch.Tensor, rows: int) -> None:
    x = _hidden(rows) * torch.linspace(0.1, 10.0, rows)[:, None]  # rows of different ranges: scales per row
    values, scale = quantize_gemm_weight(weight)  # 127 levels with int8 dot products, 63 on AVX2 alone
    x_values, x_scale = quantize_rows_uint8(x)
    expected = F.linear((x_values.float() - 128) * x_scale, values.float() * scale[:, None])
    head = OutputHead(weight, "int8")
    got = head(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # exact int32 sums, float32 scaling
    assert OutputHead(weight.bfloat16(), "int8")(x.bfloat16()).dtype == torch.bfloat16  # the model dtype


def _narrow_fbgemm_path(monkeypatch) -> None:
    """The head's int8 path as on a CPU with AVX2 alone (forced on any x86 CPU with AVX2):
    fbgemm's, weights narrowed to 63 levels."""
    monkeypatch.setattr("hybridserve.models.layers.head.int8_gemm_available", lambda: True)
    monkeypatch.setattr("hybridserve.models.layers.head.int8_path", lambda: FBGEMM)
    monkeypatch.setattr("hybridserve.models.layers.int8.gemm_weight_levels", lambda: 63)


@pytest.fixture
def quads_head(weight: torch.Tensor, monkeypatch) -> OutputHead:
    """An int8 head on int8_quads.c's kernel, as a CPU with AVX2 alone builds it."""
    if quads_kernel() is None:
        pytest.skip("no int8_quads kernel here (no AVX2 or no compiler)")
    _narrow_fbgemm_path(monkeypatch)
    head = OutputHead(weight, "int8")
    assert head._quads is not None
    return head


def _narrow_expected(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The int8 x int8 product of 63-level weight rows and 127-level activation rows, from
    both sides dequantized in float64 (exact int32 sums, two float32 scales after them)."""
    values, scale = quantize_int8_rows(weight, 63)
    x_values, x_scale = quantize_rows_uint8(x)
    return ((x_values.double() - 128) @ values.double().t()) * scale.double() * x_scale.double()


@pytest.mark.parametrize("rows", [1, 3, QUADS_WHOLE_MAX_ROWS, QUADS_WHOLE_MAX_ROWS + 1, 16])
def test_a_quads_head_multiplies_exactly_at_every_row_count(quads_head: OutputHead, weight: torch.Tensor,
                                                            rows: int) -> None:
    # A few rows in one product of the whole vocabulary, more chunk by chunk: the same exact
    # sums either way, so a row's logits do not depend on how many rows its step holds
    x = _hidden(rows) * torch.linspace(0.5, 4.0, rows)[:, None]
    got = quads_head(x)
    torch.testing.assert_close(got.double(), _narrow_expected(weight, x), rtol=1e-6, atol=1e-6)
    assert torch.equal(quads_head(x[:1]), got[:1])
    assert quads_head.greedy(x, None) == got.argmax(dim=-1).tolist()
    assert quads_head.greedy_by_chunks(x, 0.5) == (torch.tanh(got / 0.5) * 0.5).argmax(dim=-1).tolist()
    summaries = quads_head.span_logits(x, torch.ones(rows), None)
    assert torch.equal(summaries.logits[:, :VOCAB], got)
    whole = VOCAB // SPAN  # the span maxima of the whole spans, from the logits
    assert torch.equal(summaries.span_max[:, :whole], got[:, : whole * SPAN].reshape(rows, whole, SPAN).amax(-1))


def test_a_quads_head_equals_fbgemms_chunks_bit_for_bit(quads_head: OutputHead, weight: torch.Tensor,
                                                      monkeypatch) -> None:
    # Where int8_quads.c is not built the head keeps fbgemm's packed chunks: the same products
    if not fbgemm_available():
        pytest.skip("this torch has no fbgemm")
    monkeypatch.setattr("hybridserve.models.layers.head.quads_kernel", lambda: None)
    fbgemm_head = OutputHead(weight, "int8")
    assert fbgemm_head._quads is None
    for rows in (1, QUADS_WHOLE_MAX_ROWS + 1):
        x = _hidden(rows)
        assert torch.equal(quads_head(x), fbgemm_head(x))
        assert quads_head.greedy(x, None) == fbgemm_head.greedy(x, None)


@pytest.fixture
def vnni_quads_head(weight: torch.Tensor, monkeypatch) -> OutputHead:
    """An int8 head on int8_quads.c's VNNI build, as a CPU with VNNI and without AMX builds
    it: oneDNN's path, weights of all 127 levels."""
    kernel = quads_kernel()
    if kernel is None or kernel.max_level < 127 or not int8_gemm_available():
        pytest.skip("no AVX512-VNNI build of the int8_quads kernel here")
    monkeypatch.setattr("hybridserve.models.layers.head.int8_path", lambda: PACKED)
    head = OutputHead(weight, "int8")
    assert head._quads is not None and head.chunk_rows == QUADS_HEAD_CHUNK_ROWS
    return head


@pytest.mark.parametrize("rows", [1, QUADS_WHOLE_MAX_ROWS + 1, QUADS_BESIDE_PACKED_MAX_ROWS,
                                  QUADS_BESIDE_PACKED_MAX_ROWS + 1, 40])
def test_a_vnni_quads_head_multiplies_exactly_and_as_onednn(vnni_quads_head: OutputHead, weight: torch.Tensor,
                                                            rows: int, monkeypatch) -> None:
    # The exact int32 sums of 127-level weights and activations, two float32 scales after
    # them, whether the kernel multiplies (up to 16 rows) or oneDNN's chunks packed beside it
    # at the first larger step; a head of oneDNN's chunks alone (where the kernel is not
    # built) gives the same products bit for bit
    assert vnni_quads_head._packed_chunks is None
    x = _hidden(rows) * torch.linspace(0.5, 4.0, rows)[:, None]
    values, scale = quantize_int8_rows(weight, 127)
    x_values, x_scale = quantize_rows_uint8(x)
    want = ((x_values.double() - 128) @ values.double().t()) * scale.double() * x_scale.double()
    got = vnni_quads_head(x)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    assert (vnni_quads_head._packed_chunks is not None) == (rows > QUADS_BESIDE_PACKED_MAX_ROWS)
    assert vnni_quads_head.greedy(x, None) == got.argmax(dim=-1).tolist()
    assert torch.equal(vnni_quads_head(x[:1]), got[:1])  # a row's logits whatever its step holds
    monkeypatch.setattr("hybridserve.models.layers.head.quads_kernel", lambda: None)
    onednn_head = OutputHead(weight, "int8")
    assert onednn_head._quads is None
    assert torch.equal(onednn_head(x), got)
    assert onednn_head.greedy(x, None) == vnni_quads_head.greedy(x, None)


def test_a_quads_head_holds_its_values_once(quads_head: OutputHead) -> None:
    # One int8 weight of the vocabulary (chunks are views of it) and a scale and column sum
    # per row: no second packed copy for another row count
    kernel, whole = quads_head._quads
    assert whole.shape == (VOCAB, HIDDEN)
    assert whole.values.untyped_storage().nbytes() < VOCAB * HIDDEN + (4 << 20)  # its huge-page alignment
    assert len(quads_head._chunks) == 3  # FBGEMM_HEAD_CHUNK_ROWS: 16384, 16384, 7232


@pytest.mark.parametrize("build", ["avx2", "vnni"])
@pytest.mark.parametrize("rows", [1, 3, QUADS_WHOLE_MAX_ROWS + 1, QUADS_BESIDE_PACKED_MAX_ROWS + 1, 70])
def test_a_quads_heads_fused_greedy_takes_the_tokens_of_the_general_paths(build: str, rows: int, request) -> None:
    # greedy_quads (int8_quads.c's argmax, no logits written) against greedy_by_chunks and
    # the argmax of the same kernel's logits, at row counts inside and past a register
    # block, the whole-vocabulary product and oneDNN's copy; greedy steps of any size pack
    # no oneDNN copy
    head = request.getfixturevalue("quads_head" if build == "avx2" else "vnni_quads_head")
    x = _hidden(rows) * torch.linspace(0.5, 4.0, rows)[:, None]
    fused = head.greedy_quads(x)
    assert fused == head.greedy(x, None)
    assert head._packed_chunks is None
    assert fused == head.greedy_by_chunks(x, None) == head(x).argmax(dim=-1).tolist()


@pytest.mark.parametrize("build", ["avx2", "vnni"])
def test_a_quads_heads_fused_greedy_breaks_ties_to_the_first_index(build: str, monkeypatch, request) -> None:
    # equal maxima in two chunks, and twice within the second chunk in tiles far enough apart
    # that the kernel's two threads each see one; rows of zeros (their products all zero)
    # elsewhere
    w = torch.zeros(VOCAB, HIDDEN)
    w[3, 0] = w[QUADS_HEAD_CHUNK_ROWS + 5, 0] = 1.0
    w[VOCAB - 40, 1] = w[QUADS_HEAD_CHUNK_ROWS + 2, 1] = 1.0
    x = torch.zeros(3, HIDDEN)
    x[0, 0] = x[1, 1] = 1.0  # row 2 all zeros: every product ties at zero, column 0 wins
    request.getfixturevalue("quads_head" if build == "avx2" else "vnni_quads_head")  # the path, or a skip
    head = OutputHead(w, "int8")
    assert head.greedy_quads(x) == head.greedy_by_chunks(x, None) == [3, QUADS_HEAD_CHUNK_ROWS + 2, 0]


def test_a_quads_heads_fused_greedy_leaves_non_finite_rows_to_the_general_paths(quads_head: OutputHead) -> None:
    # A row scale that is not finite would make NaN products, which torch's max orders
    x = _hidden(2)
    x[1, 0] = float("inf")
    assert quads_head.greedy_quads(x) is None
    assert quads_head.greedy(x, None) == quads_head.greedy_by_chunks(x, None)


@pytest.mark.parametrize("build", ["avx2", "vnni"])
@pytest.mark.parametrize("rows", [1, 5, QUADS_BESIDE_PACKED_MAX_ROWS + 1, 40])
def test_a_quads_heads_span_logits_are_its_products_summarised_as_they_come_out(build: str, rows: int,
                                                                               monkeypatch) -> None:
    # A vocabulary of whole spans: int8_quads.c scales and summarises each span of its
    # products while they are in cache. The logits are the head's own (its products times
    # the row scales), each span's maximum is theirs, and maxima and masses are what the
    # general path's summary kernel makes of those logits, bit for bit; no oneDNN copy is
    # packed for them at any row count.
    kernel = quads_kernel()
    if kernel is None:
        pytest.skip("no int8_quads kernel here (no AVX2 or no compiler)")
    if build == "avx2":
        _narrow_fbgemm_path(monkeypatch)
    elif kernel.max_level < 127 or not int8_gemm_available():
        pytest.skip("no AVX512-VNNI build of the int8_quads kernel here")
    else:
        monkeypatch.setattr("hybridserve.models.layers.head.int8_path", lambda: PACKED)
    vocab = 40 * SPAN
    head = OutputHead(torch.randn(vocab, HIDDEN, generator=torch.Generator().manual_seed(5)), "int8")
    assert head._quads is not None
    x = _hidden(rows) * torch.linspace(0.5, 4.0, rows)[:, None]
    inv_t = torch.linspace(0.5, 2.0, rows)
    got = head.span_logits(x, inv_t, None)
    assert head._packed_chunks is None
    logits = head(x)  # above QUADS_BESIDE_PACKED_MAX_ROWS rows by oneDNN's copy, the same products
    assert torch.equal(got.logits[:, :vocab], logits)
    assert torch.equal(got.span_max, logits.view(rows, vocab // SPAN, SPAN).amax(-1))
    want_max, want_mass = NativeSummaries()(logits, inv_t)
    assert torch.equal(got.span_max, want_max) and torch.equal(got.span_sum, want_mass)


def test_int4_head_equals_matmul_of_its_dequantized_weight(weight: torch.Tensor) -> None:
    x = _hidden(3)
    values, scale, offset = quantize_int4_groups(weight)
    deq = dequantize_int4_groups(values, scale.bfloat16().float(), offset.bfloat16().float())
    expected = F.linear(x.bfloat16().float(), deq)
    got = OutputHead(weight, "int4")(x)
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=3e-3)


ARGMAX = chunk_argmax_kernel()  # greedy_native's kernel; None where no compiler builds it
# int8 activations exist only for the int8 head, on a CPU with an int8 GEMM.
_GREEDY_CASES = [("none", False), ("int8", False), ("int4", False)] + (
    [("int8", True)] if int8_gemm_available() else [])


@pytest.mark.parametrize("quantization,int8_activations", _GREEDY_CASES)
def test_greedy_is_argmax_of_the_logits(weight: torch.Tensor, quantization: str, int8_activations: bool,
                                        monkeypatch) -> None:
    monkeypatch.setattr("hybridserve.models.layers.head.int8_gemm_available", lambda: int8_activations)
    head = OutputHead(weight, quantization)
    for x in (_hidden(16), _hidden(16)[:FEW_ROWS], _hidden(16)[:1]):  # by chunks; few rows at once
        assert head.greedy(x, None) == head(x).argmax(dim=-1).tolist()
        assert head.greedy(x, 0.5) == (torch.tanh(head(x) / 0.5) * 0.5).argmax(dim=-1).tolist()
        assert head.greedy_by_chunks(x, 0.5) == head.greedy_few_rows(x, 0.5) == head.greedy(x, 0.5)
        if ARGMAX is not None:
            assert head.greedy_native(x, ARGMAX) == head.greedy_by_chunks(x, None)


needs_amx = pytest.mark.skipif(amx_kernel() is None, reason="no AMX int8 tiles (or no compiler) here")


@pytest.mark.parametrize("path", [PACKED, PLAIN, FBGEMM, AMX])
def test_chunk_rows_follow_the_int8_path(path: str, weight: torch.Tensor, monkeypatch) -> None:
    # fbgemm's path and a head on int8_quads.c's kernel (on fbgemm's or oneDNN's path, where
    # it is built and takes the weights' levels) take smaller chunks (16384: 40,000 rows are 3
    # chunks, the last of 7,232 rows); the others HEAD_CHUNK_ROWS. Every chunking gives the
    # same greedy tokens as the argmax of the whole logits.
    if path == FBGEMM and not fbgemm_available():
        pytest.skip("this torch has no fbgemm")
    if path == AMX and amx_kernel() is None:
        pytest.skip("no AMX int8 tiles (or no compiler) here")
    monkeypatch.setattr("hybridserve.models.layers.head.int8_gemm_available", lambda: True)
    monkeypatch.setattr("hybridserve.models.layers.head.int8_path", lambda: path)
    released: list[tuple[int, int]] = []
    head = OutputHead(weight, "int8", lambda a, b: released.append((a, b)))
    kernel = quads_kernel()
    on_quads = path in (FBGEMM, PACKED) and kernel is not None and gemm_weight_levels() <= kernel.max_level
    assert (head._quads is not None) == on_quads
    if path == FBGEMM or on_quads:
        assert head.chunk_rows == (QUADS_HEAD_CHUNK_ROWS if on_quads else FBGEMM_HEAD_CHUNK_ROWS) == 16384
        assert released == _int8_releases([(0, 16384), (16384, 32768), (32768, VOCAB)])
    else:
        assert head.chunk_rows == HEAD_CHUNK_ROWS
        assert released == _int8_releases([(0, HEAD_CHUNK_ROWS), (HEAD_CHUNK_ROWS, VOCAB)])
    x = _hidden(16)
    assert head.greedy(x, None) == head(x).argmax(dim=-1).tolist()
    assert OutputHead(weight, "none").chunk_rows == HEAD_CHUNK_ROWS  # not int8: the general size


def test_greedy_ties_pick_the_first_index_across_and_within_chunks() -> None:
    w = torch.zeros(VOCAB, HIDDEN)
    w[3, 0] = w[HEAD_CHUNK_ROWS + 5, 0] = 1.0  # equal maxima in two chunks: row 0 picks 3
    w[HEAD_CHUNK_ROWS + 9, 1] = w[HEAD_CHUNK_ROWS + 2, 1] = 1.0  # both in chunk 2: row 1 picks +2
    x = torch.zeros(2, HIDDEN)
    x[0, 0] = x[1, 1] = 1.0
    for head in (OutputHead(w, "none"), OutputHead(w.bfloat16(), "none")):
        for greedy in (head.greedy_by_chunks, head.greedy_few_rows):
            assert greedy(x.to(head.out_dtype), None) == [3, HEAD_CHUNK_ROWS + 2]
        if ARGMAX is not None:  # float32 chunks by the kernel, bf16 ones by row_max
            assert head.greedy_native(x.to(head.out_dtype), ARGMAX) == [3, HEAD_CHUNK_ROWS + 2]


@needs_amx
@pytest.mark.parametrize("rows", [1, 3, 16, 70])
def test_the_amx_heads_fused_greedy_takes_the_tokens_of_the_general_paths(weight: torch.Tensor, rows: int,
                                                                          monkeypatch) -> None:
    # greedy_fused (each chunk's argmax in the kernel, no logits written) against the general
    # paths over the same kernel's logits, at row counts inside and past a row tile
    monkeypatch.setattr("hybridserve.models.layers.head.int8_path", lambda: AMX)
    head = OutputHead(weight, "int8")
    x = _hidden(rows) * torch.linspace(0.5, 4.0, rows)[:, None]
    fused = head.greedy_fused(x)
    assert fused == head.greedy_by_chunks(x, None) == head.greedy_few_rows(x, None) == head.greedy(x, None)
    assert fused == head(x).argmax(dim=-1).tolist()


@needs_amx
def test_the_amx_heads_fused_greedy_breaks_ties_to_the_first_index(monkeypatch) -> None:
    # equal maxima in two chunks, and twice within the second chunk (columns of different
    # 16-column tiles, far enough apart that the kernel's two threads each see one)
    monkeypatch.setattr("hybridserve.models.layers.head.int8_path", lambda: AMX)
    w = torch.zeros(VOCAB, HIDDEN)
    w[3, 0] = w[HEAD_CHUNK_ROWS + 5, 0] = 1.0
    w[HEAD_CHUNK_ROWS + 7000, 1] = w[HEAD_CHUNK_ROWS + 2, 1] = 1.0
    x = torch.zeros(2, HIDDEN)
    x[0, 0] = x[1, 1] = 1.0
    head = OutputHead(w, "int8")
    assert head.greedy_fused(x) == head.greedy(x, None) == [3, HEAD_CHUNK_ROWS + 2]


@needs_amx
@pytest.mark.parametrize("last", [HEAD_CHUNK_ROWS + 7233, HEAD_CHUNK_ROWS + 7247])
def test_the_amx_heads_fused_greedy_reads_a_last_chunk_of_part_tiles(last: int, monkeypatch) -> None:
    # Three chunks in one kernel call, the last ending inside a 16-column tile: each row's
    # maximum planted by hand at a chunk's last column, at the vocabulary's last (in the
    # part tile) and at the first column of the second chunk; the others zero.
    monkeypatch.setattr("hybridserve.models.layers.head.int8_path", lambda: AMX)
    vocab = HEAD_CHUNK_ROWS + last
    w = torch.zeros(vocab, HIDDEN)
    targets = [HEAD_CHUNK_ROWS - 1, vocab - 1, HEAD_CHUNK_ROWS, 2 * HEAD_CHUNK_ROWS - 1]
    for row, column in enumerate(targets):
        w[column, row] = 1.0
    x = torch.eye(len(targets), HIDDEN)
    head = OutputHead(w, "int8")
    assert len(head._chunks) == 3
    assert head.greedy_fused(x) == head.greedy_by_chunks(x, None) == targets


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 17, 70])
@pytest.mark.parametrize("whole_spans", [False, True])
def test_the_amx_heads_fused_span_logits_are_the_general_paths_bit_for_bit(weight: torch.Tensor, rows: int,
                                                                          whole_spans: bool, monkeypatch) -> None:
    # The kernel's one pass against a head on the plain path (the same products bit for bit)
    # whose chunks the summary kernel reads back. A vocabulary of whole spans takes the fused
    # route for every chunk (each writing into the reused buffer, whatever the row count);
    # else the first chunk's kernel summarises and the last chunk takes the general route.
    w = weight[: HEAD_CHUNK_ROWS + 56 * SPAN] if whole_spans else weight
    monkeypatch.setattr("hybridserve.models.layers.head.int8_path", lambda: AMX)
    fused = OutputHead(w, "int8")
    monkeypatch.setattr("hybridserve.models.layers.head.int8_path", lambda: PLAIN)
    general = OutputHead(w, "int8")
    x = _hidden(rows) * torch.linspace(0.1, 10.0, rows)[:, None]
    inv_t = torch.rand(rows, generator=torch.Generator().manual_seed(3)) * 5 + 0.1
    for _ in range(2):  # the second call reuses the first one's buffer
        a, b = fused.span_logits(x, inv_t, None), general.span_logits(x, inv_t, None)
        assert a.is_dense or not whole_spans
        assert torch.equal(a.logits, b.logits)
        assert torch.equal(a.span_max, b.span_max) and torch.equal(a.span_sum, b.span_sum)


@needs_amx
@pytest.mark.parametrize("rows", [1, 17, 70])
def test_summaries_without_stored_logits_and_the_spans_computed_again_are_the_stored_ones(
        weight: torch.Tensor, rows: int, monkeypatch) -> None:
    # Two chunks of whole spans; 70 rows cross the kernel's 64-row blocks.
    monkeypatch.setattr("hybridserve.models.layers.head.int8_path", lambda: AMX)
    head = OutputHead(weight[: HEAD_CHUNK_ROWS + 56 * SPAN], "int8")
    x = _hidden(rows) * torch.linspace(0.1, 10.0, rows)[:, None]
    inv_t = torch.rand(rows, generator=torch.Generator().manual_seed(3)) * 5 + 0.1
    stored = head.span_logits(x, inv_t, None)
    unstored = head.span_logits(x, inv_t, None, stored=False)
    assert stored.source is None and unstored.source is not None
    assert torch.equal(unstored.span_max, stored.span_max) and torch.equal(unstored.span_sum, stored.span_sum)
    # a span at a time, as native samplers read them: first, last, and both sides of the chunk edge
    fill, context = unstored.source.native()
    assert fill and context
    spans = stored.span_max.shape[1]
    source = unstored.source._spans
    for r in {0, rows // 2, rows - 1}:
        for j in (0, HEAD_CHUNK_ROWS // SPAN - 1, HEAD_CHUNK_ROWS // SPAN, spans - 1):
            assert torch.equal(source.span(r, j), stored.padded[r, j * SPAN : (j + 1) * SPAN])
    with pytest.raises(IndexError):
        source.span(rows, 0)
    # any other use computes them all, into the reused buffer: the stored logits
    expected = stored.logits.clone()
    stored.logits.fill_(float("nan"))  # the buffer they share: whatever is there is overwritten
    assert torch.equal(unstored.logits, expected)
    assert unstored.source is None and unstored.is_dense


@pytest.mark.parametrize("rows", [1, 17, 40])
def test_a_quads_heads_summaries_without_stored_logits_draw_the_stored_ones_tokens(
        weight: torch.Tensor, rows: int, monkeypatch) -> None:
    # int8_quads.c's head (this CPU's build) over whole spans: with stored False the same
    # summaries and no logits written; the spans the draw reads are computed again, so plain
    # rows draw the stored logits' tokens, and a dense need computes the stored logits
    from hybridserve.core.request import SamplingParams
    from hybridserve.executor.torch.plain_sampling import DrawParams, sample_plain
    kernel = quads_kernel()
    if kernel is None:
        pytest.skip("no int8_quads kernel here (no AVX2 or no compiler)")
    if kernel.max_level < 127:  # AVX2 alone: beside fbgemm's path
        _narrow_fbgemm_path(monkeypatch)
    elif int8_gemm_available():  # VNNI: beside oneDNN's
        monkeypatch.setattr("hybridserve.models.layers.head.int8_path", lambda: PACKED)
    else:
        pytest.skip("this torch has no int8 GEMM beside the VNNI kernel")
    head = OutputHead(weight[: 90 * SPAN], "int8")
    assert head._quads is not None
    x = _hidden(rows) * torch.linspace(0.1, 10.0, rows)[:, None]
    params = [SamplingParams(temperature=t) for t in (1.0, 0.3, 0.0, 1.7)] * (rows // 4 + 1)
    dp = DrawParams(params[:rows], list(range(rows)), head.vocab_size)
    stored = head.span_logits(x, dp.inv_t, None)
    unstored = head.span_logits(x, dp.inv_t, None, stored=False)
    assert stored.source is None and unstored.source is not None
    assert torch.equal(unstored.span_max, stored.span_max) and torch.equal(unstored.span_sum, stored.span_sum)
    positions = [7 * r for r in range(rows)]
    got, want = sample_plain(unstored, dp, positions), sample_plain(stored, dp, positions)
    assert got is not None and got == want and unstored.source is not None  # read a span at a time
    expected = stored.logits.clone()
    stored.logits.fill_(float("nan"))  # the buffer they share: whatever is there is overwritten
    assert torch.equal(unstored.logits, expected)
    assert unstored.source is None and unstored.is_dense


@needs_amx
def test_stored_false_changes_nothing_where_the_head_has_no_fused_kernel(weight: torch.Tensor,
                                                                          monkeypatch) -> None:
    # a vocabulary that is not whole spans (and a plain-path head) keeps its logits as before
    monkeypatch.setattr("hybridserve.models.layers.head.int8_path", lambda: AMX)
    head = OutputHead(weight, "int8")
    x, inv_t = _hidden(3), torch.ones(3)
    a, b = head.span_logits(x, inv_t, None), head.span_logits(x, inv_t, None, stored=False)
    assert b.source is None
    assert torch.equal(a.logits, b.logits) and torch.equal(a.span_sum, b.span_sum)


def _int8_releases(chunks: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """What an int8 head gives back, in order: each chunk's blocks of QUANTIZE_BLOCK_ROWS
    rows as the quantizer reads them, then the whole chunk once it is packed."""
    out = []
    for start, stop in chunks:
        out += [(b, min(b + QUANTIZE_BLOCK_ROWS, stop)) for b in range(start, stop, QUANTIZE_BLOCK_ROWS)]
        out.append((start, stop))
    return out


def test_release_rows_per_chunk_only_when_the_source_is_no_longer_read(weight: torch.Tensor) -> None:
    # An int8 head holds at most one block of source rows beside its chunk's int8 copies:
    # 64 blocks of 512 rows in the first chunk, 14 and a partial one of 64 rows in the second.
    released: list[tuple[int, int]] = []
    OutputHead(weight, "int8", lambda a, b: released.append((a, b)), chunk_rows=HEAD_CHUNK_ROWS)
    assert QUANTIZE_BLOCK_ROWS == 512 and len(released) == 64 + 1 + 15 + 1
    assert released[63:66] == [(32256, 32768), (0, 32768), (32768, 33280)] and released[-2] == (39936, 40000)
    assert released == _int8_releases([(0, HEAD_CHUNK_ROWS), (HEAD_CHUNK_ROWS, VOCAB)])
    released.clear()
    OutputHead(weight[:100], "none", lambda a, b: released.append((a, b)))  # too small to pack: read as is
    assert released == []


def test_the_heads_first_release_gives_back_every_page_read_so_far() -> None:
    from hybridserve.models.loaders.loader import _head_release

    calls: list[tuple] = []

    class Recorder:  # a Weights whose checkpoint records what is given back
        checkpoint = SimpleNamespace(release=lambda name, rows: calls.append((name, rows)))

        def release_all(self) -> None:
            calls.append(("all",))

    release = _head_release(Recorder(), "lm_head.weight")  # type: ignore[arg-type]
    release(0, HEAD_CHUNK_ROWS)
    release(HEAD_CHUNK_ROWS, VOCAB)
    assert calls == [("all",), ("lm_head.weight", (0, HEAD_CHUNK_ROWS)), ("lm_head.weight", (HEAD_CHUNK_ROWS, VOCAB))]


def test_mapped_checkpoint_views_the_file(tmp_path: Path) -> None:
    tensors = {"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.tensor([1.5, -2.0]).bfloat16(),
               "c": torch.tensor([[1, 2], [3, 4]], dtype=torch.int8), "big": torch.arange(4096 * 3).float()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ckpt = MappedCheckpoint([tmp_path / "model.safetensors"])
    assert sorted(ckpt.names()) == ["a", "b", "big", "c"]
    for name, t in tensors.items():
        got = ckpt.tensor(name)
        assert got.dtype == t.dtype and torch.equal(got, t)
    assert ckpt.tensor("big").data_ptr() == ckpt.tensor("big").data_ptr()  # a view, not a copy
    ckpt.release("big")
    ckpt.release("big", (0, 2048))
    assert torch.equal(ckpt.tensor("big"), tensors["big"])  # re-read from the file after release


def test_mapped_checkpoint_rejects_a_non_safetensors_file(tmp_path: Path) -> None:
    from hybridserve.core.errors import ConfigError

    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\xff" * 16)
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        MappedCheckpoint([bad])


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 4), spans=st.integers(1, 5), extra=st.sampled_from([0, 0, 7]), levels=st.integers(1, 6),
       seed=st.integers(0, 2**16), dtype=st.sampled_from(["float32", "bfloat16"]))
def test_row_max_is_max_over_the_row_ties_included(rows: int, spans: int, extra: int, levels: int, seed: int,
                                                    dtype: str) -> None:
    """row_max against torch's own max(dim=-1): few distinct values make ties across and
    within spans common; a width that is not a multiple of the span takes the general path."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (rows, spans * ARGMAX_SPAN + extra), generator=g).to(getattr(torch, dtype))
    values, indices = row_max(x)
    expected = x.max(dim=-1)
    assert torch.equal(values, expected.values)
    assert torch.equal(indices, expected.indices)
    first = [(row == row.max()).nonzero()[0].item() for row in x]  # the first maximal index, plainly
    assert indices.tolist() == first


@pytest.mark.skipif(ARGMAX is None, reason="no C compiler: chunk_argmax is not built")
@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 12), cols=st.integers(1, 300), levels=st.integers(1, 5), seed=st.integers(0, 2**16),
       scaled=st.booleans(), special=st.sampled_from(["none", "nan", "-inf", "all -inf", "zeros"]))
def test_chunk_argmax_is_row_max_of_the_scaled_chunk(rows: int, cols: int, levels: int, seed: int, scaled: bool,
                                                     special: str) -> None:
    """chunk_argmax.c against the general path, row_max of chunk * row_scale: few distinct
    values make ties within and across vector lanes common; a NaN wins at the first NaN, -inf
    values lose, a row all -inf gives its first column, signed zeros come back as the
    first of them holds; the chunk's start is added; rows of any width (tails past whole
    vectors) and a stride wider than the row."""
    assert ARGMAX is not None
    g = torch.Generator().manual_seed(seed)
    wide = torch.randint(-levels, levels + 1, (rows, cols + 3), generator=g).float() * 0.75
    chunk = wide[:, :cols]
    if special == "nan":
        chunk[0, cols // 2] = chunk[0, cols - 1] = float("nan")
    elif special == "-inf":
        chunk[:, ::2] = float("-inf")
    elif special == "all -inf":
        chunk[-1] = float("-inf")
    elif special == "zeros":
        chunk[:] = torch.where(torch.rand(rows, cols, generator=g) < 0.5, torch.tensor(-0.0), torch.tensor(0.0))
    scale = torch.rand(rows, 1, generator=g) + 0.25 if scaled else None
    best, index = torch.empty(rows), torch.empty(rows, dtype=torch.int64)
    ARGMAX(chunk, scale, 1000, best, index)
    want_best, want_index = row_max(chunk if scale is None else chunk * scale)
    assert index.tolist() == (want_index + 1000).tolist()
    assert torch.equal(best.isnan(), want_best.isnan())
    ok = ~best.isnan()
    assert torch.equal(best[ok].view(torch.int32), want_best[ok].view(torch.int32))  # bits: -0 is not +0


def test_chunk_argmax_refuses_what_it_does_not_read() -> None:
    if ARGMAX is None:
        pytest.skip("no C compiler: chunk_argmax is not built")
    best, index = torch.empty(2), torch.empty(2, dtype=torch.int64)
    assert not ARGMAX.supports(torch.zeros(2, 8, dtype=torch.bfloat16))
    assert not ARGMAX.supports(torch.zeros(8, 2).t()) and not ARGMAX.supports(torch.zeros(2, 0))
    with pytest.raises(ValueError, match="reads float32 CPU rows"):
        ARGMAX(torch.zeros(2, 8, dtype=torch.bfloat16), None, 0, best, index)
    with pytest.raises(ValueError, match="outputs for 2 rows"):
        ARGMAX(torch.zeros(2, 8), None, 0, best, index.int())
    with pytest.raises(ValueError, match="row_scale"):
        ARGMAX(torch.zeros(2, 8), torch.ones(3), 0, best, index)


@pytest.mark.parametrize("chunk_rows", [None, 8192, 1000])  # the default, per-chunk spans, and chunks off the span
@pytest.mark.parametrize("softcap", [None, 0.5])
@pytest.mark.parametrize("rows", [2, 5])  # summarised as a whole buffer (FEW_ROWS), and per chunk
def test_span_logits_are_the_logits_and_their_span_summaries(weight: torch.Tensor, chunk_rows: int | None,
                                                            softcap: float | None, rows: int) -> None:
    head = OutputHead(weight, "none", chunk_rows=chunk_rows)
    x = _hidden(rows)
    inv_t = torch.tensor([1.0, 2.0, 0.5, 1.0, 10.0])[:rows]
    logits = head(x)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    got = head.span_logits(x, inv_t, softcap)
    assert torch.equal(got.logits, logits)
    assert got.padded.shape[1] % SPAN == 0 and bool((got.padded[:, VOCAB:] == float("-inf")).all())
    # The summaries by hand, span by span, from the logits padded with -inf.
    padded = torch.cat([logits, torch.full((rows, got.padded.shape[1] - VOCAB), float("-inf"))], dim=1)
    padded = padded.view(rows, -1, SPAN)
    peak = padded.amax(dim=-1)
    torch.testing.assert_close(got.span_max, peak, rtol=0, atol=0)
    torch.testing.assert_close(got.span_sum, torch.exp((padded - peak[..., None]) * inv_t[:, None, None]).sum(-1),
                               rtol=1e-5, atol=0.0)  # the compiled kernel sums in its own order


@pytest.mark.parametrize("path", [PACKED, PLAIN, FBGEMM])
def test_span_logits_of_int8_activations_equal_the_logits_with_or_without_the_fused_scale(
        path: str, weight: torch.Tensor, monkeypatch) -> None:
    """With int8 activations each whole chunk's row scale is applied by the summary kernel
    in its own pass where the kernel does that (the native one), by mul_ before the summary
    otherwise, and the padded last chunk always the second way: the logits are the head's
    own, bit for bit, either way, and so are the summaries' maxima."""
    if path == FBGEMM and not fbgemm_available():
        pytest.skip("this torch has no fbgemm")
    if not int8_gemm_available():
        pytest.skip("no int8 GEMM here (x86 with AVX2 or VNNI)")
    from hybridserve.models.layers import span_kernel

    monkeypatch.setattr("hybridserve.models.layers.head.int8_gemm_available", lambda: True)
    monkeypatch.setattr("hybridserve.models.layers.head.int8_path", lambda: path)
    head = OutputHead(weight, "int8")
    x = _hidden(7) * torch.linspace(0.1, 10.0, 7)[:, None]
    inv_t = torch.tensor([1.0, 2.0, 0.5, 1.0, 10.0, 0.7, 1.3])
    logits = head(x)
    results = []
    for kernel in ("in use", "general path"):
        if kernel == "general path":
            monkeypatch.setattr(span_kernel.KERNEL, "tried", True)
            monkeypatch.setattr(span_kernel.KERNEL, "fn", None)
        got = head.span_logits(x, inv_t, None)
        assert torch.equal(got.logits, logits), kernel
        padded = torch.cat([logits, torch.full((7, got.padded.shape[1] - VOCAB), float("-inf"))], dim=1)
        padded = padded.view(7, -1, SPAN)
        peak = padded.amax(dim=-1)
        assert torch.equal(got.span_max, peak), kernel
        torch.testing.assert_close(got.span_sum, torch.exp((padded - peak[..., None]) * inv_t[:, None, None]).sum(-1),
                                   rtol=1e-5, atol=0.0, msg=kernel)
        results.append(got.span_sum)
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=0.0)
