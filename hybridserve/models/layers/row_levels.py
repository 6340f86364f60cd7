"""quantize_rows_uint8 (models/layers/int8.py) by the C kernel of row_levels.c (it says why
and how), built by models/platform/native_build.py: the int8 head's input levels and row
scales bit for bit, in one call, where the eager quantizer is nine ops (checked on first
use; tests/models/test_row_levels.py). Rows holding a NaN or an infinity are left to the
eager quantizer, whose values the head's general paths order as torch does."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from hybridserve.models.layers.int8 import quantize_rows_uint8
from hybridserve.models.platform.native_build import build, checked

SOURCE = Path(__file__).with_name("row_levels.c")
DTYPES = (torch.bfloat16, torch.float32)


class RowLevels:
    """x [rows, K] (bf16 or float32, CPU, unit column stride) -> quantize_rows_uint8(x):
    (uint8 levels + 128 [rows, K], float32 scale [rows, 1]), or None where a value of x is
    not finite."""

    def __init__(self) -> None:
        fn = build("row_levels", SOURCE).row_levels
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, ctypes.c_int32, i64, i64, i64, ptr, i64, ptr]
        fn.restype = i64
        self._fn = fn

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        return (x.device.type == "cpu" and x.dtype in DTYPES and x.dim() == 2
                and (x.stride(1) == 1 or x.shape[1] <= 1 or x.numel() == 0))

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.supports(x):
            raise ValueError(f"row_levels reads bf16 or float32 CPU rows with unit column stride, not {x.dtype} "
                             f"{tuple(x.shape)} on {x.device}")
        rows, k = x.shape
        levels, scale = torch.empty(rows, k, dtype=torch.uint8), torch.empty(rows, 1)
        if rows and self._fn(x.data_ptr(), int(x.dtype == torch.bfloat16), x.stride(0), rows, k, levels.data_ptr(),
                             k, scale.data_ptr()):
            return None
        return levels, scale


@cache
def row_levels_kernel() -> RowLevels | None:
    """The kernel, built and checked against quantize_rows_uint8 on first use; None where it
    cannot be built or disagrees (a warning says why): the head's input is then quantized
    eagerly."""
    return checked(RowLevels, _mismatch, "the head's input is quantized eagerly")


def _mismatch(kernel: RowLevels) -> str:
    """'' when the kernel gives quantize_rows_uint8's bits on made-up rows (a zero row, a
    subnormal one, one near float32's largest, levels halfway between integers, strided
    rows, both dtypes) and None for a NaN and an infinity; else what differs."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 40, generator=g) * torch.tensor([[1.0], [0.0], [1e-39], [1e38], [1e-3], [7.0]])
    x[4, :5] = torch.tensor([127.0, 0.5, 1.5, -2.5, 126.5]) * 1e-3  # levels at halves: ties to even
    for rows in (x, x.to(torch.bfloat16), x[::2], torch.empty(0, 40)):
        got, want = kernel(rows), quantize_rows_uint8(rows)
        if got is None or not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
            return f"differs from quantize_rows_uint8 on {rows.dtype} rows {tuple(rows.shape)}"
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[3, 7] = bad
        if kernel(y) is not None:
            return f"quantized a row holding {bad}"
    return ""
