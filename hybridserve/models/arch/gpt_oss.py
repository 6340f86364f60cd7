"""gpt-oss (GptOssForCausalLM) on the shared decoder: attention sinks and a mixture of experts.

Per layer, as HF's modeling_gpt_oss computes it:

    x = rms_norm(h);  q, k, v = x W_qkv + b_qkv;  RoPE (YaRN) on q, k
    attention over the layer's keys (a 128-token window on even layers, all keys on odd
    ones), each head's softmax denominator enlarged by exp(sink_head)
    h = h + attn W_o + b_o
    x = rms_norm(h);  logits = x W_router + b_router;  top-k of them, softmaxed among themselves
    h = h + sum over the k experts e of  score_e * (swiglu_clamped(x W_e + b_e) D_e + d_e)

`layers[i]` (DecoderLayerWeights) holds the norms and the attention; it has no dense MLP
(intermediate size 0). `experts[str(i)]` holds the router and the experts, gate and up
de-interleaved at load (the checkpoint alternates their columns) so each rank's share
of both is one slice. Under tensor parallelism the experts are split along their
intermediate dimension like Llama 4's (the clamped SwiGLU is per column), the router is
replicated, and the down bias is added by rank 0 only (its score-weighted sum is one
more term of the all-reduced output).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.models.config import ModelConfig
from hybridserve.models.arch.decoder import AttentionBackend, DecoderLayerWeights, DecoderLM, rms_norm
from hybridserve.models.arch.gpt_oss_config import GptOssOptions
from hybridserve.models.parallel import PipelineStage, TPGroup
from hybridserve.models.layers.rope import apply_rope_


class GptOssExperts(nn.Module):
    """One layer's router (weight [E, H], bias [E]) and experts: x @ gate_up[e] -> [gate | up]
    ([E, H, 2I]) plus gate_up_bias[e]; then act @ down[e] ([E, I, H]) plus down_bias[e]
    (None on tensor-parallel ranks but the first)."""

    def __init__(self, cfg: ModelConfig, opts: GptOssOptions, dtype: torch.dtype, row_bias: bool) -> None:
        super().__init__()
        E, H, I = opts.num_experts, cfg.hidden_size, cfg.intermediate_size

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)

        self.router = p(E, H)
        self.router_bias = p(E)
        self.gate_up = p(E, H, 2 * I)
        self.gate_up_bias = p(E, 2 * I)
        self.down = p(E, I, H)
        self.down_bias = p(E, H) if row_bias else None


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gated activation: the gate clamped from above, up from both sides, and up
    offset by one (so a zero up passes the gate's value)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def mixture_of_experts(x: torch.Tensor, experts: GptOssExperts, opts: GptOssOptions) -> torch.Tensor:
    """x [T, H] -> the score-weighted sum of each token's top-k experts' outputs [T, H].

    Experts run one at a time on the tokens that chose them (one host sync reads which
    experts were chosen); contributions are added in expert order, as HF's loop does."""
    logits = F.linear(x, experts.router, experts.router_bias)
    top_logits, top_idx = torch.topk(logits, opts.num_experts_per_tok, dim=-1)
    scores = torch.softmax(top_logits, dim=1)
    out = torch.zeros_like(x)
    for e in torch.unique(top_idx).tolist():
        tok, slot = torch.where(top_idx == e)
        gate, up = torch.addmm(experts.gate_up_bias[e], x[tok], experts.gate_up[e]).chunk(2, dim=-1)
        y = clamped_swiglu(gate, up, opts.swiglu_alpha, opts.swiglu_limit) @ experts.down[e]
        if experts.down_bias is not None:
            y = y + experts.down_bias[e]
        out.index_add_(0, tok, y * scores[tok, slot, None])
    return out


class GptOssLM(DecoderLM):
    """gpt-oss on the shared decoder weights (see the module docstring); `sinks` [layers of
    this stage, local heads] in layer order."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, stage: PipelineStage | None = None,
                 tp: TPGroup | None = None) -> None:
        if cfg.gpt_oss is None:
            raise ValueError("GptOssLM needs a ModelConfig parsed from a gpt-oss config")
        super().__init__(cfg, dtype, stage, tp)
        self.experts = nn.ModuleDict({str(i): GptOssExperts(self.cfg, self.opts, dtype, self.row_bias)
                                      for i in self.layer_ids})
        self.sinks = nn.Parameter(torch.zeros(len(self.layer_ids), self.cfg.num_heads, dtype=dtype),
                                  requires_grad=False)

    @property
    def opts(self) -> GptOssOptions:
        assert self.cfg.gpt_oss is not None
        return self.cfg.gpt_oss

    def _layer_weights(self, layer_idx: int, dtype: torch.dtype) -> DecoderLayerWeights:
        # No dense MLP: the experts are the feed-forward (empty gate_up / down, never called).
        return DecoderLayerWeights(replace(self.cfg, intermediate_size=0, mlp_bias=False), dtype, self.row_bias)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, max_position: int,
                backend: AttentionBackend, hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        """As DecoderLM.forward; `backend.attention` takes the layer's sinks (keyword `sinks`)."""
        cfg, opts = self.cfg, self.opts
        nq, nkv, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self._eps
        inv_h = 1.0 / cfg.hidden_size
        T = positions.shape[0]
        if not self._linears:
            self.build_linears(release_weights=False)
        h = self.stage_input(input_ids, hidden_in)
        rope = {t: table.lookup(positions, max_position) for t, table in self._rope.items()}
        for k, (i, w, lin) in enumerate(zip(self.layer_ids, self.layers, self._linears)):
            x = rms_norm(h, w.input_norm, eps, inv_h)
            qkv = lin.qkv(x)
            qk = qkv[:, : (nq + nkv) * hd].view(T, nq + nkv, hd)
            cos, sin = rope[cfg.layer_types[i]]
            apply_rope_(qk, cos, sin)
            attn = backend.attention(i, qkv[:, : nq * hd].view(T, nq, hd), qkv[:, nq * hd :].view(T, 2, nkv, hd),
                                     sinks=self.sinks[k])  # type: ignore[call-arg]
            h = self.add_row_parallel(h, attn, lin.o, lin.o_residual)
            x = rms_norm(h, w.post_attn_norm, eps, inv_h)
            h = h + self.reduce(mixture_of_experts(x, self.experts[str(i)], opts))  # type: ignore[arg-type]
        return self.stage_output(h)
