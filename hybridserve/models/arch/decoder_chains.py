"""The model-dtype decoder's element-wise work compiled, for steps of many rows (prefill).

DecoderLM.forward, the general path, runs each element-wise op eagerly: at prefill sizes
(thousands of rows) every op is its own pass over a [rows, 640..4096] tensor, with a
bf16 -> float32 -> bf16 round trip around each norm, and those passes cost about as much
as the matmuls between them (benchmarks/results/prefill.md). Here the work between two
matmuls is one function, compiled by torch.compile (inductor's C++ backend) into one or
two loops over the rows:

    residual   h + norm(out) (sandwich norms; pre-norm layers add in the matmul), then
               the next matmul's input norm
    qk_out     q/k norm and RoPE on the qkv product
    act_mul    act(gate) * up (the tanh GELU as x * sigmoid(2y): gelu_tanh_by_sigmoid)

The arithmetic is forward's, with each intermediate rounded to the model dtype where the
eager op would round it (inductor's emulate_precision_casts), and norms whose sums of
squares round alike in any order (rms_norm's exact_sums, which the eager loop takes for
steps of this size too): the chains give forward's
values bit for bit, so the greedy tokens do not depend on which path a step takes
(tests/models/test_decoder_chains.py).

Served by DecoderLM for steps of at least compiled_chains.DEFAULT_MIN_ROWS rows on models
whose layers it covers (one rank; pre-norm or sandwich norms; no projection norms): built
on first use and checked once against the eager functions on made-up inputs of the
model's sizes: a chain that differs in any bit runs eager (as inductor's GELU does on AVX2
CPUs); no compiler or a failed build keeps the eager path for the life of the model, with
one logged line. `--no-compile` never builds them. A chain whose work native kernels take
on every layer (decoder.py's _native_chains: bf16 on the CPU, and float32 on the CPU where the
decode stack serves the model's decode steps) is not compiled at all; where that is all
three (Gemma 3; pre-norm decoders such as Llama, Qwen, Mistral), nothing is, and the
compiler is never imported. The float32 kernels equal these chains to a float32 rounding,
not bit for bit: such a model's large steps then compute as its decode steps do.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Iterable, NamedTuple

import torch

from hybridserve.core.errors import one_line
from hybridserve.models.arch.compiled_chains import DEFAULT_MIN_ROWS, compile_chain, dynamic_rows
from hybridserve.models.config import ModelConfig
from hybridserve.models.layers.rms_norm import rms_norm
from hybridserve.models.layers.rope import apply_rope_rounded

log = logging.getLogger(__name__)

# Inductor options of these chains: round intermediates to the model dtype as eager does.
_OPTIONS = {"emulate_precision_casts": True}


def residual(h: torch.Tensor, out: torch.Tensor | None, out_norm: torch.Tensor | None,
             next_norm: torch.Tensor | None, eps: torch.Tensor, inv_h: float
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(h + norm(out, out_norm) (sandwich norms; out None: h, which the matmul's fused
    residual add has made), its norm by next_norm (None without one))."""
    if out is not None:
        h = h + rms_norm(out, out_norm, eps, inv_h, exact_sums=True)
    return h, None if next_norm is None else rms_norm(h, next_norm, eps, inv_h, exact_sums=True)


def qk_out(qkv: torch.Tensor, qk_norm: torch.Tensor | None, cos: torch.Tensor | None, sin: torch.Tensor | None,
           eps: torch.Tensor, inv_hd: float, heads: int, head_dim: int) -> torch.Tensor:
    """A new qkv product [T, (H + 2 KVH) * D] with q and k (the first `heads` = H + KVH
    heads) normed by qk_norm [H + KVH, D] and rotated (cos, sin: RopeTable.lookup's; None:
    no RoPE); v as it was."""
    rows, width = qkv.shape[0], heads * head_dim
    qk = qkv[:, :width].view(rows, heads, head_dim)
    if qk_norm is not None:
        qk = rms_norm(qk, None, eps, inv_hd, exact_sums=True) * qk_norm
    if cos is not None:
        qk = apply_rope_rounded(qk, cos, sin)
    return torch.cat((qk.reshape(rows, width), qkv[:, width:]), dim=1)


