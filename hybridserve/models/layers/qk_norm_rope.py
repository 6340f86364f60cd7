"""The q/k heads' RMSNorm and RoPE of a decoder layer in one native pass (bf16; float32 for the
decode stack): the C kernel of qk_norm_rope.c (it says why and how), built by
models/platform/native_build.py.

`qk_norm_rope_eager` is the general path it equals bit for bit in bf16 (the decoder's own
chain with exact sums) and to a float32 rounding in float32 (the float32 form serves the
decode stack, models/arch/decode_stack.py); `QKNormRope.supports` says which inputs the
kernel takes, and the decoder keeps the general path for the rest and where no compiler is
found."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from hybridserve.models.layers.kernel_checks import float32_close
from hybridserve.models.layers.rms_norm import rms_norm
from hybridserve.models.layers.rope import apply_rope_
from hybridserve.models.platform.native_build import build, checked

SOURCE = Path(__file__).with_name("qk_norm_rope.c")


def qk_norm_rope_eager(qk: torch.Tensor, weight: torch.Tensor | None, eps: torch.Tensor, cos: torch.Tensor | None,
                       sin: torch.Tensor | None) -> None:
    """In place on qk [T, heads, hd] (a view of the qkv projection): the RMSNorm of each head
    with exact sums, times weight [heads, hd] (None: no norm), then RoPE where cos / sin
    ([T, 1, hd]) are given."""
    if weight is not None:
        torch.mul(rms_norm(qk, None, eps, 1.0 / qk.shape[-1], exact_sums=True), weight, out=qk)
    if cos is not None and sin is not None:
        apply_rope_(qk, cos, sin)


class QKNormRope:
    """qk_norm_rope_eager's result computed by the C kernel, for the inputs `supports` takes."""

    def __init__(self) -> None:
        library = build("qk_norm_rope", SOURCE)
        for name in ("qk_norm_rope_max_head_dim", "qk_norm_rope_lanes"):
            getattr(library, name).restype = ctypes.c_int64
        self.max_head_dim = library.qk_norm_rope_max_head_dim()
        self.lanes = library.qk_norm_rope_lanes()
        fn = library.qk_norm_rope
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, i64, i64, i64, ptr, ctypes.c_double, ctypes.c_double, ptr, ptr, ctypes.c_int32]
        fn.restype = None
        self._fn = fn
        self._fn_f32 = library.qk_norm_rope_f32
        self._fn_f32.argtypes, self._fn_f32.restype = fn.argtypes, None

    def function(self, dtype: torch.dtype):  # type: ignore[no-untyped-def]
        """The C function for heads of `dtype` (bf16 or float32; the decode stack calls it too)."""
        return self._fn if dtype == torch.bfloat16 else self._fn_f32

    def supports(self, qk: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor | None) -> bool:
        """bf16 or float32 on the CPU, each row's heads contiguous (the qkv projection's rows
        may be wider), a head dim the kernel's vectors divide (float32: its halves too), a
        contiguous weight (None: RoPE alone) and tables of that dtype; something to do (a
        weight or tables)."""
        if qk.device.type != "cpu" or qk.dtype not in (torch.bfloat16, torch.float32) or qk.dim() != 3:
            return False
        _, heads, hd = qk.shape
        multiple = self.lanes * (2 if qk.dtype == torch.float32 else 1)
        if hd % multiple or hd % 2 or hd > self.max_head_dim or qk.stride()[1:] != (hd, 1):
            return False
        if weight is None:
            if cos is None:
                return False
        elif weight.dtype != qk.dtype or weight.shape != (heads, hd) or not weight.is_contiguous():
            return False
        return cos is None or (cos.dtype == qk.dtype and cos.is_contiguous() and cos.shape[-1] == hd)

    def __call__(self, qk: torch.Tensor, weight: torch.Tensor | None, eps: torch.Tensor, cos: torch.Tensor | None,
                 sin: torch.Tensor | None) -> None:
        T, heads, hd = qk.shape
        if cos is not None and sin is not None:
            if cos.shape != (T, 1, hd) or sin.shape != cos.shape or not sin.is_contiguous():
                raise ValueError(f"rope tables {tuple(cos.shape)} / {tuple(sin.shape)} for {T} rows of {hd}")
        if T:
            fn = self.function(qk.dtype)
            fn(qk.data_ptr(), T, qk.stride(0), heads, hd, None if weight is None else weight.data_ptr(), float(eps),
               1.0 / hd, None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(),
               torch.get_num_threads())


@cache
def qk_norm_rope_kernel() -> QKNormRope | None:
    """The kernel, built and checked against qk_norm_rope_eager on first use; None where it
    cannot be built or disagrees (a warning says why): the decoder then runs the eager chain."""
    return checked(QKNormRope, _mismatch, "q/k norm and RoPE stay eager")


def _mismatch(kernel: QKNormRope) -> str:
    """'' when the kernel equals the eager chain on made-up heads, with and without RoPE
    (bf16: bit for bit; float32: to a float32 rounding); else what differs."""
    g = torch.Generator().manual_seed(0)
    rows, heads, hd = 3, 3, 4 * kernel.lanes
    qkv = (torch.randn(rows, (heads + 1) * hd, generator=g) * 3).bfloat16()
    weight = (1 + torch.randn(heads, hd, generator=g)).bfloat16()
    angles = torch.randn(rows, 1, hd, generator=g)
    eps = torch.tensor(1e-6, dtype=torch.bfloat16)
    rope = (angles.cos().bfloat16(), angles.sin().bfloat16())
    rope32 = (angles.cos(), angles.sin())
    cases = [(qkv, weight, rope, "norm and RoPE"), (qkv, weight, (None, None), "the norm alone"),
             (qkv, None, rope, "RoPE alone"), (qkv.float(), weight.float(), rope32, "float32")]
    for x, w, (cos, sin), what in cases:
        want = x.clone()
        qk_norm_rope_eager(want[:, : heads * hd].view(rows, heads, hd), w, eps.to(x.dtype), cos, sin)
        got = x.clone()
        kernel(got[:, : heads * hd].view(rows, heads, hd), w, eps.to(x.dtype), cos, sin)
        if not (torch.equal(got, want) if x.dtype == torch.bfloat16 else float32_close(got, want)):
            return f"differs from the eager chain ({what})"
    return ""
