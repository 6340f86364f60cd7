"""row_levels: the int8 head's input quantized by one native call gives levels and scales
worked out by hand, quantize_rows_uint8's bits on any rows (both dtypes, strided, zeros,
subnormals, values near float32's largest), None for a row holding a NaN or an infinity,
and a kernel that disagrees is not used (models/layers/row_levels.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from hybridserve.models.layers import head as head_module  # noqa: E402
from hybridserve.models.layers.head import OutputHead  # noqa: E402
from hybridserve.models.layers.int8 import quantize_rows_uint8  # noqa: E402
from hybridserve.models.layers.row_levels import RowLevels, row_levels_kernel  # noqa: E402
from tests.helpers.native_kernels import check_refused  # noqa: E402

KERNEL = row_levels_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler: the kernel is not built")


@needs_kernel
def test_a_row_by_hand() -> None:
    """Largest magnitude 2.54: scale 0.02, so 2.54 -> 127, -1.27 -> -63.5 -> -64 (ties to
    even), 0.01 -> 0.5 -> 0, 0.03 -> 1.5 -> 2; stored + 128. A zero row: scale FLT_MIN / 127,
    every level 0."""
    scale = torch.tensor(2.54, dtype=torch.float32) / 127
    x = torch.stack([torch.tensor([2.54, -1.27, 0.0, 0.0]), torch.zeros(4)])
    x[0, 2], x[0, 3] = scale * 0.5, scale * 1.5  # exactly halfway, whatever 0.02 rounds to
    levels, got_scale = KERNEL(x)
    assert levels.tolist() == [[255, 64, 128, 130], [128, 128, 128, 128]]
    assert got_scale[0, 0] == scale
    assert got_scale[1, 0] == torch.tensor(torch.finfo(torch.float32).tiny) / 127
    assert got_scale.shape == (2, 1) and levels.dtype == torch.uint8


@needs_kernel
@settings(max_examples=200, deadline=None)
@given(rows=st.integers(0, 9), cols=st.integers(1, 80), magnitude=st.sampled_from([1.0, 1e-3, 1e-39, 0.0, 1e37, 3e4]),
       bf16=st.booleans(), stride=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_equals_the_eager_quantizer_bit_for_bit(rows: int, cols: int, magnitude: float, bf16: bool, stride: int,
                                                seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols + stride, generator=g) * magnitude
    x = x.to(torch.bfloat16) if bf16 else x
    x = x[:, :cols]  # rows cols + stride apart
    got, want = KERNEL(x), quantize_rows_uint8(x)
    assert got is not None
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@needs_kernel
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_row_that_is_not_finite_is_left_to_the_eager_quantizer(bad: float) -> None:
    x = torch.randn(3, 32)
    x[2, 31] = bad
    assert KERNEL(x) is None
    assert KERNEL(x[:2]) is not None


@needs_kernel
def test_it_refuses_what_it_does_not_read() -> None:
    with pytest.raises(ValueError, match="unit column stride"):
        KERNEL(torch.randn(4, 8).t())
    with pytest.raises(ValueError, match="bf16 or float32"):
        KERNEL(torch.randn(4, 8, dtype=torch.float64))


@needs_kernel
def test_a_kernel_that_disagrees_is_not_used(monkeypatch, caplog) -> None:
    def off_by_one(real, self, *args):  # type: ignore[no-untyped-def]
        out = real(self, *args)
        if out is not None and out[0].numel():
            out[0].view(-1)[0] += 1
        return out

    check_refused(monkeypatch, caplog, RowLevels, row_levels_kernel, off_by_one, "differs from quantize_rows_uint8")


@pytest.mark.parametrize("native", [True, False])
def test_the_heads_input_is_the_eager_quantizers_with_and_without_the_kernel(native: bool, monkeypatch) -> None:
    """The quads head's greedy tokens and logits take the same levels either way; a row that
    is not finite leaves greedy to the general paths either way."""
    if not native:
        monkeypatch.setattr(head_module, "row_levels_kernel", lambda: None)
    g = torch.Generator().manual_seed(3)
    head = OutputHead(torch.randn(4096, 64, generator=g), "int8")
    if head._quads is None:
        pytest.skip("no int8_quads.c head on this CPU (or no compiler)")
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    values, scale = head._input(x)
    want_values, want_scale = quantize_rows_uint8(x)
    assert torch.equal(values, want_values) and torch.equal(scale, want_scale)
    assert head.greedy_quads(x) == head(x).argmax(dim=-1).tolist()
    x[3, 7] = float("nan")
    assert head.greedy_quads(x) is None
