"""A sandwich-norm decoder's residual add and the next RMSNorm in one native pass, and a
pre-norm layer's RMSNorm alone: the C kernels of residual_norms.c (it says why and how),
built by models/platform/native_build.py.

`residual_norms_eager` is the general path it equals bit for bit in bf16 (the decoder's own
chain with exact sums) and to a float32 rounding in float32 (the float32 forms serve the
decode stack, models/arch/decode_stack.py); `ResidualNorms.supports` says which inputs the
kernel takes, and the decoder keeps the general path for the rest and where no compiler is
found."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from hybridserve.models.layers.kernel_checks import float32_close
from hybridserve.models.layers.rms_norm import rms_norm
from hybridserve.models.platform.native_build import build, checked

SOURCE = Path(__file__).with_name("residual_norms.c")
DTYPES = (torch.bfloat16, torch.float32)


def residual_norms_eager(h: torch.Tensor, y: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor | None,
                         eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(h + rms_norm(y) * w1, rms_norm of that * w2 or None), the norms with exact sums."""
    inv_dim = 1.0 / h.shape[-1]
    h = h + rms_norm(y, w1, eps, inv_dim, exact_sums=True)
    return h, None if w2 is None else rms_norm(h, w2, eps, inv_dim, exact_sums=True)


class ResidualNorms:
    """residual_norms_eager's result computed by the C kernel, for the inputs `supports` takes."""

    def __init__(self) -> None:
        library = build("residual_norms", SOURCE)
        library.residual_norms_lanes.restype = ctypes.c_int64
        self.lanes = library.residual_norms_lanes()
        fn = library.residual_norms
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr, ptr, ctypes.c_double, ctypes.c_double, ptr, ptr,
                       ctypes.c_int32]
        fn.restype = None
        self._fn = fn
        norms = library.rms_norms
        norms.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_double, ctypes.c_double, ptr, ctypes.c_int32]
        norms.restype = None
        self._norms = norms
        self._fn_f32, self._norms_f32 = library.residual_norms_f32, library.rms_norms_f32
        self._fn_f32.argtypes, self._fn_f32.restype = fn.argtypes, None
        self._norms_f32.argtypes, self._norms_f32.restype = norms.argtypes, None

    def functions(self, dtype: torch.dtype):  # type: ignore[no-untyped-def]
        """(residual_norms, rms_norms): the C functions for rows of `dtype` (bf16 or float32;
        the decode stack calls them too)."""
        return (self._fn, self._norms) if dtype == torch.bfloat16 else (self._fn_f32, self._norms_f32)

    def supports(self, h: torch.Tensor, y: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor | None) -> bool:
        """bf16 or float32 rows on the CPU (unit column stride), a width the kernel's vectors
        divide, contiguous weights of that width and dtype."""
        if h.device.type != "cpu" or h.dtype not in DTYPES or y.dtype != h.dtype or h.dim() != 2:
            return False
        if y.shape != h.shape or h.stride(1) != 1 or y.stride(1) != 1 or h.shape[1] % self.lanes:
            return False
        return all(w.dtype == h.dtype and w.shape == (h.shape[1],) and w.is_contiguous()
                   for w in (w1, w2) if w is not None)

    def supports_norm(self, h: torch.Tensor, w: torch.Tensor) -> bool:
        """What `norm` takes: as `supports` for h and w alone."""
        return self.supports(h, h, w, None)

    def norm(self, h: torch.Tensor, w: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        """rms_norm(h) * w with exact sums (a pre-norm layer's: its residual add is the matmul's)."""
        rows, dim = h.shape
        x_out = torch.empty(rows, dim, dtype=h.dtype)
        if rows:
            fn = self.functions(h.dtype)[1]
            fn(h.data_ptr(), h.stride(0), rows, dim, w.data_ptr(), float(eps), 1.0 / dim, x_out.data_ptr(),
               torch.get_num_threads())
        return x_out

    def __call__(self, h: torch.Tensor, y: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor | None,
                 eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows, dim = h.shape
        h_out = torch.empty(rows, dim, dtype=h.dtype)
        x_out = None if w2 is None else torch.empty(rows, dim, dtype=h.dtype)
        if rows:
            fn = self.functions(h.dtype)[0]
            fn(h.data_ptr(), h.stride(0), y.data_ptr(), y.stride(0), rows, dim, w1.data_ptr(),
               None if w2 is None else w2.data_ptr(), float(eps), 1.0 / dim, h_out.data_ptr(),
               None if x_out is None else x_out.data_ptr(), torch.get_num_threads())
        return h_out, x_out


@cache
def residual_norms_kernel() -> ResidualNorms | None:
    """The kernel, built and checked against residual_norms_eager on first use; None where it
    cannot be built or disagrees (a warning says why): the decoder then runs the eager chain."""
    return checked(ResidualNorms, _mismatch, "residual adds and norms stay eager")


def _mismatch(kernel: ResidualNorms) -> str:
    """'' when the kernel equals the eager chain on made-up rows, with and without the second
    norm (bf16: bit for bit; float32: to a float32 rounding); else what differs."""
    g = torch.Generator().manual_seed(0)
    rows, dim = 3, 8 * kernel.lanes
    h = (torch.randn(rows, dim, generator=g) * 4).bfloat16()
    y = (torch.randn(rows, dim, generator=g) * 30).bfloat16()
    w1, w2 = ((1 + torch.randn(dim, generator=g)).bfloat16() for _ in range(2))
    eps = torch.tensor(1e-6, dtype=torch.bfloat16)
    for second in (w2, None):
        want = residual_norms_eager(h, y, w1, second, eps)
        got = kernel(h, y, w1, second, eps)
        if not torch.equal(got[0], want[0]) or (second is not None and not torch.equal(got[1], want[1])):
            return f"differs from the eager chain ({'with' if second is not None else 'without'} the second norm)"
    if not torch.equal(kernel.norm(h, w2, eps), rms_norm(h, w2, eps, 1.0 / dim, exact_sums=True)):
        return "differs from the eager chain (the norm alone)"
    h, y, w1, w2, eps = (t.float() for t in (h, y, w1, w2, eps))
    got, want = kernel(h, y, w1, w2, eps), residual_norms_eager(h, y, w1, w2, eps)
    assert got[1] is not None and want[1] is not None
    alone = (kernel.norm(h, w2, eps), rms_norm(h, w2, eps, 1.0 / dim, exact_sums=True))
    for a, b in ((got[0], want[0]), (got[1], want[1]), alone):
        if not float32_close(a, b):
            return "differs from the eager chain in float32"
    return ""
