"""A chunk's span summaries as one kernel: the fast paths beside span_stats.

Eager PyTorch summarises a chunk of logits in four passes over it, each with a temporary
of the chunk's size (the span maxima, x - max, the scaling by 1 / T, exp and the sums);
at 64 rows they cost a sampled step about as much as the rest of its sampling. Two
kernels make them one loop over each row while it is in cache, with no temporaries:

- native: hand-written C (span_summaries.c, via span_native.py), which summarises several
  spans side by side and so runs about twice as fast as the compiled loop
  (`python benchmarks/span_summaries.py`);
- compiled: torch.compile (inductor's C++ backend) of the eager form, where the native
  one cannot be built.

The first that builds is checked once against span_stats (models/layers/span_logits.py,
the general path) on a made-up chunk with -inf spans; no compiler, failed builds or any
mismatch keep the eager path for the life of the process. Set HYBRIDSERVE_NO_COMPILE=1
to keep it without trying.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import torch

from hybridserve.core.errors import one_line
from hybridserve.models.layers.span_logits import EXP_FLOOR, SPAN, Summarise, span_stats

log = logging.getLogger(__name__)

_NO_COMPILE_ENV = "HYBRIDSERVE_NO_COMPILE"


def _summarise(src: torch.Tensor, inv_temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = src.to(torch.float32)
    rows = x.shape[0]
    spans = x.view(rows, -1, SPAN)
    peak = spans.amax(dim=-1)
    mass = torch.exp(((spans - peak[..., None]) * inv_temperature.view(rows, 1, 1)).clamp_min(EXP_FLOOR)).sum(dim=-1)
    return peak, torch.where(peak == float("-inf"), 0.0, mass)


class _Kernel:
    """The kernel in use (native, compiled or none), chosen and checked at most once per process."""

    def __init__(self) -> None:
        self.tried = False
        self.fn: Summarise | None = None

    def get(self) -> Summarise | None:
        if not self.tried:
            self.tried = True
            self.fn = None if os.environ.get(_NO_COMPILE_ENV) == "1" else _build()
        return self.fn

    def prepare(self) -> None:
        """Build the kernel now, or, once built, check it again under the calling thread's
        count: inductor builds its loops for one thread count, and a call under another
        compiles first (compiled_chains.ChainsByRows.prepare says why a server does this)."""
        if not self.tried:
            self.get()
            return
        if self.fn is not None:
            try:
                reason = _mismatch(self.fn)
            except Exception as exc:  # noqa: BLE001 - any failure keeps the general path
                reason = one_line(exc)
            if reason:
                log.warning("span summaries turn eager: under %d threads the kernel %s",
                            torch.get_num_threads(), reason)
                self.fn = None

    def summarise(self, src: torch.Tensor, inv_temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(span max, span mass) of src as float32: the kernel where one serves, else
        span_stats. A kernel that fails on a call (a shape or dtype it cannot compile for,
        its recompile limit) is dropped for the rest of the process, and the call answered
        by span_stats: a sampled step never fails for the fast path's sake."""
        fn = self.get()
        if fn is not None:
            try:
                return fn(src, inv_temperature)
            except Exception as exc:  # noqa: BLE001 - the general path answers instead
                log.warning("span summaries turn eager: the kernel failed (%s)", one_line(exc))
                self.fn = None
        return span_stats(src.float(), inv_temperature)

    def scale_and_summarise(self, src: torch.Tensor, row_scale: torch.Tensor, inv_temperature: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """src.mul_(row_scale) (row_scale [S, 1]: an int8 GEMM's activation scales), then
        summarise(src): in one pass where the kernel in use does both (the native one),
        else the two in turn. Either way src ends up holding the same values."""
        fn = self.get()
        fused = getattr(fn, "scale_and_summarise", None)
        if fused is not None and src.dtype == torch.float32 and src.stride(1) == 1:
            try:
                return fused(src, row_scale, inv_temperature)
            except Exception as exc:  # noqa: BLE001 - checked before it writes: the general path answers
                log.warning("span summaries turn eager: the kernel failed (%s)", one_line(exc))
                self.fn = None
        return self.summarise(src.mul_(row_scale), inv_temperature)


def _native() -> Summarise:
    from hybridserve.models.layers.span_native import NativeSummaries

    return NativeSummaries()


def _compiled() -> Summarise:
    return torch.compile(_summarise, dynamic=True, fullgraph=True)  # type: ignore[return-value]


# The kernels tried in turn: the first that builds and agrees with span_stats serves.
KERNELS: tuple[tuple[str, Callable[[], Summarise]], ...] = (("native", _native), ("compiled", _compiled))


def _build() -> Summarise | None:
    for name, make in KERNELS:
        try:
            fn = make()
            reason = _mismatch(fn)
        except Exception as exc:  # noqa: BLE001 - any failure leaves the next kernel to try
            reason = one_line(exc)
        if not reason:
            return fn
        log.warning("span summaries: the %s kernel is not used (%s)", name, reason)
    log.warning("span summaries stay eager")
    return None


def _mismatch(fn: Summarise) -> str | None:
    """Why fn differs from the general path on a made-up chunk (rows at several
    temperatures, one span all -inf, one with a single finite logit), or None."""
    g = torch.Generator().manual_seed(0)
    src = torch.randn(6, 16 * SPAN, generator=g) * 4
    src[1, 3 * SPAN : 4 * SPAN] = float("-inf")
    src[2, 5 * SPAN + 1 : 6 * SPAN] = float("-inf")
    inv_t = torch.tensor([1.0, 0.5, 2.0, 1.0 / 0.7, 10.0, 1.0])
    peak, mass = fn(src, inv_t)
    want_peak, want_mass = span_stats(src, inv_t)
    if not torch.equal(peak, want_peak):
        return "gave other span maxima"
    if not torch.allclose(mass, want_mass, rtol=1e-5, atol=0.0):
        return f"gave span masses off by {float(((mass - want_mass).abs() / want_mass.clamp(min=1)).max()):.2e}"
    fused = getattr(fn, "scale_and_summarise", None)
    if fused is not None:
        row_scale = torch.linspace(0.01, 3.0, src.shape[0])[:, None]
        scaled = src.clone()
        peak, mass = fused(scaled, row_scale, inv_t)
        want = src * row_scale
        if not torch.equal(scaled, want):
            return "scaled the logits otherwise than mul_"
        want_peak, want_mass = span_stats(want, inv_t)
        if not torch.equal(peak, want_peak) or not torch.allclose(mass, want_mass, rtol=1e-5, atol=0.0):
            return "gave other summaries of the scaled logits"
    return None


KERNEL = _Kernel()
