"""A chunk's span summaries by the hand-written C kernel (span_summaries.c says how and why
it is faster than inductor's loop), built by models/platform/native_build.py."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from hybridserve.models.layers.span_logits import EXP_FLOOR, SPAN
from hybridserve.models.platform.native_build import build

SOURCE = Path(__file__).with_name("span_summaries.c")


class NativeSummaries:
    """(chunk, inv_temperature) -> (span max, span mass), as span_kernel.Summarise; and
    scale_and_summarise, which multiplies the chunk by its row scales in place first."""

    def __init__(self) -> None:
        library = build("span_summaries", SOURCE)
        library.span_summaries_span.restype = ctypes.c_int32
        if (c_span := library.span_summaries_span()) != SPAN:
            raise ValueError(f"span_summaries.c sums spans of {c_span} logits, span_logits uses {SPAN}")
        fn = library.span_summaries
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32]
        fn.restype = None
        self._fn = fn

    def __call__(self, src: torch.Tensor, inv_temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = src if src.dtype == torch.float32 else src.float()
        return self._run(x if x.stride(1) == 1 else x.contiguous(), None, inv_temperature)

    def scale_and_summarise(self, src: torch.Tensor, row_scale: torch.Tensor, inv_temperature: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """src *= row_scale (one per row, as src.mul_(row_scale[:, None]) does it, bit for
        bit), then src's summaries, in one pass. src: float32 with unit column stride."""
        if src.dtype != torch.float32 or src.stride(1) != 1:
            raise ValueError(f"scaled in place: a float32 chunk with unit column stride, got {src.dtype} "
                             f"with strides {tuple(src.stride())}")
        scale = row_scale.to(torch.float32).reshape(-1).contiguous()
        if scale.shape != (src.shape[0],):
            raise ValueError(f"{src.shape[0]} rows with {tuple(row_scale.shape)} row scales")
        return self._run(src, scale, inv_temperature)

    def _run(self, x: torch.Tensor, row_scale: torch.Tensor | None, inv_temperature: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, width = x.shape
        if width % SPAN:
            raise ValueError(f"a chunk of {width} logits is not whole spans of {SPAN}")
        inv_t = inv_temperature.to(torch.float32).contiguous()
        if inv_t.shape != (rows,):
            raise ValueError(f"{rows} rows with {tuple(inv_t.shape)} temperatures")
        spans = width // SPAN
        peak = torch.empty(rows, spans)
        mass = torch.empty(rows, spans)
        if rows:
            self._fn(x.data_ptr(), rows, spans, x.stride(0), None if row_scale is None else row_scale.data_ptr(),
                     inv_t.data_ptr(), EXP_FLOOR, peak.data_ptr(), mass.data_ptr(), torch.get_num_threads())
        return peak, mass
