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

from hybridserve.models.loaders.checkpoint import Weights, fill_ends, take_qkv, take_row_bias
from hybridserve.models.config import ModelConfig
from hybridserve.models.arch.decoder import AttentionBackend, DecoderLayerWeights, DecoderLM, rms_norm
from hybridserve.models.arch.gpt_oss_config import GptOssOptions
from hybridserve.models.loaders.mxfp4 import dequantize_mxfp4
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


def _expert_matrix(w: Weights, name: str, shape: tuple[int, int, int], dtype: torch.dtype) -> torch.Tensor:
    """Expert weights [E, in, out] as HF's experts read them: a plain tensor `name`, or its
    MXFP4 form (`name`_blocks [E, out, in / 32, 16], `name`_scales [E, out, in / 32]: rows
    are output features), dequantized one expert at a time to bound the load's peak."""
    if name in w.checkpoint.names():
        return w.take(name, shape)
    E, n_in, n_out = shape
    blocks = w.take(name + "_blocks", (E, n_out, n_in // 32, 16), dtype=torch.uint8)
    scales = w.take(name + "_scales", (E, n_out, n_in // 32), dtype=torch.uint8)
    out = torch.empty(shape, dtype=dtype)
    for e in range(E):
        out[e] = dequantize_mxfp4(blocks[e], scales[e], dtype).t()
    return out


def _split_gate_up(t: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """[..., 2I] with gate and up alternating (gate at even columns) -> this rank's
    [gate | up] columns."""
    gate, up = t[..., 0::2], t[..., 1::2]
    return torch.cat([tp.shard(gate, -1), tp.shard(up, -1)], dim=-1)


def fill_gpt_oss(model: GptOssLM, cfg: ModelConfig, w: Weights) -> None:
    """Copy HF GptOssForCausalLM tensors into `model` (its stage's layers, its rank's share;
    `cfg` the global config). Expert weights may be plain or MXFP4 (models/loaders/mxfp4.py)."""
    opts = cfg.gpt_oss
    assert opts is not None
    H, hd, I, E, nq = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, opts.num_experts, cfg.num_heads
    tp = model.tp or TPGroup()
    fill_ends(model, cfg, w, "model.embed_tokens.weight", "model.norm.weight")
    w.keep_layers("model.layers.", model.layer_ids)
    with torch.no_grad():
        for k, (i, layer) in enumerate(zip(model.layer_ids, model.layers)):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            layer.input_norm.copy_(w.take(p + "input_layernorm.weight", (H,)))
            layer.qkv.copy_(take_qkv(w, cfg, tp, a))
            if layer.qkv_bias is not None:
                layer.qkv_bias.copy_(take_qkv(w, cfg, tp, a, "bias"))
            layer.o.copy_(tp.shard(w.take(a + "o_proj.weight", (H, nq * hd)), 1))
            if cfg.o_bias:
                take_row_bias(w, layer.o_bias, a + "o_proj.bias", H)
            model.sinks[k].copy_(tp.shard(w.take(a + "sinks", (nq,))))
            layer.post_attn_norm.copy_(w.take(p + "post_attention_layernorm.weight", (H,)))
            m = p + "mlp."
            ex = model.experts[str(i)]
            assert isinstance(ex, GptOssExperts)
            ex.router.copy_(w.take(m + "router.weight", (E, H)))
            ex.router_bias.copy_(w.take(m + "router.bias", (E,)))
            ex.gate_up.copy_(_split_gate_up(_expert_matrix(w, m + "experts.gate_up_proj", (E, H, 2 * I), w.dtype), tp))
            ex.gate_up_bias.copy_(_split_gate_up(w.take(m + "experts.gate_up_proj_bias", (E, 2 * I)), tp))
            ex.down.copy_(tp.shard(_expert_matrix(w, m + "experts.down_proj", (E, I, H), w.dtype), 1))
            down_bias = w.take(m + "experts.down_proj_bias", (E, H))
            if ex.down_bias is not None:  # rank 0 adds it for all (see the module docstring)
                ex.down_bias.copy_(down_bias)
            w.release_taken()
