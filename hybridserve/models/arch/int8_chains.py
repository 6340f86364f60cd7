"""The element-wise work between an int8 decoder layer's matmuls, as four chains.

With int8 x int8 layers (models/layers/int8.py) every matmul's input is quantized per row
from float32, and what lies between two matmuls is element-wise or a row reduction:

    residual  h + out (or + norm(out)), norm, quantize   (after o and down; the first
                                                          layer's input norm)
    qkv_out   bias, q/k norm, RoPE, rounding to the KV cache's dtype
    quant     quantize (attention's output)
    act_mul   bias, act(gate) * up, quantize

A chain after a matmul takes the matmul's product without its input's per-row scale
(W8A8Linear.product) and the scale, and multiplies it in first: one pass over the product
fewer where the chain is fused (compiled_chains.py); eager, the same multiply as the matmul's.

Each chain is one function of whole tensors: the unit a fused kernel replaces. Here they
run eager, the general path: torch.compile of each chain alone lost at 1 and 16 rows, a
compiled call's fixed cost being several eager kernels' at decode sizes
(benchmarks/results/step_share.md), and won from about 128 rows (prefill), where
compiled_chains.py serves instead (benchmarks/results/prefill.md).

Quantized inputs come out as the matmul's `path` takes them (models/layers/int8.levels_for).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from hybridserve.models.config import ModelConfig
from hybridserve.models.layers.int8 import QUANTIZERS, W8A8Linear
from hybridserve.models.layers.rms_norm import rms_norm
from hybridserve.models.layers.rope import apply_rope_

Quantized = tuple[torch.Tensor, torch.Tensor]  # (levels as the path takes them, float32 row scale [S, 1])


class Int8Layer(NamedTuple):
    """One layer with int8 x int8 matmuls (models/layers/int8.py) on its smoothed weights:
    the matmuls, their biases in float32 (the chains of int8_chains.py add them) and the
    norms each chain applies, looked up once (a module attribute costs a Python call)."""

    qkv: W8A8Linear
    o: W8A8Linear
    gate_up: W8A8Linear
    down: W8A8Linear
    qkv_bias: torch.Tensor | None
    o_bias: torch.Tensor | None
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    input_norm: torch.Tensor
    qk_norm: torch.Tensor | None
    o_norm: torch.Tensor | None  # applied to o's output before the residual add (sandwich norms)
    ffn_norm: torch.Tensor  # gate_up's input norm
    down_norm: torch.Tensor | None  # applied to down's output before the residual add


def quantized(path: str, x: torch.Tensor) -> Quantized:
    """x quantized per row (quantize_rows_float's levels) in `path`'s storage: the eager
    quantizer of that path, which shifts its fresh levels in place (levels_for's values
    without its out-of-place copy, on every matmul input of every step)."""
    return QUANTIZERS[path](x)


class Int8Chains:
    """The chains of one model (its sizes, norm placement, activation, KV dtype), eager;
    hidden_size and intermediate_size are kept for compiled_chains' check, which makes up
    inputs of the layer's sizes."""

    def __init__(self, cfg: ModelConfig, eps: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor],
                 kv_dtype: torch.dtype) -> None:
        self.nq, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.inv_h, self.inv_hd = 1.0 / cfg.hidden_size, 1.0 / cfg.head_dim
        self.hidden_size, self.intermediate_size = cfg.hidden_size, cfg.intermediate_size
        self.eps = eps
        self.act = act
        self.kv_dtype = kv_dtype

    def residual(self, path: str, out: torch.Tensor | None, out_scale: torch.Tensor | None,
                 bias: torch.Tensor | None, h: torch.Tensor, out_norm: torch.Tensor | None,
                 next_norm: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(h + out * out_scale (+ bias; normed by out_norm where given) in float32, the next
        matmul's input: norm(h, next_norm) quantized, or None, None without next_norm). out
        (this chain's own: changed in place) None: h alone (a stage's first norm)."""
        h = h if h.dtype == torch.float32 else h.float()  # a no-op .float() still costs a dispatch
        if out is not None:
            out = out.mul_(out_scale)
            if bias is not None:
                out = out + bias
            h = h + (out if out_norm is None else rms_norm(out, out_norm, self.eps, self.inv_h))
        if next_norm is None:
            return h, None, None
        return (h, *quantized(path, rms_norm(h, next_norm, self.eps, self.inv_h)))

    def qkv_out(self, qkv: torch.Tensor, qkv_scale: torch.Tensor, bias: torch.Tensor | None,
                qk_norm: torch.Tensor | None, cos: torch.Tensor | None, sin: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """qkv's product [T, (H + 2 KVH) * D] (float32, this chain's own: changed in place) times
        its row scale -> (q [T, H, D], kv [T, 2, KVH, D]) in the KV cache's dtype: bias, q/k
        norm (qk_norm [H + KVH, D]) and RoPE (cos, sin from RopeTable.lookup; None: no RoPE) applied."""
        qkv.mul_(qkv_scale)
        if bias is not None:
            qkv.add_(bias)
        T, nq, nkv, hd = qkv.shape[0], self.nq, self.nkv, self.hd
        # q | k | v per token: after RoPE in place, k and v are adjacent, which is exactly
        # one KV cache slot ([2, KVH, D]).
        qk = qkv[:, : (nq + nkv) * hd].view(T, nq + nkv, hd)
        if qk_norm is not None:
            torch.mul(rms_norm(qk, None, self.eps, self.inv_hd), qk_norm, out=qk)
        if cos is not None:
            apply_rope_(qk, cos, sin)  # q and k share positions: one rotation covers both
        out = qkv.to(self.kv_dtype)
        return out[:, : nq * hd].view(T, nq, hd), out[:, nq * hd :].view(T, 2, nkv, hd)

    def quant(self, path: str, x: torch.Tensor) -> Quantized:
        """x (attention's output, any float dtype) quantized for `path`."""
        return quantized(path, x)

    def act_mul(self, path: str, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, bias: torch.Tensor | None
                ) -> Quantized:
        """act(gate) * up of gate|up's product (this chain's own: changed in place) times its
        row scale (+ bias), quantized for `path`."""
        gate_up = gate_up.mul_(gate_up_scale)
        if bias is not None:
            gate_up = gate_up + bias
        gate, up = gate_up.chunk(2, dim=-1)
        return quantized(path, self.act(gate) * up)
