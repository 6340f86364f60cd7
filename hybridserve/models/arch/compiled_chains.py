"""The int8 chains compiled, for steps of many rows: the fast path beside Int8Chains.

At prefill sizes (hundreds to thousands of rows) each eager op of a chain is its own pass
over a [rows, 640..4096] float32 tensor, and those passes cost more than the int8 matmuls
they surround. torch.compile (inductor's C++ backend) makes each chain one or two loops
over the rows, each row read once while in cache. A compiled call costs a fixed ~20 us
before any work (benchmarks/results/step_share.md), several eager kernels at decode
sizes, so the compiled chains serve only steps of at least `min_rows` rows
(DEFAULT_MIN_ROWS, measured in benchmarks/results/prefill.md); smaller steps stay eager.

The compiled functions are out-of-place forms of Int8Chains' methods with the same
arithmetic in the same order; the row count is dynamic, so one graph per chain (and per
variant: bias or not, RoPE or not...) serves every large step. They are built on first
use (a first large step pays the compile: seconds, most of it skipped on later runs by
inductor's on-disk cache), and checked once against the eager chains on made-up inputs of
the model's sizes; no compiler, a failed build, any exception or any mismatch beyond float
rounding keeps the eager chains for the life of the model, with one logged line.

Why not bit for bit: inductor sums a row's squares in another order than ATen's
vector_norm (vectorised partial sums), so a norm may differ in its last bits, and a value
that lands within rounding of a half-level boundary may then quantize one level away
(tests/models/test_compiled_chains.py bounds it: at most one level apart).
"""

from __future__ import annotations

import logging
import time
import types
from typing import Any, Callable, Generic, TypeVar

import torch

from hybridserve.core.errors import one_line
from hybridserve.models.arch.int8_chains import Int8Chains, Int8Layer, Quantized
from hybridserve.models.layers.int8 import levels_for, quantize_rows_float
from hybridserve.models.layers.rms_norm import rms_norm
from hybridserve.models.layers.rope import apply_rope

log = logging.getLogger(__name__)

DEFAULT_MIN_ROWS = 128  # the fewest rows a step needs to take the compiled chains
C = TypeVar("C")  # a model's chains: eager and compiled have the same methods


def _quantized(path: str, x: torch.Tensor) -> Quantized:
    levels, scale = quantize_rows_float(x)
    return levels_for(path, levels), scale


def _residual(path: str, out: torch.Tensor | None, out_scale: torch.Tensor | None, bias: torch.Tensor | None,
              h: torch.Tensor, out_norm: torch.Tensor | None, next_norm: torch.Tensor | None, eps: torch.Tensor,
              inv_h: float) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    h = h.float()
    if out is not None:
        out = out * out_scale
        if bias is not None:
            out = out + bias
        h = h + (out if out_norm is None else rms_norm(out, out_norm, eps, inv_h))
    if next_norm is None:
        return h, None, None
    return (h, *_quantized(path, rms_norm(h, next_norm, eps, inv_h)))


def _qkv_out(qkv: torch.Tensor, qkv_scale: torch.Tensor, bias: torch.Tensor | None, qk_norm: torch.Tensor | None,
             cos: torch.Tensor | None, sin: torch.Tensor | None, eps: torch.Tensor, inv_hd: float, heads: int,
             head_dim: int, kv_dtype: torch.dtype) -> torch.Tensor:
    """The qkv rows [T, (H + 2 KVH) * D] times their scale in kv_dtype, q and k normed and
    rotated; `heads` = H + KVH."""
    qkv = qkv * qkv_scale
    if bias is not None:
        qkv = qkv + bias
    rows = qkv.shape[0]
    qk = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    if qk_norm is not None:
        qk = rms_norm(qk, None, eps, inv_hd) * qk_norm
    if cos is not None:
        qk = apply_rope(qk, cos, sin)
    return torch.cat((qk.reshape(rows, heads * head_dim), qkv[:, heads * head_dim :]), dim=1).to(kv_dtype)


def _act_mul(path: str, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, bias: torch.Tensor | None,
             act: Callable[[torch.Tensor], torch.Tensor]) -> Quantized:
    gate_up = gate_up * gate_up_scale
    if bias is not None:
        gate_up = gate_up + bias
    gate, up = gate_up.chunk(2, dim=-1)
    return _quantized(path, act(gate) * up)


