"""logit_bias and the repetition / frequency / presence penalties in native code
(penalties.c says how), built by models/platform/native_build.py: the fast path beside
logits_controls.apply_logits_controls + SpanLogits.refresh_spans, for batches whose
controls are those only. tests/executor/test_penalties.py holds the two to the same
logits and summaries."""

from __future__ import annotations

import ctypes
from itertools import chain
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from hybridserve.core.request import SamplingParams
from hybridserve.executor.torch.logit_pieces import LogitPieces
from hybridserve.executor.torch.logits_controls import TokenHistory
from hybridserve.models.layers.span_logits import EXP_FLOOR, SpanLogits
from hybridserve.models.platform.native_build import build_for_spans

SOURCE = Path(__file__).with_name("penalties.c")


def penalties_only(params: SamplingParams) -> bool:
    """Whether a request's logits controls are ones the native path applies (no allowed
    tokens, no bad words)."""
    return params.allowed_token_ids is None and not params.bad_words_token_ids


class NativePenalties:
    """(span logits, [(row, params, history)]) -> whether it applied them (with the touched
    spans' summaries refreshed); False, with nothing changed, where the logits are not
    float32 or a row names a token outside the vocabulary."""

    def __init__(self, span: int) -> None:
        library = build_for_spans("penalties", SOURCE, span)
        fn = library.penalties_apply
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr,
                       ctypes.c_float, ptr, ptr, ctypes.c_int32]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __call__(self, sl: SpanLogits, requests: Sequence[tuple[int, SamplingParams, TokenHistory]]) -> bool:
        pieces = LogitPieces.of(sl)
        if pieces is None:
            return False
        if not sl.span_max.is_contiguous() or not sl.span_sum.is_contiguous():
            return False
        rows, spans = sl.span_max.shape
        # per logits row: its history and bias (rows without controls: none)
        by_row: list[tuple[SamplingParams, TokenHistory] | None] = [None] * rows
        for row, params, history in requests:
            by_row[row] = (params, history)
        lengths = [len(e[1].tokens) if e else 0 for e in by_row]
        history = np.fromiter(chain.from_iterable(e[1].tokens for e in by_row if e), dtype=np.int64,
                              count=sum(lengths))
        offset = np.zeros(rows + 1, dtype=np.int64)
        np.cumsum(lengths, out=offset[1:])
        num_prompt = np.array([e[1].num_prompt if e else 0 for e in by_row], dtype=np.int64)
        repetition = np.array([e[0].repetition_penalty if e else 1.0 for e in by_row], dtype=np.float32)
        frequency = np.array([e[0].frequency_penalty if e else 0.0 for e in by_row], dtype=np.float32)
        presence = np.array([e[0].presence_penalty if e else 0.0 for e in by_row], dtype=np.float32)
        # each row's bias in token order: the C side looks tokens up by bisection
        biases = [sorted(e[0].logit_bias.items()) if e and e[0].logit_bias else [] for e in by_row]
        bias_ids = np.array([t for b in biases for t, _ in b], dtype=np.int64)
        bias = np.array([v for b in biases for _, v in b], dtype=np.float32)
        bias_offset = np.zeros(rows + 1, dtype=np.int64)
        np.cumsum([len(b) for b in biases], out=bias_offset[1:])
        inv_t = sl.inv_temperature.to(torch.float32).contiguous()
        status = self._fn(*pieces.arguments(), rows, spans, sl.vocab_size, history.ctypes.data,
                          offset.ctypes.data, num_prompt.ctypes.data, repetition.ctypes.data, frequency.ctypes.data,
                          presence.ctypes.data, bias_ids.ctypes.data, bias.ctypes.data, bias_offset.ctypes.data,
                          inv_t.data_ptr(), EXP_FLOOR, sl.span_max.data_ptr(), sl.span_sum.data_ptr(),
                          torch.get_num_threads())
        if status < 0:
            raise MemoryError("the native penalties could not allocate their scratch")
        return status == 0
