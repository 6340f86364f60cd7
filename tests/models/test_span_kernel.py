"""span_kernel: the summarising kernel in use (native C, else compiled) equals span_stats,
the general path, and any doubt about one passes to the next, then to the general path."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridserve.models.layers import span_kernel  # noqa: E402
from hybridserve.models.layers.span_logits import SPAN, span_stats  # noqa: E402
from hybridserve.models.platform.native_build import NativeBuildError  # noqa: E402


def test_a_kernel_in_use_equals_the_general_path(caplog) -> None:
    """Where the kernel is built it finds the same maxima and masses (within float32
    rounding) as span_stats, on chunks of several shapes, dtypes and temperatures. Where it is not (no compiler; torch 2.13's AVX2 code generation,
    which this check rejects), the reason is logged and the eager path serves."""
    with caplog.at_level("WARNING"):
        fn = span_kernel._Kernel().get()
    if fn is None:
        assert "span summaries stay eager" in caplog.text
        return
    g = torch.Generator().manual_seed(3)
    for rows, spans, dtype in [(5, 8, torch.float32), (17, 64, torch.float32), (9, 256, torch.bfloat16)]:
        src = (torch.randn(rows, spans * SPAN, generator=g) * 5).to(dtype)
        src[0, :SPAN] = float("-inf")  # a span masked whole
        inv_t = torch.rand(rows, generator=g) * 3 + 0.1
        peak, mass = fn(src, inv_t)
        want_peak, want_mass = span_stats(src.float(), inv_t)
        assert torch.equal(peak, want_peak)
        torch.testing.assert_close(mass, want_mass, rtol=1e-5, atol=0.0)
        assert mass[0, 0] == 0.0


def test_a_kernel_that_disagrees_is_not_used(monkeypatch, caplog) -> None:
    def off_by_a_little(src, inv_t):  # type: ignore[no-untyped-def]
        peak, mass = span_stats(src.float(), inv_t)
        return peak, mass * 1.001

    monkeypatch.setattr(span_kernel, "KERNELS", (("native", lambda: off_by_a_little),))
    with caplog.at_level("WARNING"):
        assert span_kernel._Kernel().get() is None
    assert "the native kernel is not used (gave span masses off by" in caplog.text
    assert "span summaries stay eager" in caplog.text


def test_kernels_that_fail_to_build_are_not_used(monkeypatch, caplog) -> None:
    def no_c_compiler():  # type: ignore[no-untyped-def]
        raise NativeBuildError("no C compiler: 'cc' is not on PATH (set CC)")

    def no_compiler(fn, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(torch, "compile", no_compiler)
    monkeypatch.setattr(span_kernel, "_native", no_c_compiler)
    monkeypatch.setattr(span_kernel, "KERNELS", (("native", lambda: span_kernel._native()),
                                                 ("compiled", span_kernel._compiled)))
    with caplog.at_level("WARNING"):
        assert span_kernel._Kernel().get() is None
    assert "the native kernel is not used (NativeBuildError: no C compiler" in caplog.text
    assert "the compiled kernel is not used (RuntimeError: no C++ compiler found)" in caplog.text


def test_the_next_kernel_serves_where_the_first_fails(monkeypatch, caplog) -> None:
    def breaks():  # type: ignore[no-untyped-def]
        raise NativeBuildError("cc failed on span_summaries.c: error: unknown type name")

    def eager(src, inv_t):  # type: ignore[no-untyped-def]
        return span_stats(src.float(), inv_t)

    monkeypatch.setattr(span_kernel, "KERNELS", (("native", breaks), ("compiled", lambda: eager)))
    with caplog.at_level("WARNING"):
        assert span_kernel._Kernel().get() is eager
    assert "the native kernel is not used (NativeBuildError: cc failed" in caplog.text and "stay eager" not in caplog.text


def test_the_switch_keeps_the_general_path(monkeypatch) -> None:
    monkeypatch.setenv("HYBRIDSERVE_NO_COMPILE", "1")
    kernel = span_kernel._Kernel()
    assert kernel.get() is None and kernel.tried


def test_a_kernel_that_fails_on_a_call_gives_way_to_the_general_path(caplog) -> None:
    """A call the compiled kernel cannot serve is answered by span_stats, logged once, and
    the kernel is not tried again."""
    calls = []

    def breaks(src, inv_t):  # type: ignore[no-untyped-def]
        calls.append(1)
        raise RuntimeError("recompile limit reached")

    kernel = span_kernel._Kernel()
    kernel.tried, kernel.fn = True, breaks
    src = torch.randn(5, 4 * SPAN, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    inv_t = torch.full((5,), 0.5)
    with caplog.at_level("WARNING"):
        for _ in range(2):
            peak, mass = kernel.summarise(src, inv_t)
            want_peak, want_mass = span_stats(src.float(), inv_t)
            assert torch.equal(peak, want_peak) and torch.equal(mass, want_mass)
    assert calls == [1] and kernel.get() is None
    assert caplog.text.count("span summaries turn eager") == 1


def test_cold_rows_masses_by_hand() -> None:
    """At a cold temperature most terms of a span's mass underflow float32 (the summaries
    take them at a floor, EXP_FLOOR, to stay out of subnormal arithmetic): the masses are
    still what they are by hand, in the general path and the kernel alike. Span 0: its max,
    one logit ln(1/2) * T below it (weight 1/2) and 126 logits 50 below (weight e^-500 at
    T = 0.1); span 1: its max and -inf (a banned token, weight 0); span 2: all -inf."""
    T = 0.1
    src = torch.full((1, 3 * SPAN), float("-inf"))
    src[0, :SPAN] = -40.0
    src[0, 7] = 10.0
    src[0, 100] = 10.0 + T * float(torch.log(torch.tensor(0.5, dtype=torch.float64)))
    src[0, SPAN + 5] = 3.0
    inv_t = torch.tensor([1.0 / T])
    kernel = span_kernel._Kernel().get()
    for name, fn in (("general", span_stats), ("kernel", kernel)):
        if fn is None:
            continue
        peak, mass = fn(src, inv_t)
        assert peak.tolist() == [[10.0, 3.0, float("-inf")]], name
        torch.testing.assert_close(mass, torch.tensor([[1.5, 1.0, 0.0]]), rtol=1e-6, atol=0.0, msg=name)