# 2 * sqrt(2 / pi): the tanh-approximate GELU's argument doubled.
_GELU_TANH_SCALE = 2.0 * math.sqrt(2.0 / math.pi)
_GELU_TANH_CUBIC = 0.044715


def gelu_tanh_by_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """The tanh-approximate GELU, 0.5 x (1 + tanh(y)) with y = sqrt(2/pi) (x + 0.044715 x^3),
    taken as x * sigmoid(2y), the same function (1 + tanh(y) = 2 sigmoid(2y)): one exp per
    value where ATen's and inductor's tanh cost several times more (the tanh dominated a
    prefill's element-wise work: benchmarks/results/prefill.md). In float32, rounded once
    to x's dtype; it differs from F.gelu's rounding in the last bit of ~1.5% of bf16
    values. Written in place on one float32 copy, so that eager costs about what F.gelu
    does; the compiled chain computes the same operations in the same order, bit for bit."""
    xf = x.float() if x.dtype != torch.float32 else x.clone()
    y = xf * xf
    y.mul_(_GELU_TANH_SCALE * _GELU_TANH_CUBIC).add_(_GELU_TANH_SCALE).mul_(xf).sigmoid_()
    return y.mul_(xf).to(x.dtype)


def large_step_act(activation: str, act: Callable[[torch.Tensor], torch.Tensor]
                   ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation of steps of at least the chains' min_rows rows (compiled or eager,
    as exact_sums): gelu_tanh_by_sigmoid for the tanh GELU, else `act` itself."""
    return gelu_tanh_by_sigmoid if activation == "gelu_tanh" else act


def act_mul(gate_up: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


class DecoderChains:
    """The three chains of one model compiled (one graph per chain and variant; the row
    count is dynamic, so one serves every large step). The sizes are kept for the check,
    which makes up inputs of the model's sizes."""

    def __init__(self, cfg: ModelConfig, eps: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor],
                 dtype: torch.dtype, compiled: Iterable[str] | None = None) -> None:
        """`compiled`: the chains to compile (by EAGER's names; None: all); the others stay
        eager, for a model whose native kernels take those chains' work (decoder.py)."""
        self.eps, self.act, self.dtype = eps, act, dtype
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads + cfg.num_kv_heads, cfg.num_kv_heads, cfg.head_dim
        self.hidden_size, self.intermediate_size = cfg.hidden_size, cfg.intermediate_size
        self.inv_h, self.inv_hd = 1.0 / cfg.hidden_size, 1.0 / cfg.head_dim
        names = set(EAGER if compiled is None else compiled)
        for name, fn in EAGER.items():
            setattr(self, f"_{name}", compile_chain(fn, _OPTIONS) if name in names else fn)

    def residual(self, h: torch.Tensor, out: torch.Tensor | None, out_norm: torch.Tensor | None,
                 next_norm: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._residual(dynamic_rows(h), dynamic_rows(out), out_norm, next_norm, self.eps, self.inv_h)

    def qk_out(self, qkv: torch.Tensor, qk_norm: torch.Tensor | None, cos: torch.Tensor | None,
               sin: torch.Tensor | None) -> torch.Tensor:
        return self._qk_out(dynamic_rows(qkv), qk_norm, dynamic_rows(cos), dynamic_rows(sin), self.eps, self.inv_hd,
                            self.heads, self.head_dim)

    def act_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._act_mul(dynamic_rows(gate_up), self.act)


class LayerNorms(NamedTuple):
    """One layer's norm weights as the chains take them (None: that norm is absent)."""

    qk: torch.Tensor | None
    out: torch.Tensor | None  # o's output, before the residual add (sandwich norms)
    ffn: torch.Tensor  # gate|up's input
    down: torch.Tensor | None  # down's output, before the residual add (sandwich norms)


def build(cfg: ModelConfig, eps: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype,
          sample: LayerNorms, rows: int = DEFAULT_MIN_ROWS, native: frozenset[str] = frozenset()
          ) -> DecoderChains | None:
    """The compiled chains, each checked against its eager function on made-up inputs of
    `rows` rows through `sample`'s norms (a layer of the model, so that the check compiles
    the graphs the model runs): a chain that differs in any bit runs its eager function
    instead (as inductor's GELU does on AVX2 CPUs); None (logged) where they cannot be
    built or none agrees. The chains named in `native` stay eager and are never compiled:
    the caller gives their work to native kernels; where that is all three, nothing is
    compiled and the compiler is never imported."""
    start = time.perf_counter()
    compiled = [name for name in EAGER if name not in native]
    if not compiled:
        log.info("the decoder's large steps take the native kernels (nothing compiled)")
        return DecoderChains(cfg, eps, act, dtype, compiled=())
    try:
        kept = agreeing(DecoderChains(cfg, eps, act, dtype, compiled=compiled), sample, rows)
    except Exception as exc:  # noqa: BLE001 - any failure keeps the general path
        log.warning("the decoder's element-wise work stays eager: the compiled chains failed to build (%s)",
                    one_line(exc))
        return None
    if kept is not None:
        log.info("decoder chains compiled and checked in %.1f s (steps of %d+ rows)", time.perf_counter() - start,
                 rows)
    return kept


def agreeing(chains: DecoderChains, sample: LayerNorms, rows: int = DEFAULT_MIN_ROWS) -> DecoderChains | None:
    """`chains` with each compiled chain that differs in any bit from its eager function on
    made-up inputs of `rows` rows (run, so compiled, under the calling thread's count)
    replaced by the eager one; None (logged) where none agrees."""
    compiled = [name for name in EAGER if getattr(chains, f"_{name}") is not EAGER[name]]
    if not compiled:
        return chains
    differ = mismatches(chains, sample, rows)
    if set(compiled) <= set(differ):
        log.warning("the decoder's element-wise work stays eager: every compiled chain differs from its eager function")
        return None
    for name in differ:
        log.warning("the decoder chain %s stays eager: compiled, it differs from the eager function (%d threads)",
                    name, torch.get_num_threads())
        setattr(chains, f"_{name}", EAGER[name])
    return chains


# Each chain's eager function, by name (DecoderChains holds it compiled as _<name>).
EAGER: dict[str, Callable[..., Any]] = {"residual": residual, "qk_out": qk_out, "act_mul": act_mul}


def mismatches(chains: DecoderChains, norms: LayerNorms, rows: int) -> list[str]:
    """The chains whose compiled functions differ from their eager ones in any bit on one
    made-up step of `rows` rows through `norms`."""
    g = torch.Generator().manual_seed(rows)
    dt, hd, heads, eps, inv_h = chains.dtype, chains.head_dim, chains.heads, chains.eps, chains.inv_h
    h = torch.randn(rows, chains.hidden_size, generator=g).to(dt)
    out = (torch.randn(rows, chains.hidden_size, generator=g) * 3).to(dt)
    qkv = torch.randn(rows, (heads + chains.kv_heads) * hd, generator=g).to(dt)
    angles = torch.rand(rows, 1, hd, generator=g) * 6
    cos, sin = angles.cos().to(dt), angles.sin().to(dt)
    gate_up = (torch.randn(rows, 2 * chains.intermediate_size, generator=g) * 2).to(dt)
    # Pre-norm layers add o's and down's outputs in the matmuls: no out to norm.
    o, down = (None if norm is None else out for norm in (norms.out, norms.down))
    calls: list[tuple[str, tuple[Any, ...], tuple[Any, ...]]] = [
        ("residual", chains.residual(h, o, norms.out, norms.ffn), residual(h, o, norms.out, norms.ffn, eps, inv_h)),
        ("residual", chains.residual(h, down, norms.down, None), residual(h, down, norms.down, None, eps, inv_h)),
        ("qk_out", (chains.qk_out(qkv, norms.qk, cos, sin),),
         (qk_out(qkv, norms.qk, cos, sin, eps, 1.0 / hd, heads, hd),)),
        ("act_mul", (chains.act_mul(gate_up),), (act_mul(gate_up, chains.act),)),
    ]
    differ: list[str] = []
    for name, got, want in calls:
        for a, b in zip(got, want):
            if name not in differ and ((a is None) != (b is None) or (a is not None and not torch.equal(a, b))):
                differ.append(name)
    return differ
