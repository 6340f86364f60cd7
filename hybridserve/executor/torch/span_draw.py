"""span_sampler.draw_fast's draw in native code (span_draw.c says how), built by
models/platform/native_build.py: the fast path beside draw_fast, which stays the general
one (rows the native draw leaves undecided, logits held in a dtype other than float32,
machines without a compiler). tests/executor/test_span_draw.py holds the two to the same
tokens."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Sequence

import torch

from hybridserve.executor.torch.logit_pieces import LogitPieces
from hybridserve.executor.torch.sampling_keys import DRAWS_PER_POSITION
from hybridserve.models.layers.span_logits import SpanLogits
from hybridserve.models.platform.native_build import build_for_spans

SOURCE = Path(__file__).with_name("span_draw.c")
# span_draw.c's mark for a row whose threshold its candidates do not decide.
UNDECIDED = -1
# span_draw.c's mark (span_draw_keyed's) for a row whose every token is masked.
MASKED = -2


class NativeDraw:
    """(span logits, per-row parameters, draws) -> tokens [S] int64, UNDECIDED where the
    caller must draw the row itself; None where the logits are not float32. Logits not held
    (SpanLogits.source) stay so: the spans the draw reads are computed as it reads them."""

    def __init__(self, span: int) -> None:
        library = build_for_spans("span_draw", SOURCE, span)
        fn = library.span_draw
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, ptr, ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int32, i64, ptr,
                       ctypes.c_int32, ptr, ptr]
        fn.restype = ctypes.c_int
        self._fn = fn
        keyed = library.span_draw_keyed
        keyed.argtypes = [ptr, ptr, ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, ctypes.c_int32,
                          i64, ptr, ctypes.c_int32, ptr, ptr]
        keyed.restype = ctypes.c_int
        self._keyed = keyed

    def __call__(self, sl: SpanLogits, greedy: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor, u: torch.Tensor, attempts: int, candidate_spans: int) -> torch.Tensor | None:
        logits = _logits_arguments(sl)
        if logits is None:
            return None
        arguments, fill, context = logits
        rows, spans = sl.span_max.shape
        span_max, span_sum = _as(sl.span_max, torch.float32), _as(sl.span_sum, torch.float32)
        inv_t = _as(sl.inv_temperature, torch.float32)
        greedy_u8 = _as(greedy, torch.uint8)
        top_k, top_p, min_p = _as(top_k, torch.int64), _as(top_p, torch.float32), _as(min_p, torch.float32)
        u = _as(u, torch.float64)
        if u.shape != (rows, attempts + 1):
            raise ValueError(f"{rows} rows need draws [{rows}, {attempts + 1}], got {tuple(u.shape)}")
        tokens = torch.empty(rows, dtype=torch.int64)
        failed = self._fn(*arguments, rows, spans, span_max.data_ptr(), span_sum.data_ptr(),
                          inv_t.data_ptr(), greedy_u8.data_ptr(), top_k.data_ptr(), top_p.data_ptr(), min_p.data_ptr(),
                          u.data_ptr(), attempts, candidate_spans, tokens.data_ptr(), torch.get_num_threads(),
                          fill, context)
        if failed:
            raise MemoryError("the native draw could not allocate its scratch")
        return tokens

    def keyed(self, sl: SpanLogits, parameters: tuple[int, int, int, int, int], positions: Sequence[int],
              attempts: int, candidate_spans: int) -> list[int] | None:
        """__call__'s tokens (a list) with each row's draws keyed by (seed, position) as
        sampling_keys.uniforms computes them, and MASKED where every token of a row is
        masked; None where the logits are not float32. `parameters`: the addresses of the
        rows' greedy (uint8), top_k (int64), top_p, min_p (float32) and seeds (uint64), as
        plain_sampling.DrawParams holds them; positions: each row's token position. ctypes
        arrays, no tensors: made after the head has streamed its weights through every
        cache, where each tensor operation costs several times its warm time."""
        logits = _logits_arguments(sl)
        if logits is None:
            return None
        arguments, fill, context = logits
        rows, spans = sl.span_max.shape
        if len(positions) != rows:
            raise ValueError(f"{rows} rows need {rows} positions, got {len(positions)}")
        span_max, span_sum = _as(sl.span_max, torch.float32), _as(sl.span_sum, torch.float32)
        inv_t = _as(sl.inv_temperature, torch.float32)
        tokens = (ctypes.c_int64 * rows)()
        status = self._keyed(*arguments, rows, spans, span_max.data_ptr(), span_sum.data_ptr(), inv_t.data_ptr(),
                             *parameters, (ctypes.c_int64 * rows)(*positions), DRAWS_PER_POSITION,
                             attempts, candidate_spans, tokens, torch.get_num_threads(), fill, context)
        if status == -2:
            raise ValueError(f"{attempts + 1} draws per row: at most {DRAWS_PER_POSITION} are keyed per position")
        if status:
            raise MemoryError("the native draw could not allocate its scratch")
        return list(tokens)


def _logits_arguments(sl: SpanLogits) -> tuple[tuple, int | None, int | None] | None:
    """(the logits' three pointer arguments, fill, context) as span_draw.c reads sl's logits:
    pieces where held (None where they are not float32), else their source's fill."""
    if sl.source is not None:  # logits not held: the spans it reads are computed as it reads them
        fill, context = sl.source.native()
        return (None, None, None), fill, context
    pieces = LogitPieces.of(sl)
    if pieces is None:
        return None
    return pieces.arguments(), None, None


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as contiguous `dtype`, itself where it already is (no dispatch: each costs a few
    microseconds of a step whose caches the head has just evicted)."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()
