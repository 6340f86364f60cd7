"""A chunk's span summaries by the hand-written C kernel (span_summaries.c says how and why
it is faster than inductor's loop), built by models/platform/native_build.py."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from hybridserve.models.layers.span_logits import EXP_FLOOR, SPAN
from hybridserve.models.platform.native_build import build

SOURCE = Path(__file__).with_name("span_summaries.c")
_C_SPAN = 128  # the C file's SPAN


class NativeSummaries:
    """(chunk, inv_temperature) -> (span max, span mass), as span_kernel.Summarise."""

    def __init__(self) -> None:
        if SPAN != _C_SPAN:
            raise ValueError(f"span_summaries.c sums spans of {_C_SPAN} logits, span_logits uses {SPAN}")
        fn = build("span_summaries", SOURCE).span_summaries
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32]
        fn.restype = None
        self._fn = fn

    def __call__(self, src: torch.Tensor, inv_temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = src if src.dtype == torch.float32 else src.float()
        if x.stride(1) != 1:
            x = x.contiguous()
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
            self._fn(x.data_ptr(), rows, spans, x.stride(0), inv_t.data_ptr(), EXP_FLOOR, peak.data_ptr(),
                     mass.data_ptr(), torch.get_num_threads())
        return peak, mass
