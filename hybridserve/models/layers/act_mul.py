"""A gated MLP's act(gate) * up for bf16 rows in one native pass, the activation read from a
table of its eager values (float32 rows, for the decode stack: computed): the C kernel of
act_mul.c (it says why and how), built by models/platform/native_build.py.

`act_mul_eager` is the general path it equals bit for bit. `ActMul.table(act, width)` makes
a table from an activation (any element-wise function of one bf16 value: SiLU, GELU, the
tanh GELU, ...); `ActMul.supports` says which inputs the kernel takes, and the decoder
keeps the general path for the rest and where no compiler is found.

float32 rows (the decode stack of a float32 model, models/arch/decode_stack.py) take
`ActMul.computed`: the activations of COMPUTED (the config's names) computed in C, within
a few float32 roundings of torch's (closer than torch's own tanh GELU in its negative tail,
where 1 + tanh cancels)."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from hybridserve.models.layers.kernel_checks import float32_close
from hybridserve.models.platform.native_build import build, checked

SOURCE = Path(__file__).with_name("act_mul.c")

# Widths (gate's) the kernel takes are multiples of this: torch's widest bf16 vector (AVX-512)
# then divides every row, so the eager activation takes its vector loop for every value, as
# it does for the table's, and never the scalar tail (another exp: other last bits).
WIDTH_MULTIPLE = 32
# act_mul.c's codes of the activations its float32 form computes, by ModelConfig.activation
COMPUTED = {"silu": 0, "gelu_tanh": 1}

Activation = Callable[[torch.Tensor], torch.Tensor]


def every_bf16() -> torch.Tensor:
    """The 65536 bf16 values, by bit pattern (NaNs and infinities included)."""
    return torch.from_numpy(np.arange(1 << 16, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)


def act_mul_eager(gate_up: torch.Tensor, act: Activation) -> torch.Tensor:
    """act(gate) * up for gate_up [rows, 2 * width] (gate, then up)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


