"""SpanLogits' logits as the native sampling kernels take them (models/platform/
logit_pieces.h): each piece's base pointer, row stride and first span."""

from __future__ import annotations

import ctypes
from itertools import accumulate

import torch

from hybridserve.models.layers.span_logits import SpanLogits


class LogitPieces:
    """The pointers of sl's pieces, held with the arrays behind them; `of` gives None
    where a piece is not float32 with unit column stride (the kernels read float32 only).
    ctypes arrays, not numpy's: made once a step, after the head has streamed its weights
    through every cache, where each numpy call costs tens of microseconds."""

    def __init__(self, pieces: list[torch.Tensor], span: int) -> None:
        n = len(pieces)
        self.base = (ctypes.c_void_p * n)(*(p.data_ptr() for p in pieces))
        self.ld = (ctypes.c_int64 * n)(*(p.stride(0) for p in pieces))
        self.first = (ctypes.c_int64 * (n + 1))(0, *accumulate(p.shape[1] // span for p in pieces))

    @classmethod
    def of(cls, sl: SpanLogits) -> LogitPieces | None:
        pieces = sl.pieces()
        if any(p.dtype != torch.float32 or p.stride(1) != 1 for p in pieces):
            return None
        return cls(pieces, sl.span)

    def arguments(self) -> tuple[ctypes.Array, ctypes.Array, ctypes.Array]:
        """(base, ld, first) as the kernels' first three arguments."""
        return self.base, self.ld, self.first
