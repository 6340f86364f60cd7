"""span_native: the hand-written C span summaries, against masses worked out by hand and a
float64 reference, on every shape the kernel's loops treat apart (whole and partial
groups of spans, strided rows, no rows, one or two threads)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from hybridserve.models.layers.span_logits import SPAN  # noqa: E402
from hybridserve.models.layers.span_native import NativeSummaries  # noqa: E402
from hybridserve.models.platform.native_build import NativeBuildError  # noqa: E402

INF = float("inf")


@pytest.fixture(scope="module")
def native() -> NativeSummaries:
    try:
        return NativeSummaries()
    except NativeBuildError as exc:  # a machine without a C compiler: the kernel is not used there
        pytest.skip(str(exc))


def reference(x: torch.Tensor, inv_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    spans = x.double().reshape(x.shape[0], -1, SPAN)
    peak = spans.amax(dim=-1, keepdim=True)
    mass = torch.exp(((spans - peak) * inv_t.double().view(-1, 1, 1)).clamp(min=-87.0)).sum(dim=-1)
    return peak.squeeze(-1).float(), torch.where(peak.squeeze(-1) == -INF, 0.0, mass)


def test_masses_by_hand(native) -> None:  # type: ignore[no-untyped-def]
    """Row 0 at T = 1, row 1 at T = 1/2. Span 0: 0, -1, ..., -127 (a geometric sum); span 1:
    128 equal logits (128 terms of exactly 1); span 2: all -inf (mass 0); span 3: one finite
    logit (mass 1: the -inf terms are taken at exp(-87), far below its rounding)."""
    x = torch.full((2, 4 * SPAN), -INF)
    x[:, :SPAN] = -torch.arange(SPAN, dtype=torch.float32)
    x[:, SPAN : 2 * SPAN] = 5.0
    x[:, 3 * SPAN + 17] = 2.0
    peak, mass = native(x, torch.tensor([1.0, 2.0]))
    assert peak.tolist() == [[0.0, 5.0, -INF, 2.0]] * 2
    for row, q in ((0, math.exp(-1.0)), (1, math.exp(-2.0))):
        geometric = (1.0 - q**SPAN) / (1.0 - q)
        assert mass[row, 0].item() == pytest.approx(geometric, rel=3e-7)
        assert mass[row, 1].item() == 128.0
        assert mass[row, 2].item() == 0.0
        assert mass[row, 3].item() == 1.0


def test_the_exponential_over_its_whole_range(native) -> None:  # type: ignore[no-untyped-def]
    """Span j holds its maximum 0, one logit x_j spread over [-86, 0] and -inf: its mass is
    1 + e^(x_j) (+ 126 e^-87), each within float32 rounding."""
    spans = 512
    xs = [-86.0 * j / (spans - 1) for j in range(spans)]
    x = torch.full((1, spans * SPAN), -INF)
    x[0, ::SPAN] = 0.0
    x[0, 1::SPAN] = torch.tensor(xs)
    _, mass = native(x, torch.ones(1))
    want = torch.tensor([1.0 + math.exp(float(torch.tensor(v))) + 126 * math.exp(-87.0) for v in xs],
                        dtype=torch.float64)
    assert float(((mass[0].double() - want).abs() / want).max()) < 2.5e-7


@pytest.mark.parametrize("spans", [1, 5, 8, 13, 17, 256])
def test_whole_and_partial_groups_of_spans(native, spans: int) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(spans)
    for scale in (0.5, 3.0, 30.0):
        x = torch.randn(3, spans * SPAN, generator=g) * scale
        x[1, : SPAN // 2] = -INF  # half a span masked
        inv_t = torch.tensor([1.0, 1.0 / 0.7, 1.0 / 0.1])
        peak, mass = native(x, inv_t)
        want_peak, want_mass = reference(x, inv_t)
        assert torch.equal(peak, want_peak)
        assert float(((mass.double() - want_mass).abs() / want_mass).max()) < 5e-7


def test_strided_rows_bf16_no_rows_and_threads(native) -> None:  # type: ignore[no-untyped-def]
    """Rows of a wider tensor are read in place, a bf16 chunk as its float32 values, and
    one or two threads give the same bits (each span is one thread's work)."""
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(4, 10 * SPAN, generator=g) * 4
    inv_t = torch.tensor([1.0, 2.0, 0.5, 1.0])
    strided = native(wide[:, 2 * SPAN : 8 * SPAN], inv_t)
    dense = native(wide[:, 2 * SPAN : 8 * SPAN].contiguous(), inv_t)
    assert all(torch.equal(a, b) for a, b in zip(strided, dense))
    half = wide.to(torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(native(half, inv_t), native(half.float(), inv_t)))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native(wide, inv_t)
        torch.set_num_threads(2)
        two = native(wide, inv_t)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    peak, mass = native(torch.empty(0, 2 * SPAN), torch.empty(0))
    assert peak.shape == mass.shape == (0, 2)


def test_bad_shapes_are_named(native) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="not whole spans"):
        native(torch.zeros(2, SPAN + 1), torch.ones(2))
    with pytest.raises(ValueError, match="temperatures"):
        native(torch.zeros(2, SPAN), torch.ones(3))
