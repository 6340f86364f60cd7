"""models/linear.py: packed oneDNN matmuls equal F.linear; small weights and float16 stay plain;
bfloat16 without native bf16 runs as float32 with one rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridserve.models.linear import PACK_MIN_NUMEL, compute_dtype, make_linear, pack


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 16, 130])
def test_packed_linear_equals_f_linear(bias: bool, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(1024, 640, generator=g) / 25
    b = torch.randn(1024, generator=g) if bias else None
    x = torch.randn(rows, 640, generator=g)
    h = torch.randn(rows, 1024, generator=g)
    linear, residual, packed = make_linear(w, b)
    if not packed:
        pytest.skip("oneDNN packing unavailable on this CPU/torch build")
    torch.testing.assert_close(linear(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(residual(h, x), h + F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # a strided input (attention output views) is accepted
    xs = torch.randn(rows, 1280, generator=g)[:, ::2]
    torch.testing.assert_close(linear(xs), F.linear(xs, w, b), rtol=1e-5, atol=1e-5)


def test_small_and_half_precision_weights_stay_plain() -> None:
    small = torch.randn(PACK_MIN_NUMEL // 640 - 1, 640)
    assert pack(small) is None
    assert pack(torch.randn(1024, 640, dtype=torch.float16)) is None
    linear, residual, packed = make_linear(small, None)
    x = torch.randn(3, 640)
    assert not packed
    assert torch.equal(linear(x), F.linear(x, small))
    h = torch.randn(3, small.shape[0])
    torch.testing.assert_close(residual(h, x), h + F.linear(x, small))


@pytest.mark.parametrize("rows", [1, 16])
def test_packed_bfloat16_linear_is_close_to_float32_math(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(1024, 640, generator=g) / 25).bfloat16()
    x = torch.randn(rows, 640, generator=g).bfloat16()
    h = torch.randn(rows, 1024, generator=g).bfloat16()
    linear, residual, packed = make_linear(w, None)
    if not packed:
        pytest.skip("oneDNN bfloat16 packing unavailable on this CPU/torch build")
    exact = F.linear(x.float(), w.float())
    assert linear(x).dtype == torch.bfloat16
    torch.testing.assert_close(linear(x).float(), exact, rtol=1e-2, atol=1e-2)  # one bf16 rounding
    torch.testing.assert_close(residual(h, x).float(), h.float() + exact, rtol=1e-2, atol=2e-2)


def test_bfloat16_computes_in_float32_only_without_native_bf16() -> None:
    w = torch.zeros(1024, 640, dtype=torch.bfloat16)
    assert compute_dtype(w, native_bf16=False) == torch.float32
    assert compute_dtype(w, native_bf16=True) == torch.bfloat16
    assert compute_dtype(w.float(), native_bf16=False) == torch.float32
    packed = pack(w, native_bf16=False)
    if packed is None:
        pytest.skip("oneDNN packing unavailable on this CPU/torch build")
    assert packed.dtype == torch.float32


@pytest.mark.parametrize("rows", [1, 16])
def test_bfloat16_as_float32_rounds_float32_math_once(rows: int) -> None:
    """Without native bf16 a bf16 linear is the float32 product of the bf16 values, rounded
    to bf16 once: within one bf16 step (2^-8 relative) of that rounding, bias and residual
    added before it."""
    g = torch.Generator().manual_seed(100 + rows)
    w = (torch.randn(1024, 640, generator=g) / 25).bfloat16()
    b = torch.randn(1024, generator=g).bfloat16()
    x = torch.randn(rows, 640, generator=g).bfloat16()
    h = torch.randn(rows, 1024, generator=g).bfloat16()
    linear, residual, packed = make_linear(w, b, native_bf16=False)
    if not packed:
        pytest.skip("oneDNN packing unavailable on this CPU/torch build")
    exact = x.float() @ w.float().t() + b.float()
    out = linear(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), exact.bfloat16().float(), rtol=2**-8, atol=1e-6)
    with_h = residual(h, x)
    assert with_h.dtype == torch.bfloat16
    torch.testing.assert_close(with_h.float(), (exact + h.float()).bfloat16().float(), rtol=2**-8, atol=1e-6)
