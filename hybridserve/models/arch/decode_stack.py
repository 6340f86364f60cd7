"""A decode step's decoder layers as one native call: decode_stack.c (it says what it runs
and why), built by models/platform/native_build.py.

DecoderLM.forward's loop is the general path; this is its fast path for the steps and
models the C loop walks, taken before the loop: in bf16 bit for bit the same hidden states,
in float32 (CPUs without native bf16) the same to float32 rounding, the kernels' float32
forms summing norms exactly and computing the activation where the loop takes ATen's
(tests/models/test_decode_stack.py). `DecodeStack.build` makes one for a model whose layers
are all what that loop does: bf16 or float32 on the CPU (float32: SiLU or the tanh GELU,
act_mul.COMPUTED), one rank, sandwich norms with q/k norms
(Gemma 3), every linear a packed int8-group weight (--quantization gguf-groups) of one
shape per role in every layer (the kernel's path depends on the shape, on whether the
inputs may be rounded to int8 and on whether the groups are whole 4s, each the same per
role in every layer; group sizes may differ), and every native kernel the loop calls built. A step is taken (`__call__`
answers its final residual stream, on a last stage final-normed as stage_output does; None
leaves it to the loop) when:
- the step's attention hands every group to its in-place decode kernel
  (StepAttention.decode_plan_addresses: one token per request, every slot written, no padding), whose
  address the stack calls;
- every layer's cache is in the model's dtype, or all in bf16 under a float32 model (its
  K/V rounded as they are written, as the loop's index_copy_ converts them);
- its rows take one of the group kernel's own paths (not the expand path of prefill-sized
  steps, whose product is torch's GEMM);
- the caller says it is not a step the large-step chains normalise with exact sums.
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from functools import cache
from pathlib import Path
from typing import Any

import torch

from hybridserve.models.layers.act_mul import COMPUTED, act_mul_kernel
from hybridserve.models.layers.int8_groups import PackedLinear
from hybridserve.models.layers.qk_norm_rope import qk_norm_rope_kernel
from hybridserve.models.layers.residual_norms import residual_norms_kernel
from hybridserve.models.layers.rope import RopeTable
from hybridserve.core.errors import one_line
from hybridserve.models.platform.native_build import NativeBuildError, build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_stack.c")
ROLES = ("qkv", "o", "gate_up", "down")  # decode_stack.c's QKV, O, GATE_UP, DOWN
_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p


class _Kernels(ctypes.Structure):
    _fields_ = [("linear", _ptr), ("qk_norm_rope", _ptr), ("residual_norms", _ptr), ("rms_norms", _ptr),
                ("attend", _ptr), ("act_mul", _ptr), ("act_mul_f32", _ptr)]


class _Linear(ctypes.Structure):
    _fields_ = [("values", _ptr), ("scale", _ptr), ("offset", _ptr), ("bias", _ptr), ("n", _i64), ("k", _i64),
                ("group_size", _i64), ("narrow", _i32)]


class _Layer(ctypes.Structure):
    _fields_ = [("linears", _Linear * len(ROLES)), ("input_norm", _ptr), ("qk_norm", _ptr), ("post_attn_norm", _ptr),
                ("pre_ffn_norm", _ptr), ("post_ffn_norm", _ptr), ("group", _i64), ("rope", _i64)]


class _GroupStep(ctypes.Structure):
    _fields_ = [("slots", _ptr), ("ids", _ptr), ("first", _ptr), ("count", _ptr), ("blocks_per_row", _i64)]


class _RopeStep(ctypes.Structure):
    _fields_ = [("cos", _ptr), ("sin", _ptr)]  # a RopeTable's whole tables


class _Step(ctypes.Structure):
    _fields_ = [("rows", _i64), ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
                ("intermediate", _i64), ("block_size", _i64), ("eps", ctypes.c_double), ("scale", ctypes.c_float),
                ("softcap", ctypes.c_float), ("paths", _i32 * len(ROLES)), ("threads", _i32), ("f32", _i32),
                ("kv_bf16", _i32), ("activation", _i32), ("groups", _ptr),
                ("ropes", _ptr), ("num_ropes", _i64), ("table_rows", _i64), ("positions", _ptr), ("rope_rows", _ptr),
                ("caches", _ptr), ("block_strides", _ptr), ("act_table", _ptr), ("h", _ptr),
                ("h_out", _ptr * 2), ("x", _ptr), ("qkv", _ptr), ("attn", _ptr), ("sub", _ptr), ("gate_up", _ptr),
                ("act", _ptr), ("final_norm", _ptr), ("final_out", _ptr), ("linear_seconds", _ptr)]


@cache
def _library() -> Any:
    """decode_stack.c's library, or None (one warning) where it cannot be built."""
    try:
        fn = build("decode_stack", SOURCE).decode_stack
    except (NativeBuildError, OSError) as exc:
        log.warning("decode steps run the decoder's loop: the native stack is not used (%s)", one_line(exc))
        return None
    fn.argtypes = [ctypes.POINTER(_Kernels), ctypes.POINTER(_Layer), _i64, ctypes.POINTER(_Step)]
    fn.restype = ctypes.c_int
    return fn