class ActMul:
    """act_mul_eager's result computed by the C kernel from a table of act's values, for the
    inputs `supports` takes."""

    def __init__(self) -> None:
        library = build("act_mul", SOURCE)
        fn = library.act_mul
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, i64, i64, ptr, ptr, ctypes.c_int32]
        fn.restype = None
        self._fn = fn
        self._fn_f32 = library.act_mul_f32
        self._fn_f32.argtypes = [ptr, i64, i64, i64, ctypes.c_int32, ptr, i64, ctypes.c_int32]
        self._fn_f32.restype = None

    @staticmethod
    def table(act: Activation, width: int) -> torch.Tensor:
        """act of every bf16 value, by bit pattern, and one padding entry (the kernel's
        gathers read 4 bytes at each entry). `act` is called as the general path calls it,
        on the gate half of a gate|up product `width` gates wide: torch's bf16 GELU takes
        another loop (other last bits) for a strided view than for a contiguous tensor."""
        rows = -(-(1 << 16) // width)
        gates = torch.zeros(rows * width, dtype=torch.bfloat16)
        gates[: 1 << 16] = every_bf16()
        gate_up = torch.cat((gates.view(rows, width), torch.zeros(rows, width, dtype=torch.bfloat16)), dim=1)
        values = act(gate_up.chunk(2, dim=-1)[0])
        if values.dtype != torch.bfloat16 or values.shape != (rows, width):
            raise ValueError(f"an activation for the table returned {values.dtype} {tuple(values.shape)}")
        values = values.reshape(-1)[: 1 << 16]
        return torch.cat((values, values[:1])).contiguous()

    @staticmethod
    def supports(gate_up: torch.Tensor) -> bool:
        """bf16 rows on the CPU (unit column stride) whose halves are WIDTH_MULTIPLE wide."""
        return (gate_up.device.type == "cpu" and gate_up.dtype == torch.bfloat16 and gate_up.dim() == 2
                and gate_up.stride(1) == 1 and gate_up.shape[1] % (2 * WIDTH_MULTIPLE) == 0)

    @staticmethod
    def supports_computed(gate_up: torch.Tensor, activation: str) -> bool:
        """What `computed` takes: float32 rows on the CPU (unit column stride) and an
        activation of COMPUTED."""
        return (activation in COMPUTED and gate_up.device.type == "cpu" and gate_up.dtype == torch.float32
                and gate_up.dim() == 2 and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0)

    def computed(self, gate_up: torch.Tensor, activation: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """act(gate) * up [rows, width] of float32 rows, the activation (COMPUTED's name)
        computed; written into `out` where given: float32 rows of that shape (unit column
        stride) in other memory than gate_up's, or its gate half itself (`gate_half`: the
        product in place, no new memory)."""
        if not self.supports_computed(gate_up, activation):
            raise ValueError(f"act_mul computes {sorted(COMPUTED)} on float32 CPU rows, not {activation} on "
                             f"{gate_up.dtype} {tuple(gate_up.shape)}")
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        if out is None:
            out = torch.empty(rows, width)
        elif (out.shape != (rows, width) or out.dtype != torch.float32 or out.device.type != "cpu"
              or (rows > 1 and out.stride(0) < width) or (width > 1 and out.stride(1) != 1)):
            raise ValueError(f"not an output for {rows} x {width} float32 values: {out.dtype} {tuple(out.shape)} "
                             f"strides {out.stride()}")
        elif (out.untyped_storage().data_ptr() == gate_up.untyped_storage().data_ptr()
              and not _is_gate_half(out, gate_up)):
            raise ValueError("an output in gate_up's memory must be its gate half")
        if rows:
            self._fn_f32(gate_up.data_ptr(), gate_up.stride(0), rows, width, COMPUTED[activation], out.data_ptr(),
                         out.stride(0), torch.get_num_threads())
        return out

    def __call__(self, gate_up: torch.Tensor, table: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """act(gate) * up [rows, width], written into `out` where given (contiguous bf16 of
        that shape: a row block of a larger step's result, so no concatenation)."""
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        if table.shape != ((1 << 16) + 1,) or table.dtype != torch.bfloat16 or not table.is_contiguous():
            raise ValueError(f"not an activation table: {table.dtype} {tuple(table.shape)}")
        if out is None:
            out = torch.empty(rows, width, dtype=torch.bfloat16)
        elif out.shape != (rows, width) or out.dtype != torch.bfloat16 or not out.is_contiguous():
            raise ValueError(f"not an output for {rows} x {width} bf16 values: {out.dtype} {tuple(out.shape)}")
        if rows:
            self._fn(gate_up.data_ptr(), gate_up.stride(0), rows, width, table.data_ptr(), out.data_ptr(),
                     torch.get_num_threads())
        return out


def gate_half(gate_up: torch.Tensor) -> torch.Tensor:
    """The gate half of gate_up rows (a view): where ActMul.computed may write in place."""
    return gate_up[:, : gate_up.shape[1] // 2]


def _is_gate_half(out: torch.Tensor, gate_up: torch.Tensor) -> bool:
    half = gate_half(gate_up)
    return out.data_ptr() == half.data_ptr() and out.shape == half.shape and out.stride() == half.stride()


@cache
def act_mul_kernel() -> ActMul | None:
    """The kernel, built and checked against act_mul_eager on first use; None where it cannot
    be built or disagrees (a warning says why): the decoder then runs the eager chain."""
    return checked(ActMul, _mismatch, "the MLP's activation stays eager")


def _mismatch(kernel: ActMul) -> str:
    """'' when the kernel equals the eager chain bit for bit (NaN as NaN) with every bf16
    value as a gate (rows wider than the vectors, a step over the parallel threshold), and
    its computed float32 activations to a float32 rounding, else what differs."""
    g = torch.Generator().manual_seed(0)
    rows, width = 16, 1 << 12
    gate = every_bf16().view(rows, width)
    up = (torch.randn(rows, width, generator=g) * 3).bfloat16()
    gate_up = torch.cat((gate, up), dim=1)
    act = F.silu
    if not same_values(kernel(gate_up, kernel.table(act, width)), act_mul_eager(gate_up, act)):
        return "differs from the eager chain"
    gate_up = torch.cat((torch.randn(rows, width, generator=g) * 4, up.float()), dim=1)
    for name, eager in (("silu", F.silu), ("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"))):
        if not float32_close(kernel.computed(gate_up, name), act_mul_eager(gate_up, eager)):
            return f"differs from the eager chain (float32, {name})"
    return ""


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b hold the same bits wherever either is a number, and NaN where either
    is NaN (a NaN's payload bits differ between torch's conversions on different CPUs)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.view(torch.int16)[~nan], b.view(torch.int16)[~nan])
