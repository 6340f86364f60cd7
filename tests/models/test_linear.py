"""models/layers/linear.py: packed oneDNN matmuls equal F.linear; small weights and float16 stay plain;
bfloat16, native or run as float32, rounds float32 sums once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridserve.models.layers.linear import PACK_MIN_NUMEL, compute_dtype, make_linear, pack


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


def _rounded_once(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                  h: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """Whether bf16 `out` is x w^T + b (+ h) summed in float32 and rounded to bf16 once:
    (which elements are within the bound below, the share equal bit for bit to the float32
    nearest the exact sum, rounded to bf16).

    The bound holds in any summation order, so on every CPU: each product of two bf16
    values (8 significant bits each) is exact in float32 (16 bits), so the only errors are
    the float32 additions and the final rounding. A float32 sum s of n terms, in any order
    or blocking, with or without fused multiply-adds, is within g(2^-24) * sum|terms| of
    the exact sum, g(u) = n u / (1 - n u) (Higham, Accuracy and Stability of Numerical
    Algorithms, 2nd ed., sections 3.1 and 4.2); n = K + 2 counts the bias and the residual
    (an n too large only loosens the bound). Rounding
    s to bf16 moves it by at most half a bf16 step at |s|, at most half a step at |out|:
    rounding is monotone and powers of two are bf16 values, so |out| is in |s|'s binade
    or the next. The reference is summed in float64, within g(2^-53) * sum|terms| of the
    exact sum. Hence
        |out - ref| <= half_step(|out|) + (g(2^-24) + g(2^-53)) * (|x| |w|^T + |b| + |h|).

    Where the float32 sum lands on the other side of a bf16 rounding boundary than the
    exact sum, out is one step off that rounding, which is what a CPU-dependent summation
    order does to a few elements. Float32 rounding errors add up like a random walk: over
    n = 642 terms of partial sums near 1, about 2^-24 * sqrt(642) ~ 1.5e-6, against a bf16
    step of 2^-7 near 1, so about 2 * 1.5e-6 / 2^-7 ~ 4e-4 of the elements change; 99%
    equal leaves a 25-fold margin. Rounding partial sums to bf16 (a second rounding) moves
    each by up to half a step, and fails both checks (the control in
    test_bfloat16_as_float32_rounds_float32_math_once).
    """
    ref = x.double() @ w.double().t()
    scale = x.double().abs() @ w.double().abs().t()
    for term in (b, h):
        if term is not None:
            ref, scale = ref + term.double(), scale + term.double().abs()
    n = x.shape[1] + 2

    def g(u: float) -> float:
        return n * u / (1 - n * u)

    got = out.double()
    # frexp: |got| = m 2^e, m in [0.5, 1), so the bf16 step there is 2^(e-8); below the
    # smallest normal float32 (bf16's too) the step stays that of the smallest normal.
    _, e = torch.frexp(got.abs().clamp_min(torch.finfo(torch.float32).tiny))
    half_step = torch.pow(2.0, (e - 9).double())
    within = (got - ref).abs() <= half_step + (g(2**-24) + g(2**-53)) * scale
    rounded = ref.float().bfloat16()
    equal = (out.view(torch.int16) == rounded.view(torch.int16)).double().mean().item()
    return within, equal


def _assert_rounded_once(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                         h: torch.Tensor | None = None) -> None:
    assert out.dtype == torch.bfloat16
    within, equal = _rounded_once(out, x, w, b, h)
    assert bool(within.all()) and equal >= 0.99, (int((~within).sum()), equal)


@pytest.mark.parametrize("rows", [1, 16])
def test_packed_bfloat16_linear_rounds_float32_math_once(rows: int) -> None:
    """This CPU's bf16 path, native (float32 sums of exact products in oneDNN's bf16
    kernel) or bf16 run as float32 where the CPU lacks it: one rounding to bf16, the
    residual added before it (_rounded_once)."""
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(1024, 640, generator=g) / 25).bfloat16()
    x = torch.randn(rows, 640, generator=g).bfloat16()
    h = torch.randn(rows, 1024, generator=g).bfloat16()
    linear, residual, packed = make_linear(w, None)
    if not packed:
        pytest.skip("oneDNN bfloat16 packing unavailable on this CPU/torch build")
    _assert_rounded_once(linear(x), x, w)
    _assert_rounded_once(residual(h, x), x, w, h=h)


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
    to bf16 once, bias and residual added before it (_rounded_once: every element within
    the float32 summation bound, 99% of them equal to the rounding of the exact sum)."""
    g = torch.Generator().manual_seed(100 + rows)
    w = (torch.randn(1024, 640, generator=g) / 25).bfloat16()
    b = torch.randn(1024, generator=g).bfloat16()
    x = torch.randn(rows, 640, generator=g).bfloat16()
    h = torch.randn(rows, 1024, generator=g).bfloat16()
    linear, residual, packed = make_linear(w, b, native_bf16=False)
    if not packed:
        pytest.skip("oneDNN packing unavailable on this CPU/torch build")
    _assert_rounded_once(linear(x), x, w, b)
    _assert_rounded_once(residual(h, x), x, w, b, h)
    # The control: the two halves of K summed exactly but each rounded to bf16 before the
    # final rounding (a second rounding) fails both checks.
    half = x.shape[1] // 2
    parts = [(x[:, k].double() @ w[:, k].double().t()).bfloat16().double()
             for k in (slice(None, half), slice(half, None))]
    twice = (parts[0] + parts[1] + b.double()).float().bfloat16()
    within, equal = _rounded_once(twice, x, w, b)
    assert not bool(within.all()) and equal < 0.99, (int((~within).sum()), equal)
