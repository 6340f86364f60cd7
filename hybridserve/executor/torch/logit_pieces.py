"""SpanLogits' logits as the native sampling kernels take them (models/platform/
logit_pieces.h): each piece's base pointer, row stride and first span."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from hybridserve.models.layers.span_logits import SpanLogits


class LogitPieces:
    """The pointers of sl's pieces, held with the arrays behind them; `of` gives None
    where a piece is not float32 with unit column stride (the kernels read float32 only)."""

    def __init__(self, pieces: list[torch.Tensor], span: int) -> None:
        self.base = (ctypes.c_void_p * len(pieces))(*(p.data_ptr() for p in pieces))
        self.ld = np.array([p.stride(0) for p in pieces], dtype=np.int64)
        self.first = np.zeros(len(pieces) + 1, dtype=np.int64)
        np.cumsum([p.shape[1] // span for p in pieces], out=self.first[1:])

    @classmethod
    def of(cls, sl: SpanLogits) -> LogitPieces | None:
        pieces = sl.pieces()
        if any(p.dtype != torch.float32 or p.stride(1) != 1 for p in pieces):
            return None
        return cls(pieces, sl.span)

    def arguments(self) -> tuple[ctypes.Array, int, int]:
        """(base, ld, first) as the kernels' first three arguments."""
        return self.base, self.ld.ctypes.data, self.first.ctypes.data