class CompiledChains(Int8Chains):
    """Int8Chains whose four chains run compiled: what `for_rows` hands out for large steps."""

    def __init__(self, eager: Int8Chains) -> None:
        self.__dict__.update(eager.__dict__)
        self._residual = compile_chain(_residual)
        self._qkv_out = compile_chain(_qkv_out)
        self._quantize = compile_chain(_quantized)
        self._act_mul = compile_chain(_act_mul)

    def residual(self, path: str, out: torch.Tensor | None, out_scale: torch.Tensor | None,
                 bias: torch.Tensor | None, h: torch.Tensor, out_norm: torch.Tensor | None,
                 next_norm: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        return self._residual(path, dynamic_rows(out), dynamic_rows(out_scale), bias, dynamic_rows(h), out_norm,
                              next_norm, self.eps, self.inv_h)

    def qkv_out(self, qkv: torch.Tensor, qkv_scale: torch.Tensor, bias: torch.Tensor | None,
                qk_norm: torch.Tensor | None, cos: torch.Tensor | None, sin: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, nq, nkv, hd = qkv.shape[0], self.nq, self.nkv, self.hd
        out = self._qkv_out(dynamic_rows(qkv), dynamic_rows(qkv_scale), bias, qk_norm, dynamic_rows(cos),
                            dynamic_rows(sin), self.eps, self.inv_hd, nq + nkv, hd, self.kv_dtype)
        return out[:, : nq * hd].view(rows, nq, hd), out[:, nq * hd :].view(rows, 2, nkv, hd)

    def quant(self, path: str, x: torch.Tensor) -> Quantized:
        return self._quantize(path, dynamic_rows(x))

    def act_mul(self, path: str, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, bias: torch.Tensor | None
                ) -> Quantized:
        return self._act_mul(path, dynamic_rows(gate_up), dynamic_rows(gate_up_scale), bias, self.act)


def _match_aten_vector_width() -> None:
    """Inductor picks its vector width from the CPU, ATen from its capability, which
    ATEN_CPU_CAPABILITY may lower (as_avx2_env, to run as an AVX2 CPU). On an AVX-512 CPU
    limited so, inductor's default AVX-512 kernels computed garbage (NaNs, wrong levels)
    with torch 2.13; given ATen's 256-bit width they agree with eager."""
    import torch._inductor.config as inductor_config

    if inductor_config.cpp.simdlen is None and torch.backends.cpu.get_cpu_capability() == "AVX2":
        inductor_config.cpp.simdlen = 256


def compile_chain(fn: Callable[..., Any], options: dict[str, Any] | None = None) -> Callable[..., Any]:
    """fn compiled for dynamic_rows inputs (`options`: inductor's, as torch.compile takes them)."""
    _match_aten_vector_width()
    # Compiled from a copy of fn's code: dynamo keeps its graphs, and its limit of 8
    # variants, per code object, so each model's chains get their own (one code shared by
    # several models in a process, as in tests, would run out of variants and turn eager).
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return torch.compile(own, dynamic=False, fullgraph=True, options=options)


def dynamic_rows(x: torch.Tensor | None) -> torch.Tensor | None:
    """x with its row count marked dynamic: one graph serves every large step."""
    if x is not None:
        torch._dynamo.maybe_mark_dynamic(x, 0)
    return x


class ChainsByRows(Generic[C]):
    """The chains a step of `rows` rows runs: from `min_rows` rows on the compiled ones that
    `build` makes (called once, on first use: None where they cannot be built or disagree
    with the eager ones), else the eager ones. `what` names them in the log. `check`
    compares built chains with the eager ones again, running (so compiling) their graphs
    under the calling thread's count, and returns the chains to keep (None: none agrees)."""

    def __init__(self, eager: C, build: Callable[[], C | None] | None, what: str,
                 min_rows: int = DEFAULT_MIN_ROWS, check: Callable[[C], C | None] | None = None) -> None:
        """build None: never compiled (`--no-compile`)."""
        self.eager = eager
        self.min_rows = min_rows
        self.what = what
        self._build = build
        self._check = check
        self._compiled: C | None = None

    @property
    def compiles(self) -> bool:
        """Whether large steps take compiled chains, or will build them on first use."""
        return self._build is not None or self._compiled is not None

    def for_rows(self, rows: int) -> C:
        if rows < self.min_rows:
            return self.eager
        if self._build is not None:
            build, self._build = self._build, None
            self._compiled = build()
        return self._compiled if self._compiled is not None else self.eager

    def prepare(self) -> None:
        """Build the compiled chains now, or, once built, check them again. Inductor's loops
        are built for the calling thread's count (a graph guards on it), so a step under a
        count not yet seen compiles (seconds) before it runs: a server prepares each count
        its steps may run with before it serves any (TorchExecutor.prepare_large_steps)."""
        if self._build is not None:
            self.for_rows(self.min_rows)
        elif self._compiled is not None and self._check is not None:
            try:
                self._compiled = self._check(self._compiled)
            except Exception as exc:  # noqa: BLE001 - the eager chains serve instead
                self.drop_compiled(exc)

    def drop_compiled(self, exc: BaseException) -> None:
        """Turn eager for good after the compiled chains failed on a step."""
        log.warning("the %s turn eager: the compiled chains failed (%s)", self.what, one_line(exc))
        self._compiled = None


def int8_chains_by_rows(eager: Int8Chains, sample: Int8Layer, compile: bool) -> ChainsByRows[Int8Chains]:
    """The int8 chains by rows, compiled ones checked on first use with `sample`, a layer of
    the model (so that the check compiles the graphs the model runs)."""
    return ChainsByRows(eager, (lambda: _build(eager, sample, DEFAULT_MIN_ROWS)) if compile else None, "int8 chains",
                        check=lambda compiled: _agreeing(compiled, eager, sample, DEFAULT_MIN_ROWS))


def _build(eager: Int8Chains, sample: Int8Layer, rows: int) -> Int8Chains | None:
    start = time.perf_counter()
    try:
        compiled = _agreeing(CompiledChains(eager), eager, sample, rows)
    except Exception as exc:  # noqa: BLE001 - any failure keeps the general path
        log.warning("the int8 chains stay eager: the compiled chains failed to build (%s)", one_line(exc))
        return None
    if compiled is not None:
        log.info("int8 chains compiled and checked in %.1f s (steps of %d+ rows)", time.perf_counter() - start, rows)
    return compiled


def _agreeing(compiled: Int8Chains, eager: Int8Chains, sample: Int8Layer, rows: int) -> Int8Chains | None:
    """`compiled` if it agrees with `eager` on a made-up step (mismatch), else None (logged)."""
    reason = mismatch(compiled, eager, sample, rows)
    if reason:
        log.warning("the int8 chains stay eager: the compiled chains %s (%d threads)", reason, torch.get_num_threads())
        return None
    return compiled


def mismatch(compiled: Int8Chains, eager: Int8Chains, layer: Int8Layer, rows: int) -> str | None:
    """Why `compiled` differs from `eager` on one made-up layer step of `rows` rows through
    `layer`'s norms and biases (beyond float rounding: the module docstring), or None."""
    g = torch.Generator().manual_seed(rows)
    path = layer.qkv.path
    hidden, heads, hd = eager.hidden_size, eager.nq + eager.nkv, eager.hd
    width = (heads + eager.nkv) * hd
    angles = torch.rand(rows, 1, hd, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    h = torch.randn(rows, hidden, generator=g)
    out = torch.randn(rows, hidden, generator=g) * 3
    qkv = torch.randn(rows, width, generator=g) * 2
    attn = torch.randn(rows, eager.nq * hd, generator=g).to(eager.kv_dtype)
    gate_up = torch.randn(rows, 2 * eager.intermediate_size, generator=g) * 2
    row_scale = torch.rand(rows, 1, generator=g) + 0.5  # a product's activation scale per row
    # Products are cloned: the eager chains scale theirs in place.
    calls: list[tuple[str, Callable[[Int8Chains], Any]]] = [
        ("first norm", lambda c: c.residual(path, None, None, None, h, None, layer.input_norm)),
        ("residual", lambda c: c.residual(path, out.clone(), row_scale, layer.o_bias, h, layer.o_norm,
                                          layer.ffn_norm)),
        ("last residual", lambda c: c.residual(path, out.clone(), row_scale, layer.down_bias, h, layer.down_norm,
                                               None)),
        ("qkv_out", lambda c: c.qkv_out(qkv.clone(), row_scale, layer.qkv_bias, layer.qk_norm, cos, sin)),
        ("quant", lambda c: c.quant(path, attn)),
        ("act_mul", lambda c: c.act_mul(path, gate_up.clone(), row_scale, layer.gate_up_bias)),
    ]
    for name, call in calls:
        got, want = call(compiled), call(eager)
        for a, b in zip(got, want):
            if a is None and b is None:
                continue
            if not _close(a, b):
                return f"differ from the eager chains in {name}"
    return None


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to float rounding: levels (integers) at most one apart, floats within a few
    of their dtype's units in the last place of themselves or of the tensor's largest value
    (a residual add that cancels keeps the absolute rounding of its terms)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point() or (a.dtype == torch.float32 and bool((a == a.round()).all())
                                     and bool((b == b.round()).all())):
        return bool(((a.float() - b.float()).abs() <= 1).all())
    ulp = 8 * torch.finfo(a.dtype).eps
    return torch.allclose(a.float(), b.float(), rtol=ulp, atol=ulp * float(b.float().abs().max()))
