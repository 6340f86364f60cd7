"""Linears whose weight is int8 values times a float32 scale (plus an offset) per group of
`group_size` consecutive weights of a row: the form of a GGUF's Q8_0, Q5_0, Q6_K and Q4_K
blocks (models/loaders/gguf_groups.py), so the file's values are multiplied exactly.

`GroupWeights` holds one weight so; `make_group_linear` binds it to a (linear,
residual_linear) pair with make_int8_linear's contract. `group_linear_general` is the
general path: each block of rows expanded to float32 (the weight ggml's dequantizer gives)
and multiplied by the input's values in float32, the output rounded once to its dtype.
The native kernel of int8_groups.c (`GroupKernel`, built by models/platform/native_build.py)
is the fast path beside it: the weight packed once in its tiles, each group's int8 values
times the input summed in float32 and multiplied once by the group's scale; the two agree
to float32 rounding (tests/models/test_int8_groups.py). On CPUs without native bf16 the
weight is packed in pairs instead, for the i16 path: the inputs rounded to int16 per group
(2^-16 of the group's largest) and multiplied by AVX2's int16 dot products (one vpdpwssd
where the CPU has AVX-VNNI or AVX512-VNNI), the general path's result to that rounding.
Where the CPU has AVX512-VNNI but not AMX, batches of VNNI_MIN_ROWS rows or more of the
weights whose caller allows it (int8_inputs) take vpdpbusd on inputs rounded to int8 per
group, as llama.cpp rounds its activations: the general path's result to that rounding.
Where no compiler is found, or off the CPU, the general path runs.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from hybridserve.core.errors import ConfigError
from hybridserve.models.platform.cpu_features import has_native_bf16, read_cpu_flags
from hybridserve.models.platform.huge_pages import on_huge_pages, zeros_on_huge_pages
from hybridserve.models.platform.native_build import build, checked

SOURCE = Path(__file__).with_name("int8_groups.c")
TILE = 16  # output columns per tile of the packed layout (int8_groups.c's TILE)
# The largest group the kernel takes: the exact AMX path multiplies one group per tile
# product, and a tile row holds 32 bf16 (64 bytes). GGUF's blocks are 16 or 32 weights.
MAX_KERNEL_GROUP = 32
# The values whose tiles the kernel's exact paths expand narrow (int8_groups.c's
# expand_pairs: q + 192 stays inside one binade of bf16): 7 bits, which every block type of
# models/loaders/gguf_groups.py but Q8_0 keeps to.
NARROW_VALUES = (-64, 63)
# The kernel's paths (int8_groups.c's amx argument): the vector loop, AMX tile products per
# group (the file's values exactly) and AMX over the weights rounded to bf16; without AMX,
# AVX512-BF16 pair products per group ("dpbf16", the file's values exactly); "expand" is
# the weight rounded to bf16 at each call and multiplied by torch's GEMM (large steps);
# "i16" the inputs rounded to int16 per group (2^-16 of the group's largest) and AVX2's
# int16 dot products, on a weight packed for it alone (LAYOUTS); "vnni" the inputs rounded
# to int8 per group (a step of 1/127 of the group's largest) and AVX512-VNNI's vpdpbusd, on
# the tiles (where the CPU has VNNI but not AMX).
PATHS = {"vector": 0, "exact": 1, "folded": 2, "dpbf16": 3, "i16": 4, "vnni": 7, "expand": -1}
# The i16 path's products (int8_groups.c's I16 codes): vpmaddwd + vpaddd with AVX2 alone,
# one vpdpwssd with AVX-VNNI or AVX512-VNNI; exact int32 sums either way.
I16_DOT = {"": 4, "avx_vnni": 5, "avx512_vnni": 6}
# How a packed weight's values lie: "tiles" for every path but i16 (values [N / TILE, K,
# TILE]); "pairs" for i16 ([N / TILE, K / 2, TILE, 2]: int8_groups.c's I16), which a CPU
# without native bf16 packs every weight as (benchmarks/results/group_int8_kernels.md).
LAYOUTS = ("tiles", "pairs")
# What rounding an input to int16 may move it by, relative to its group's largest: half a
# step of max |x| / 32767 (int8_groups.c's i16_quantize_row).
I16_HALF_STEP = 0.5 / 32767
# The same for the vnni path's rounding to int8 (int8_groups.c's vnni_quantize_row).
VNNI_HALF_STEP = 0.5 / 127
# Rows of bf16 inputs from which each path takes over (benchmarks/group_linear.py --paths,
# benchmarks/results/group_int8_kernels.md): with AMX, exact, then folded, then expand;
# with AVX512-BF16 but no AMX, dpbf16, then expand from EXPAND_MIN_ROWS_NO_AMX, and where the
# CPU has AVX512-VNNI, vnni from VNNI_MIN_ROWS to EXPAND_MIN_ROWS_VNNI for the weights whose
# inputs may be rounded (1.4x expand's speed at 256-600 rows, level at 2048); without
# native bf16 (torch's bf16 GEMM is software there: never expand), i16 at every row count on
# a weight packed as pairs, the vector loop on others.
AMX_MIN_ROWS = 3
DPBF16_MIN_ROWS = 4
VNNI_MIN_ROWS = 8
FOLDED_MIN_ROWS = 32
EXPAND_MIN_ROWS = 512
EXPAND_MIN_ROWS_NO_AMX = 512
EXPAND_MIN_ROWS_VNNI = 2048

Linear = Callable[[torch.Tensor], torch.Tensor]
ResidualLinear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Rows of the weight the general path expands at a time: a few MB of float32 at the
# decoder's widths, never a whole second copy of the weight.
_EXPAND_ROWS = 512


class GroupWeights(NamedTuple):
    """A weight [out, in] as int8 `values` times float32 `scale` [out, in / group_size] per
    group, plus float32 `offset` (scale's shape) where the format has one, else None."""

    values: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    group_size: int

    @classmethod
    def from_numpy(cls, values: np.ndarray, scale: np.ndarray, offset: np.ndarray | None,
                   group_size: int) -> GroupWeights:
        """From numpy arrays (gguf_groups.Int8Groups' fields), checked."""
        groups = cls(torch.from_numpy(np.ascontiguousarray(values, dtype=np.int8)),
                     torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32)),
                     None if offset is None else torch.from_numpy(np.ascontiguousarray(offset, dtype=np.float32)),
                     group_size)
        groups.check()
        return groups

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)  # type: ignore[return-value]

    def check(self) -> None:
        """ConfigError unless the fields fit together."""
        if self.values.dtype != torch.int8 or self.values.dim() != 2:
            raise ConfigError(f"group values must be 2-D int8, got {self.values.dtype} {tuple(self.values.shape)}")
        rows, cols = self.values.shape
        if self.group_size <= 0 or cols % self.group_size:
            raise ConfigError(f"rows of {cols} weights are not whole groups of {self.group_size}")
        expected = (rows, cols // self.group_size)
        for name, part in (("scale", self.scale), ("offset", self.offset)):
            if part is not None and (part.dtype != torch.float32 or tuple(part.shape) != expected):
                raise ConfigError(f"group {name} must be float32 {expected}, got {part.dtype} {tuple(part.shape)}")

    def weight(self, rows: slice = slice(None)) -> torch.Tensor:
        """The float32 weight of `rows` (each value times its scale, plus the offset)."""
        values = self.values[rows]
        grouped = values.float().view(values.shape[0], -1, self.group_size) * self.scale[rows, :, None]
        if self.offset is not None:
            grouped += self.offset[rows, :, None]
        return grouped.view(values.shape)

    def regrouped(self, group_size: int) -> GroupWeights:
        """The same weight in groups of `group_size`, which divides this one's: each group's
        scale (and offset) repeated over its parts."""
        if group_size == self.group_size:
            return self
        if group_size <= 0 or self.group_size % group_size:
            raise ConfigError(f"groups of {self.group_size} cannot be split into groups of {group_size}")
        times = self.group_size // group_size
        offset = None if self.offset is None else self.offset.repeat_interleave(times, dim=1)
        return GroupWeights(self.values, self.scale.repeat_interleave(times, dim=1), offset, group_size)


def concat_rows(parts: Sequence[GroupWeights]) -> GroupWeights:
    """The parts' rows stacked (q, k, v into one qkv): groups of the smallest size, offsets
    zero where a part has none."""
    if not parts:
        raise ConfigError("no group weights to stack")
    size = min(p.group_size for p in parts)
    parts = [p.regrouped(size) for p in parts]
    if len({p.values.shape[1] for p in parts}) != 1:
        raise ConfigError(f"stacked group weights differ in width: {[p.values.shape[1] for p in parts]}")
    offset = None
    if any(p.offset is not None for p in parts):
        offset = torch.cat([torch.zeros_like(p.scale) if p.offset is None else p.offset for p in parts])
    return GroupWeights(torch.cat([p.values for p in parts]), torch.cat([p.scale for p in parts]), offset, size)


def group_linear_general(x: torch.Tensor, groups: GroupWeights, bias: torch.Tensor | None = None,
                         residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] times the groups' weight, + bias, + residual [rows, out], in float32,
    rounded once to x's dtype."""
    x32 = x.float()
    out = torch.empty(x.shape[0], groups.values.shape[0], dtype=torch.float32, device=x.device)
    for start in range(0, groups.values.shape[0], _EXPAND_ROWS):
        rows = slice(start, start + _EXPAND_ROWS)
        out[:, rows] = F.linear(x32, groups.weight(rows))
    if bias is not None:
        out += bias.float()
    if residual is not None:
        out += residual.float()
    return out.to(x.dtype)


class PackedGroups(NamedTuple):
    """GroupWeights in the kernel's tiles (int8_groups.c): values [out / TILE, in, TILE] as
    `layout` says (LAYOUTS: tiles, or the i16 path's pairs in the same shape),
    scale and offset [out / TILE, in / group_size, TILE]; narrow: every value is in
    NARROW_VALUES (Q4_K, Q5_0, Q6_K blocks; Q8_0's are not), which the kernel expands faster;
    int8_inputs: the vnni path may serve it, rounding its inputs to int8 (the caller says
    so, for inputs that rounding costs little: models/arch/decoder.py's EXACT_INPUT_ROLES)."""

    values: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    group_size: int
    narrow: bool = False
    layout: str = "tiles"
    int8_inputs: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        tiles, cols, tile = self.values.shape
        return tiles * tile, cols

    @property
    def whole_quads(self) -> bool:
        """Groups of whole 4s: the vnni path sums four products a lane, never across groups."""
        return self.group_size % 4 == 0


def _tiles(t: torch.Tensor) -> torch.Tensor:
    """t [N, C] as the kernel's tiles [N / TILE, C, TILE], a view (on_huge_pages copies it)."""
    return t.view(t.shape[0] // TILE, TILE, t.shape[1]).transpose(1, 2)


def _pairs(values: torch.Tensor) -> torch.Tensor:
    """int8 values [N, K] as the i16 path's pairs: column c's two consecutive k side by
    side, [N / TILE, K / 2, TILE, 2] viewed as [N / TILE, K, TILE]."""
    n, k = values.shape
    return values.view(n // TILE, TILE, k // 2, 2).permute(0, 2, 1, 3).contiguous().view(n // TILE, k, TILE)


def zero_pairs(rows: int, cols: int, group_size: int) -> PackedGroups:
    """A [rows, cols] weight in the i16 path's pairs with no offset, all zero (on huge
    pages), to be filled a block of rows at a time by fill_pairs (a weight made in parts,
    as a head's chunks are, packed without a whole copy beside it)."""
    if rows % TILE or cols % group_size or group_size % 2:
        raise ValueError(f"pairs of {rows} x {cols} in groups of {group_size}: rows whole tiles of {TILE}, "
                         "columns whole groups, groups even")
    return PackedGroups(zeros_on_huge_pages((rows // TILE, cols, TILE), torch.int8),
                        zeros_on_huge_pages((rows // TILE, cols // group_size, TILE), torch.float32), None,
                        group_size, False, "pairs")


def fill_pairs(packed: PackedGroups, first_row: int, groups: GroupWeights) -> None:
    """Rows first_row .. of zero_pairs' `packed` from `groups` (no offset, packed's group
    size, first_row and the row count whole tiles)."""
    groups.check()
    rows, cols = groups.values.shape
    if (packed.layout != "pairs" or groups.offset is not None or groups.group_size != packed.group_size
            or cols != packed.shape[1] or first_row % TILE or rows % TILE or first_row + rows > packed.shape[0]):
        raise ValueError(f"rows {first_row}..{first_row + rows} of {cols} in groups of {groups.group_size} do not "
                         f"fit pairs {packed.shape} in groups of {packed.group_size}")
    tiles = slice(first_row // TILE, (first_row + rows) // TILE)
    packed.values[tiles] = _pairs(groups.values)
    packed.scale[tiles] = _tiles(groups.scale)


def unpack_pairs(packed: PackedGroups, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values [stop - start, cols], float32 scale [stop - start, cols / group_size])
    of rows start .. stop of a weight in pairs (whole tiles), as fill_pairs was given them."""
    if packed.layout != "pairs" or start % TILE or stop % TILE or not 0 <= start <= stop <= packed.shape[0]:
        raise ValueError(f"rows {start}..{stop} of pairs {packed.shape} (whole tiles of {TILE})")
    tiles = slice(start // TILE, stop // TILE)
    n, k = stop - start, packed.shape[1]
    values = packed.values[tiles].reshape(n // TILE, k // 2, TILE, 2).permute(0, 2, 1, 3).reshape(n, k)
    scale = packed.scale[tiles].transpose(1, 2).reshape(n, -1)
    return values, scale


class GroupKernel:
    """group_linear_general's result from the C kernel, for the weights `packable` takes."""

    def __init__(self) -> None:
        library = build("int8_groups", SOURCE)
        fn = library.group_linear
        i64, i32, ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
        fn.argtypes = [ptr, i32, i64, i64, i64, ptr, ptr, ptr, i64, i64, ptr, ptr, i64, ptr, i64, i32, i32, i32]
        fn.restype = ctypes.c_int
        self._fn = fn
        expand = library.group_expand
        expand.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr, i32]
        expand.restype = None
        self._expand = expand
        # AMX: built in (an x86-64 AVX-512 build), on this CPU, and its tile state granted by Linux.
        flags = read_cpu_flags()
        self.amx = bool(library.group_linear_has_amx()) and "amx_bf16" in flags and bool(library.group_linear_amx_ready())
        self.native_bf16 = has_native_bf16(flags)
        self.dpbf16 = bool(library.group_linear_has_dpbf16()) and "avx512_bf16" in flags
        self.i16 = bool(library.group_linear_has_i16()) and "avx2" in flags
        self.vnni = bool(library.group_linear_has_vnni()) and "avx512_vnni" in flags
        # the i16 path's products as one vpdpwssd where the CPU has one (I16_DOT codes)
        vnni = bool(library.group_linear_has_i16_vnni())
        self.i16_dot = ("avx512_vnni" if vnni and {"avx512_vnni", "avx512vl"} <= flags
                        else "avx_vnni" if vnni and "avx_vnni" in flags else "")

    @property
    def packs_pairs(self) -> bool:
        """Whether pack lays weights out in pairs here (the i16 path: AVX2 without native
        bf16 or AMX), else in tiles."""
        return self.i16 and not (self.native_bf16 or self.amx)

    @staticmethod
    def packable(groups: GroupWeights) -> bool:
        """Whole tiles of output rows and groups of an even size (the kernel's two
        accumulator sets take alternate weights) up to MAX_KERNEL_GROUP."""
        rows, _ = groups.values.shape
        size = groups.group_size
        return rows % TILE == 0 and size % 2 == 0 and size <= MAX_KERNEL_GROUP and groups.values.device.type == "cpu"

    def pack(self, groups: GroupWeights, layout: str | None = None, int8_inputs: bool = False) -> PackedGroups:
        """The weight in the kernel's tiles, on transparent huge pages where Linux offers them
        (a step streams them whole: models/platform/huge_pages.py); in `layout` (tests and
        benchmarks), else as the paths this CPU takes for it read it: pairs where the CPU
        has no native bf16, tiles elsewhere. int8_inputs: PackedGroups'."""
        groups.check()
        offset = None if groups.offset is None else on_huge_pages(_tiles(groups.offset))
        narrow = groups.values.numel() > 0 and NARROW_VALUES[0] <= int(groups.values.min()) \
            and int(groups.values.max()) <= NARROW_VALUES[1]
        if layout is None:
            layout = "pairs" if self.packs_pairs else "tiles"
        if layout not in LAYOUTS:
            raise ValueError(f"no packed layout {layout!r}: {', '.join(LAYOUTS)}")
        values = _pairs(groups.values) if layout == "pairs" else _tiles(groups.values)
        return PackedGroups(on_huge_pages(values), on_huge_pages(_tiles(groups.scale)), offset, groups.group_size,
                            narrow, layout, int8_inputs)

    def _expand_mm(self, x: torch.Tensor, packed: PackedGroups, bias: torch.Tensor | None,
                   residual: torch.Tensor | None) -> torch.Tensor:
        """x times the weight expanded to bf16 for this call (torch's GEMM), + residual in
        its epilogue, + bias."""
        weight_t = self.expanded(packed)
        x = x.to(torch.bfloat16)
        out = torch.mm(x, weight_t) if residual is None else torch.addmm(residual.to(torch.bfloat16), x, weight_t)
        return out if bias is None else (out.float() + bias).to(torch.bfloat16)

    def expanded(self, packed: PackedGroups) -> torch.Tensor:
        """The weight rounded to bf16, transposed: [in, out] (from tiles)."""
        if packed.layout != "tiles":
            raise ValueError(f"the expand path reads tiles, not {packed.layout}")
        n, k = packed.shape
        out = torch.empty(k, n, dtype=torch.bfloat16)
        self._expand(packed.values.data_ptr(), packed.scale.data_ptr(),
                     None if packed.offset is None else packed.offset.data_ptr(), n, k, packed.group_size,
                     out.data_ptr(), torch.get_num_threads())
        return out

    def path_code(self, path: str) -> int:
        """group_linear's code for `path` on this CPU (i16's products by its vpdpwssd where
        it has one)."""
        return I16_DOT[self.i16_dot] if path == "i16" else PATHS[path]

    def path(self, rows: int, dtype: torch.dtype, packed: PackedGroups) -> str:
        """The path `rows` rows of `dtype` take: i16 at every row count on pairs; on tiles,
        float32 inputs always take the vector loop, whose sums are the file's values times
        the input's, float32 rounding aside (float32 named where bf16 is native is a request
        for that precision)."""
        if packed.layout == "pairs":
            return "i16"
        if dtype != torch.bfloat16:
            return "vector"
        if not self.amx:
            vnni = self.vnni and packed.int8_inputs and packed.whole_quads
            if vnni and VNNI_MIN_ROWS <= rows < EXPAND_MIN_ROWS_VNNI:
                return "vnni"
            if self.native_bf16 and rows >= EXPAND_MIN_ROWS_NO_AMX:
                return "expand"
            return "dpbf16" if self.dpbf16 and rows >= DPBF16_MIN_ROWS else "vector"
        if rows >= EXPAND_MIN_ROWS:
            return "expand"
        if rows >= FOLDED_MIN_ROWS and packed.shape[1] % 32 == 0:
            return "folded"
        return "exact" if rows >= AMX_MIN_ROWS else "vector"

    def invariant_path(self, dtype: torch.dtype, packed: PackedGroups) -> str:
        """The path a batch-invariant model takes at every row count for inputs of `dtype`:
        one whose rows are each computed alike whatever the other rows (the kernel splits
        the output's columns between threads, never a row's sums), and the fastest such
        one here for batches: with AMX the folded tiles (the default's path from 32 rows;
        benchmarks/results/batch_invariant.md: 2.3x the exact tiles' prefill, 15% slower on
        one row), or the exact ones where the input width is not a multiple of 32; else
        AVX512-BF16's pair products; else the vector loop."""
        if packed.layout == "pairs":
            return "i16"  # each row quantized and multiplied alone
        if dtype == torch.bfloat16 and self.amx:
            return "folded" if packed.shape[1] % 32 == 0 else "exact"
        return "dpbf16" if dtype == torch.bfloat16 and self.dpbf16 else "vector"

    def __call__(self, x: torch.Tensor, packed: PackedGroups, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None, path: str | None = None) -> torch.Tensor:
        """x [rows, in] (bf16 or float32; other float dtypes via float32) times the weight,
        + bias (float32 [out]), + residual [rows, out], rounded once to x's dtype. `path`
        (tests and benchmarks) overrides the one self.path picks; an AMX path needs AMX
        (self.amx) and bf16 inputs, "folded" an input width a multiple of 32."""
        out_dtype = x.dtype
        if x.dtype not in (torch.bfloat16, torch.float32):
            x = x.float()
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows, (n, k) = x.shape[0], packed.shape
        if x.shape[1] != k:
            raise ValueError(f"input of width {x.shape[1]} for a weight of width {k}")
        if residual is not None:
            residual = residual.to(x.dtype)
            if residual.stride(-1) != 1:
                residual = residual.contiguous()
        path = path or self.path(rows, x.dtype, packed)
        if path not in PATHS:
            raise ValueError(f"no int8-group path {path!r}: {', '.join(PATHS)}")
        if path in ("exact", "folded") and not (self.amx and x.dtype == torch.bfloat16):
            raise ValueError(f"the {path} path needs AMX and bf16 inputs")  # AMX code without AMX would fault
        if path == "dpbf16" and not (self.dpbf16 and x.dtype == torch.bfloat16):
            raise ValueError("the dpbf16 path needs AVX512-BF16 and bf16 inputs")
        if path == "vnni" and not (self.vnni and packed.whole_quads):
            raise ValueError("the vnni path needs AVX512-VNNI and groups of a multiple of 4")
        if (path == "i16") != (packed.layout == "pairs") or (path == "i16" and not self.i16):
            raise ValueError(f"the {path} path on a weight packed as {packed.layout} (i16 needs AVX2 and pairs, "
                             "every other path tiles)")
        if path == "folded" and k % 32:
            raise ValueError(f"the folded path steps through the inputs 32 at a time, not {k}")
        if path == "expand":
            return self._expand_mm(x, packed, bias, residual).to(out_dtype)
        out = torch.empty(rows, n, dtype=x.dtype)
        if rows:
            failed = self._fn(x.data_ptr(), int(x.dtype == torch.bfloat16), x.stride(0), rows, k,
                              packed.values.data_ptr(), packed.scale.data_ptr(),
                              None if packed.offset is None else packed.offset.data_ptr(), n, packed.group_size,
                              None if bias is None else bias.data_ptr(),
                              None if residual is None else residual.data_ptr(),
                              0 if residual is None else residual.stride(0), out.data_ptr(), n,
                              torch.get_num_threads(), self.path_code(path), int(packed.narrow))
            if failed:
                raise MemoryError(f"int8 groups: no memory for a {rows} x {k} input's float32 copy")
        return out if out.dtype == out_dtype else out.to(out_dtype)


@cache
def group_kernel() -> GroupKernel | None:
    """The kernel, built and checked against group_linear_general on first use; None where
    it cannot be built or disagrees (a warning says why): the general path runs instead."""
    return checked(GroupKernel, _mismatch, "int8 group linears take the general path")


def input_rounding_error(x: torch.Tensor, groups: GroupWeights, path: str) -> torch.Tensor:
    """The most a path's rounding of the inputs can move each output: on i16 (vnni) every
    input is within I16_HALF_STEP (VNNI_HALF_STEP) times its group's largest |x| of the
    value multiplied, so an output moves by at most the sum over k of |weight| times that;
    zero on the other paths, which multiply the inputs as they are."""
    half = {"i16": I16_HALF_STEP, "vnni": VNNI_HALF_STEP}.get(path)
    if half is None:
        return torch.zeros(x.shape[0], groups.values.shape[0])
    half_step = x.float().abs().view(x.shape[0], -1, groups.group_size).amax(-1) * half
    return half_step.repeat_interleave(groups.group_size, dim=1) @ groups.weight().abs().t()


def _mismatch(kernel: GroupKernel) -> str:
    """'' when every path this CPU runs gives the general path's result, else what differs:
    within 2^-7 of the sum of the terms' magnitudes (one bf16 rounding of the output, and
    of each weight where the path rounds the weights to bf16: a wrong scale, offset, tile or
    row is off by far more), plus, on the i16 path, what its rounding of the inputs allows
    (input_rounding_error), and on the vnni path its rounding to int8, at rows of every
    row block's remainder, with offsets, a bias and a residual, in groups of 16 and 32, on
    narrow values too, float32 inputs on the vector loop, i16 and vnni."""
    g = torch.Generator().manual_seed(0)
    paths = ["vector", "expand"] + (["exact", "folded"] if kernel.amx else []) + (["dpbf16"] if kernel.dpbf16 else [])
    paths += (["i16"] if kernel.i16 else []) + (["vnni"] if kernel.vnni else [])
    for size, (low, high) in ((16, (-128, 128)), (32, (-128, 128)), (32, (NARROW_VALUES[0], NARROW_VALUES[1] + 1))):
        groups = GroupWeights(torch.randint(low, high, (48, 96), dtype=torch.int8, generator=g),
                              torch.rand(48, 96 // size, generator=g), torch.randn(48, 96 // size, generator=g), size)
        bias = torch.randn(48, generator=g)
        packed = kernel.pack(groups, "tiles")
        pairs = kernel.pack(groups, "pairs") if kernel.i16 else None
        for path in paths:
            for rows in (1, 2, 3, 4, 5, 9, 17):
                for dtype in (torch.float32, torch.bfloat16) if path in ("vector", "i16", "vnni") else (torch.bfloat16,):
                    x, h = torch.randn(rows, 96, generator=g).to(dtype), torch.randn(rows, 48, generator=g).to(dtype)
                    got = kernel(x, pairs if path == "i16" else packed, bias, h, path=path).float()
                    expected = group_linear_general(x, groups, bias, h).float()
                    magnitude = x.float().abs() @ groups.weight().abs().t() + h.float().abs() + bias.abs()
                    allowed = magnitude * 2.0 ** -7 + input_rounding_error(x, groups, path)
                    if not ((got - expected).abs() <= allowed).all():
                        return (f"the {path} path differs from the general path at {rows} {dtype} rows, groups of "
                                f"{size}, values in [{low}, {high})")
    return ""


class PackedLinear:
    """A group weight in the kernel's tiles as a Linear: what decode_stack.py reads (the
    kernel, its tiles and bias) besides the call."""

    __slots__ = ("kernel", "packed", "bias", "path")

    def __init__(self, kernel: GroupKernel, packed: PackedGroups, bias: torch.Tensor | None) -> None:
        self.kernel, self.packed, self.bias = kernel, packed, bias
        self.path: str | None = None  # one path at every row count (batch-invariant models), else by rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.packed, self.bias, path=self.path)

    def residual(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.packed, self.bias, h, path=self.path)


def make_group_linear(groups: GroupWeights, bias: torch.Tensor | None,
                      int8_inputs: bool = False) -> tuple[Linear, ResidualLinear]:
    """(linear, residual_linear) for a group weight: inputs and outputs in the activations'
    dtype (bf16 or float32), products and sums in float32; with int8_inputs, batches of
    VNNI_MIN_ROWS rows or more may take the vnni path where the CPU has it (PackedGroups)."""
    groups.check()
    bias32 = None if bias is None else bias.detach().float()
    kernel = group_kernel() if GroupKernel.packable(groups) else None
    if kernel is not None:
        fast = PackedLinear(kernel, kernel.pack(groups, int8_inputs=int8_inputs), bias32)  # the caller drops `groups`
        return fast, fast.residual

    def linear(x: torch.Tensor) -> torch.Tensor:
        return group_linear_general(x, groups, bias32)

    def residual(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return group_linear_general(x, groups, bias32, h)

    return linear, residual
