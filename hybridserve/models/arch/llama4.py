"""Llama 4 text (`Llama4ForCausalLM`): chunked local attention, NoPE layers, mixture of experts.

A `DecoderLM` whose layers differ in three ways (which layers do what: llama4_config.py):

- RoPE layers rotate q/k, then (use_qk_norm) L2-normalise them: a weightless RMSNorm
  over head_dim with eps = rms_norm_eps. NoPE layers skip both and, with temperature
  tuning, scale q at position p by 1 + attn_scale * log1p(floor((p + 1) / floor_scale)).
  The attention type (chunked or full) is the KV group's business, not the model's.
- Llama 4's RoPE rotates interleaved pairs (x[2i], x[2i+1]) as complex numbers. The
  loader permutes the rows of each q/k head to [even dims, odd dims], which turns that
  into the NeoX half-split rotation `rope.apply_rope_` already does; q.k is invariant
  under one permutation of head_dim applied to both, so attention is unchanged (V and
  the cache layout are untouched; the cache simply holds permuted keys).
- MoE layers: the router picks the top-k experts per token; the sigmoid of each picked
  logit scales the expert's *input*, and a shared expert (a plain MLP) runs on every
  token:  out = shared(x) + sum_{e in topk(x)} expert_e(sigmoid(logit_e) * x).
  Only experts that received tokens are computed (tokens sorted by expert, one
  index_select / index_add_ per expert). Dense layers use intermediate_size_mlp.
  Under tensor parallelism every expert and the shared expert are cut along their
  intermediate dimension (the router is replicated, so every rank routes alike): a
  rank's shared + routed output is a partial sum, completed by one all-reduce per layer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.models.config import FULL, ModelConfig
from hybridserve.models.arch.decoder import AttentionBackend, DecoderLayerWeights, DecoderLM, rms_norm
from hybridserve.models.arch.llama4_config import Llama4Options
from hybridserve.models.parallel import PipelineStage, TPGroup
from hybridserve.models.layers.rope import RopeTable, apply_rope_


class Llama4Experts(nn.Module):
    """One MoE layer's router [E, H] and experts in HF's layout: x @ gate_up[e] -> [gate | up]
    ([E, H, 2I]), then (up * act(gate)) @ down[e] ([E, I, H])."""

    def __init__(self, cfg: ModelConfig, num_experts: int, dtype: torch.dtype) -> None:
        super().__init__()
        H, I = cfg.hidden_size, cfg.intermediate_size

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)

        self.router = p(num_experts, H)
        self.gate_up = p(num_experts, H, 2 * I)
        self.down = p(num_experts, I, H)


def routed_experts(x: torch.Tensor, experts: Llama4Experts, top_k: int,
                   act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """sum over each token's top-k experts of expert_e(sigmoid(logit_e) * x), x [T, H] -> [T, H].

    Tokens are sorted by expert (stable, so each expert sees its tokens in order); one
    host sync reads the per-expert counts. A token's contributions are added in expert
    order, as HF's sum over the expert axis does.
    """
    logits = F.linear(x, experts.router)  # [T, E]
    top_logits, top_idx = torch.topk(logits, top_k, dim=1)
    # HF takes the sigmoid in float32 (it scatters the picked logits into -inf, sigmoid 0).
    scores = torch.sigmoid(top_logits.float()).to(x.dtype).reshape(-1)
    flat = top_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts.router.shape[0]).tolist()
    token_of = order // top_k  # slot j of token t sits at t * top_k + j
    score_of = scores[order]
    out = torch.zeros_like(x)
    a = 0
    for e, n in enumerate(counts):
        if not n:
            continue
        tok = token_of[a : a + n]
        xe = x.index_select(0, tok) * score_of[a : a + n, None]
        gate, up = torch.mm(xe, experts.gate_up[e]).chunk(2, dim=-1)
        out.index_add_(0, tok, torch.mm(up * act(gate), experts.down[e]))
        a += n
    return out


class Llama4LM(DecoderLM):
    """Llama 4 text on the shared decoder weights. `layers[i]` holds attention, norms and
    the dense MLP, or on MoE layers the shared expert; `experts[str(i)]` the routed part."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, stage: PipelineStage | None = None,
                 tp: TPGroup | None = None) -> None:
        if cfg.llama4 is None:
            raise ValueError("Llama4LM needs a ModelConfig parsed from a Llama 4 config")
        super().__init__(cfg, dtype, stage, tp)  # _layer_weights below reads self.opts
        self.experts = nn.ModuleDict({
            str(i): Llama4Experts(self.cfg, self.opts.num_experts, dtype)
            for i in self.layer_ids if self.opts.moe_layers[i]
        })

    @property
    def opts(self) -> Llama4Options:
        """The Llama 4 options of this rank (its dense MLP size local under tensor parallelism)."""
        assert self.cfg.llama4 is not None
        return self.cfg.llama4

    def _layer_weights(self, layer_idx: int, dtype: torch.dtype) -> DecoderLayerWeights:
        if self.opts.moe_layers[layer_idx]:
            return DecoderLayerWeights(self.cfg, dtype, self.row_bias)  # gate_up/down: the shared expert
        return DecoderLayerWeights(replace(self.cfg, intermediate_size=self.opts.intermediate_size_mlp), dtype,
                                   self.row_bias)

    def setup_rope(self, device: torch.device, max_positions: int) -> None:
        super().setup_rope(device, max_positions)
        # One rotary table for every RoPE layer, chunked or full (no per-type frequencies).
        self._rope = {FULL: RopeTable(self.cfg.rope[FULL], self.cfg.head_dim, min(max_positions, 4096), device,
                                      self.dtype)}

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, max_position: int,
                backend: AttentionBackend, hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        """As DecoderLM.forward: [T] ids (first stage) or hidden_in (others) -> stage_output."""
        cfg, opts = self.cfg, self.opts
        nq, nkv, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self._eps
        inv_h, inv_hd = 1.0 / cfg.hidden_size, 1.0 / hd
        T = positions.shape[0]
        if not self._linears:
            self.build_linears(release_weights=False)
        h = self.stage_input(input_ids, hidden_in)
        cos, sin = self._rope[FULL].lookup(positions, max_position)
        temperature = None
        if opts.attn_temperature_tuning and not all(opts.rope_layers):
            # float32 as HF computes it; q * temperature promotes, copy_ casts back.
            steps = torch.floor((positions.float() + 1.0) / opts.floor_scale)
            temperature = (torch.log1p(steps) * opts.temperature_scale + 1.0)[:, None, None]
        for i, w, lin in zip(self.layer_ids, self.layers, self._linears):
            x = rms_norm(h, w.input_norm, eps, inv_h)
            qkv = lin.qkv(x)
            qk = qkv[:, : (nq + nkv) * hd].view(T, nq + nkv, hd)
            if opts.rope_layers[i]:
                apply_rope_(qk, cos, sin)
                if opts.use_qk_norm:  # after RoPE, as HF (a rotation keeps the norm anyway)
                    qk.copy_(rms_norm(qk, None, eps, inv_hd))
            elif temperature is not None:
                q = qk[:, :nq]
                q.copy_(q * temperature)
            attn = backend.attention(i, qk[:, :nq], qkv[:, nq * hd :].view(T, 2, nkv, hd))
            h = self.add_row_parallel(h, attn, lin.o, lin.o_residual)
            x = rms_norm(h, w.post_attn_norm, eps, inv_h)
            gate, up = lin.gate_up(x).chunk(2, dim=-1)
            y = self._act(gate) * up
            experts = self.experts[str(i)] if opts.moe_layers[i] else None
            if experts is None:
                h = self.add_row_parallel(h, y, lin.down, lin.down_residual)
            else:  # HF: out = shared(x); out += routed; h = h + out
                h = h + self.reduce(lin.down(y) + routed_experts(x, experts, opts.num_experts_per_tok, self._act))
        return self.stage_output(h)