def _address(function: Any) -> int:
    """Where a loaded library's function (a kernel wrapper's ctypes function) starts."""
    address = ctypes.cast(function, _ptr).value
    assert address is not None
    return address


def _ptr_of(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class DecodeStack:
    """The layers of one DecoderLM as decode_stack.c's structs (module docstring: which)."""

    def __init__(self, model: Any, linears: list[list[PackedLinear]], fn: Any) -> None:
        cfg = model.cfg
        self._fn = fn
        self.dtype: torch.dtype = model.dtype
        f32 = self.dtype == torch.float32
        self._group_kernel = linears[0][0].kernel
        self._packed_roles = [linears[0][r].packed for r in range(len(ROLES))]
        self.layer_ids = list(model.layer_ids)
        self._rope_types = sorted({cfg.layer_types[i] for i in self.layer_ids})
        qk, norms, act = qk_norm_rope_kernel(), residual_norms_kernel(), act_mul_kernel()
        assert qk is not None and norms is not None and act is not None
        # attend: the step's backend's decode kernel (set by the first step that has one)
        residual, rms = norms.functions(self.dtype)
        act_fns = (None, _address(act._fn_f32)) if f32 else (_address(act._fn), None)  # computed or by table
        self._kernels = _Kernels(_address(self._group_kernel._fn), _address(qk.function(self.dtype)),
                                 _address(residual), _address(rms), None, *act_fns)
        self._attend: Any = None
        self._layers = (_Layer * len(linears))()
        self._held: list[torch.Tensor] = []  # what the structs point into
        for layer, w, i, lins in zip(self._layers, model.layers, self.layer_ids, linears):
            for r, lin in enumerate(lins):
                p = lin.packed
                layer.linears[r] = _Linear(p.values.data_ptr(), p.scale.data_ptr(), _ptr_of(p.offset),
                                           _ptr_of(lin.bias), p.shape[0], p.shape[1], p.group_size, int(p.narrow))
                self._held += [t for t in (p.values, p.scale, p.offset, lin.bias) if t is not None]
            for name in ("input_norm", "qk_norm", "post_attn_norm", "pre_ffn_norm", "post_ffn_norm"):
                setattr(layer, name, getattr(w, name).data_ptr())
                self._held.append(getattr(w, name))
            layer.rope = self._rope_types.index(cfg.layer_types[i])
            layer.group = -1  # set by the first step (the backend says which group a layer reads)
        self._groups_of_layers: tuple[int, ...] = ()
        self._paths: dict[int, tuple[int, ...] | None] = {}
        self._step = _Step(hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                           head_dim=cfg.head_dim, intermediate=cfg.intermediate_size, eps=float(model._eps),
                           f32=int(f32), activation=COMPUTED.get(cfg.activation, -1))
        self._qkv_width = self._layers[0].linears[0].n
        # A last stage's final norm is the stack's last call (rms_norms), where stage_output's
        # is the same kernel in bf16: __call__ then answers the final-normed hidden.
        self._final_norm: torch.Tensor | None = model.final_norm
        self.final_normed = self._final_norm is not None
        if self._final_norm is not None:
            self._step.final_norm = self._final_norm.data_ptr()
        self._caches_seen: tuple[list[weakref.ref[torch.Tensor]], tuple[Any, Any, int, torch.dtype]] | None = None
        # Benchmarks (step_share.py) set a c_double: every step adds its linears' wall time to it.
        self.linear_seconds: ctypes.c_double | None = None

    @classmethod
    def build(cls, model: Any) -> DecodeStack | None:
        """The stack of `model`'s layers (a DecoderLM: typed Any, as decoder.py imports this
        module), or None where one of them is not what the C loop walks (module docstring)
        or the library or a kernel is not built."""
        cfg, dtype = model.cfg, model.dtype
        if (dtype not in (torch.bfloat16, torch.float32) or model._eps.device.type != "cpu" or model.tp is not None
                or not cfg.sandwich_norm or model._projection_norm is not None or not model.layers
                or not model._linears or model.int8_layers):
            return None
        linears = [[getattr(lin, role) for role in ROLES] for lin in model._linears]
        if not all(isinstance(lin, PackedLinear) for lins in linears for lin in lins):
            return None
        # what the kernel's path depends on (GroupKernel.path), per role; group sizes may differ
        shapes = [tuple((lin.packed.shape, lin.packed.int8_inputs, lin.packed.whole_quads) for lin in lins)
                  for lins in linears]
        if any(s != shapes[0] for s in shapes):
            return None
        qk, norms, act = qk_norm_rope_kernel(), residual_norms_kernel(), act_mul_kernel()
        if qk is None or norms is None or act is None:
            return None
        heads, hd = cfg.num_heads + cfg.num_kv_heads, cfg.head_dim
        qk_rows = torch.zeros(1, heads, hd, dtype=dtype)
        cos = torch.zeros(1, 1, hd, dtype=dtype)
        h = torch.zeros(1, cfg.hidden_size, dtype=dtype)
        for w, i in zip(model.layers, model.layer_ids):
            if any(getattr(w, name) is None for name in ("input_norm", "qk_norm", "post_attn_norm", "pre_ffn_norm",
                                                           "post_ffn_norm")):
                return None
            if not qk.supports(qk_rows, w.qk_norm, cos if cfg.layer_types[i] in model._rope else None):
                return None
            if not (norms.supports(h, h, w.post_attn_norm, w.pre_ffn_norm)
                    and norms.supports(h, h, w.post_ffn_norm, w.input_norm)):
                return None
        if model.final_norm is not None and not norms.supports_norm(h, model.final_norm):
            return None
        gate_up = torch.zeros(1, 2 * cfg.intermediate_size, dtype=dtype)
        if not (act.supports(gate_up) if dtype == torch.bfloat16 else act.supports_computed(gate_up, cfg.activation)):
            return None
        if cfg.num_heads % cfg.num_kv_heads or linears[0][0].packed.shape[0] != (heads + cfg.num_kv_heads) * hd:
            return None
        fn = _library()
        return None if fn is None else cls(model, linears, fn)

    def _paths_for(self, rows: int) -> tuple[int, ...] | None:
        """group_linear's path code per role at `rows` rows; None where one is the expand path."""
        if rows not in self._paths:
            names = [self._group_kernel.path(rows, self.dtype, packed) for packed in self._packed_roles]
            self._paths[rows] = None if "expand" in names else tuple(self._group_kernel.path_code(n) for n in names)
        return self._paths[rows]

    def _caches_of(self, caches: list[torch.Tensor]) -> tuple[Any, Any, int, torch.dtype] | None:
        """(the caches' addresses and block strides as decode_stack.c reads them, block size,
        dtype), or None where the caches are not what the stack writes: in the model's dtype
        (or all in bf16 under a float32 model: write_kv rounds), contiguous, [blocks, block
        size, 2, ...]. The runner's cache views live as long as it does: checked once, then
        reused while each layer's view is the same tensor (held weakly, not kept alive)."""
        seen = self._caches_seen
        if seen is not None and len(seen[0]) == len(caches) and all(r() is c for r, c in zip(seen[0], caches)):
            return seen[1]
        block_size, cache_dtype = caches[0].shape[1], caches[0].dtype
        if cache_dtype != self.dtype and (self.dtype, cache_dtype) != (torch.float32, torch.bfloat16):
            return None
        if not all(c.dtype == cache_dtype and c.is_contiguous() and c.shape[1:3] == (block_size, 2) for c in caches):
            return None
        found = ((_ptr * len(caches))(*[c.data_ptr() for c in caches]),
                 (_i64 * len(caches))(*[c.stride(0) for c in caches]), block_size, cache_dtype)
        self._caches_seen = ([weakref.ref(c) for c in caches], found)
        return found

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, max_position: int, rope: dict[str, RopeTable],
                 backend: Any, act_table: torch.Tensor | None) -> torch.Tensor | None:
        """The final residual stream (final-normed where `final_normed`: a last stage, as
        stage_output's bf16 norm bit for bit) of the step whose input is h [rows, hidden] (the model's
        dtype) at `positions` ([rows] int64, at most max_position), or None where the step is
        not one the stack takes (module docstring). rope: the model's RoPE tables by layer
        type, whose rows of the step's positions the stack gathers itself (as their lookup
        does for the loop). act_table: act_mul's table of the model's activation (bf16;
        float32 computes it)."""
        rows, dtype = h.shape[0], self.dtype
        if act_table is None and dtype == torch.bfloat16:
            return None
        if positions.dtype != torch.int64 or positions.shape != (rows,) or not positions.is_contiguous():
            return None
        paths = self._paths_for(rows) if rows else None
        decode_plan, attend = getattr(backend, "decode_plan_addresses", None), getattr(backend, "decode_kernel", None)
        if paths is None or decode_plan is None or attend is None:
            return None
        entries = [backend.layers[i] for i in self.layer_ids]  # (group, cache) per layer
        groups = tuple(g for g, _ in entries)
        plans = {g: decode_plan(g) for g in set(groups)}
        if any(p is None for p in plans.values()):
            return None
        caches = self._caches_of([c for _, c in entries])
        if caches is None:
            return None
        cache_ptrs, strides, block_size, cache_dtype = caches
        tables = [rope.get(t) for t in self._rope_types]
        table_rows = max_position + 1
        for table in tables:
            if table is not None:
                table.ensure(max_position)
                cos, sin = table.cos, table.sin
                if not (cos.dtype == dtype and cos.shape[1] == self._step.head_dim and cos.is_contiguous()
                        and sin.is_contiguous()):
                    return None
                table_rows = min(table_rows, cos.shape[0], sin.shape[0])
        if attend is not self._attend:
            self._kernels.attend, self._attend = _address(attend._fn), attend
        order = sorted(plans)  # the group steps' order, which each layer's index points into
        if groups != self._groups_of_layers:
            for layer, g in zip(self._layers, groups):
                layer.group = order.index(g)
            self._groups_of_layers = groups
        group_steps = (_GroupStep * len(order))(*[_GroupStep(*plans[g]) for g in order])  # type: ignore[misc]
        rope_steps = (_RopeStep * len(tables))(*[_RopeStep(None, None) if t is None else
                                                 _RopeStep(t.cos.data_ptr(), t.sin.data_ptr()) for t in tables])
        s = self._step
        hidden = s.hidden
        h = h.contiguous()
        # Every buffer the C loop writes, in one allocation (each a torch call at a step's
        # cold start): the residual streams, x, sub, qkv, attn, gate_up, act, the RoPE rows
        # and the final-normed hidden, each from a 64-byte boundary.
        widths = (hidden, hidden, hidden, hidden, self._qkv_width, s.heads * s.head_dim, 2 * s.intermediate,
                  s.intermediate, len(tables) * 2 * s.head_dim, hidden if self.final_normed else 0)
        elem = 4 if s.f32 else 2
        starts, total = [], 0
        for width in widths:
            starts.append(total)
            total += -(-rows * width * elem // 64) * 64
        work = torch.empty(total // elem, dtype=dtype)
        base = work.data_ptr()
        out_at, x, sub, qkv, attn, gate_up, act, rope_rows, normed_at = (
            [base + starts[0], base + starts[1]], *(base + a for a in starts[2:]))
        s.rows, s.block_size, s.kv_bf16 = rows, block_size, int(cache_dtype == torch.bfloat16)
        s.scale, s.softcap = backend.scale, backend.softcap or 0.0
        s.paths[:] = paths
        s.threads = torch.get_num_threads()
        s.groups, s.ropes = ctypes.addressof(group_steps), ctypes.addressof(rope_steps)
        s.num_ropes, s.table_rows = len(tables), table_rows
        s.positions, s.rope_rows = positions.data_ptr(), rope_rows
        s.caches, s.block_strides = ctypes.addressof(cache_ptrs), ctypes.addressof(strides)
        s.act_table, s.h = _ptr_of(act_table), h.data_ptr()
        s.h_out[0], s.h_out[1] = out_at
        s.x, s.qkv, s.attn, s.sub, s.gate_up, s.act = x, qkv, attn, sub, gate_up, act
        s.final_out = normed_at if self.final_normed else None
        s.linear_seconds = None if self.linear_seconds is None else ctypes.addressof(self.linear_seconds)
        # what comes back: the final-normed hidden, else the final residual stream (a view
        # of the workspace, which it keeps alive); one call, not a slice and a view, made
        # before the layers where it is known then (a torch call after them costs several
        # times as much: they evict the caches)
        normed = work.as_strided((rows, hidden), (hidden, 1), starts[-1] // elem) if self.final_normed else None
        final = self._fn(ctypes.byref(self._kernels), self._layers, len(self._layers), ctypes.byref(s))
        if final == -2:
            raise IndexError(f"a position of the step is past the RoPE tables (max_position {max_position})")
        if final < 0:
            raise MemoryError(f"int8 groups: no memory for a {rows}-row input's float32 copy")
        return normed if normed is not None else work.as_strided((rows, hidden), (hidden, 1), starts[final] // elem)
