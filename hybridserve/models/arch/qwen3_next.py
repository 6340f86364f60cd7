"""Qwen3-Next over a flat batch, with the DecoderLM interface (as MambaLM: its head,
logits and state interface are MambaLM's; its layers are its own)::

    layer:  h += gated_deltanet(norm(h)) or gated_attention(norm(h));  h += moe(post_norm(h))
    gated attention:  q | gate = q_proj(x) per head;  q, k RMSNormed per head, then partial RoPE;
                      out = o_proj(attention(q, k, v) * sigmoid(gate))
    moe:  sum over the top-k of softmax(router(x)) of p_e expert_e(x)  (p renormalised when
          norm_topk_prob) + sigmoid(shared_gate(x)) shared_expert(x);  dense SwiGLU in mlp_only_layers

Every RMSNorm outside the mixer scales by (1 + w); the loader stores 1 + w. The backend
gives paged attention and, as `mamba`, each request's conv and recurrent state of each
Gated DeltaNet layer (MambaStateIO). Under tensor parallelism a rank holds its key heads
(with their value heads), its attention heads and its share of every expert's and the
shared expert's intermediate columns; the router and gates are replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.models.arch.decoder import StagedModel, rms_norm
from hybridserve.models.arch.gated_deltanet import GatedDeltaNetWeights, gated_deltanet_mixer
from hybridserve.models.arch.mamba_hybrid_config import HybridOptions
from hybridserve.models.arch.mamba_lm import HybridBackend, MambaLM
from hybridserve.models.arch.qwen3_next_config import LINEAR, GatedDeltaNetConfig, Qwen3NextMoE
from hybridserve.models.config import ModelConfig
from hybridserve.models.layers.rope import apply_rope_
from hybridserve.models.parallel import PipelineStage, TPGroup


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


class GatedAttentionWeights(nn.Module):
    """Fused q | k | v rows, the output gate's rows, the q and k norms stacked per head
    ([nq + nkv, head_dim]: q_norm on the query heads, k_norm on the KV heads) and o."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        nq, nkv, hd, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.qkv = _param((nq + 2 * nkv) * hd, H, dtype=dtype)
        self.gate = _param(nq * hd, H, dtype=dtype)
        self.qk_norm = _param(nq + nkv, hd, dtype=dtype)
        self.o = _param(H, nq * hd, dtype=dtype)


class MoEWeights(nn.Module):
    """Router [E, H]; experts gate | up [E, 2I, H] and down [E, H, I]; the shared expert's
    gate | up [2Is, H], down [H, Is] and its gate [1, H]."""

    def __init__(self, moe: Qwen3NextMoE, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        E, I, Is = moe.num_experts, moe.moe_intermediate_size, moe.shared_intermediate_size
        self.router = _param(E, hidden, dtype=dtype)
        self.gate_up = _param(E, 2 * I, hidden, dtype=dtype)
        self.down = _param(E, hidden, I, dtype=dtype)
        self.shared_gate_up = _param(2 * Is, hidden, dtype=dtype)
        self.shared_down = _param(hidden, Is, dtype=dtype)
        self.shared_gate = _param(1, hidden, dtype=dtype)


class Qwen3NextLayerWeights(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        assert cfg.gated_deltanet is not None and cfg.qwen3_next_moe is not None
        H = cfg.hidden_size
        linear = cfg.layer_types[layer_idx] == LINEAR
        self.norm = _param(H, dtype=dtype)
        self.mixer = GatedDeltaNetWeights(cfg.gated_deltanet, H, dtype) if linear else None
        self.attn = None if linear else GatedAttentionWeights(cfg, dtype)
        self.post_norm = _param(H, dtype=dtype)
        dense = layer_idx in cfg.qwen3_next_moe.dense_layers
        self.moe = None if dense else MoEWeights(cfg.qwen3_next_moe, H, dtype)
        self.gate_up = _param(2 * cfg.intermediate_size, H, dtype=dtype) if dense else None
        self.down = _param(H, cfg.intermediate_size, dtype=dtype) if dense else None


def _swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def mixture_of_experts(x: torch.Tensor, w: MoEWeights, moe: Qwen3NextMoE) -> torch.Tensor:
    """x [T, H] -> [T, H] (a partial sum under tensor parallelism). The T * top_k (token,
    expert) slots are sorted by expert (stable); one host sync reads the per-expert counts;
    each expert's weighted outputs go back to their slots, summed per token. (No index_add_:
    multi-threaded on CPU it costs milliseconds even for a few rows.)"""
    T, H = x.shape
    probs = torch.softmax(F.linear(x, w.router).float(), dim=-1)
    top_p, top_idx = torch.topk(probs, moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        top_p = top_p / top_p.sum(dim=-1, keepdim=True)
    flat = top_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=moe.num_experts).tolist()
    token_of = order // moe.top_k  # slot j of token t sits at t * top_k + j
    weight_of = top_p.to(x.dtype).reshape(-1)[order]
    sorted_out = x.new_empty(T * moe.top_k, H)
    first = 0
    for e, n in enumerate(counts):
        if n:
            rows = slice(first, first + n)
            sorted_out[rows] = _swiglu(x[token_of[rows]], w.gate_up[e], w.down[e]) * weight_of[rows, None]
            first += n
    slots = torch.empty_like(sorted_out)
    slots[order] = sorted_out
    shared = _swiglu(x, w.shared_gate_up, w.shared_down)
    return slots.view(T, moe.top_k, H).sum(dim=1) + torch.sigmoid(F.linear(x, w.shared_gate)) * shared


def _linear_attention(i: int, w: GatedDeltaNetWeights, cfg: GatedDeltaNetConfig, x: torch.Tensor,
                      backend: HybridBackend) -> torch.Tensor:
    """Layer i's Gated DeltaNet over the step, its states read from and written to the backend."""
    io = backend.mamba
    conv, state = io.read(i)
    out, token_states, boundary_states = gated_deltanet_mixer(w, cfg, x, conv, state, io.counts, io.verify,
                                                              io.checkpoints)
    io.write(i, conv, state, token_states, boundary_states)
    return out


class Qwen3NextLM(MambaLM):
    """forward(ids, positions, max_position, backend) -> final hidden; logits(h) -> vocab logits.
    Built from the global config; `cfg` is the rank's local view (see DecoderLM)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, stage: PipelineStage | None = None,
                 tp: TPGroup | None = None) -> None:
        StagedModel.__init__(self)  # MambaLM's own __init__ builds Mamba2 layers
        assert cfg.gated_deltanet is not None, "Qwen3NextLM needs a Qwen3-Next config"
        local = self.init_stage(cfg, dtype, stage, tp)
        self.layers = nn.ModuleList(Qwen3NextLayerWeights(local, i, dtype) for i in self.layer_ids)
        self._rope = None
        self._logits_buffer = None
        self.opts = HybridOptions()  # MambaLM's logits read it: no Granite / Falcon-H1 scales here

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, max_position: int,
                backend: HybridBackend, hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        """As DecoderLM.forward: [T] ids (first stage) or hidden_in (others) -> stage_output."""
        cfg = self.cfg
        mixer_cfg, moe = cfg.gated_deltanet, cfg.qwen3_next_moe
        assert mixer_cfg is not None and moe is not None
        h = self.stage_input(input_ids, hidden_in)
        eps, inv_h = self._eps, 1.0 / cfg.hidden_size
        rope = self._rope.lookup(positions, max_position) if self._rope is not None else None
        for i, w in zip(self.layer_ids, self.layers):
            x = rms_norm(h, w.norm, eps, inv_h)
            if w.attn is not None:
                assert rope is not None
                h = h + self.reduce(self._gated_attention(i, w.attn, x, rope, backend))
            else:
                assert w.mixer is not None
                h = h + self.reduce(_linear_attention(i, w.mixer, mixer_cfg, x, backend))
            x = rms_norm(h, w.post_norm, eps, inv_h)
            if w.moe is not None:
                h = h + self.reduce(mixture_of_experts(x, w.moe, moe))
            else:
                assert w.gate_up is not None and w.down is not None
                h = h + self.reduce(_swiglu(x, w.gate_up, w.down))
        return self.stage_output(h)

    def _gated_attention(self, i: int, w: GatedAttentionWeights, x: torch.Tensor,
                         rope: tuple[torch.Tensor, torch.Tensor], backend: HybridBackend) -> torch.Tensor:
        cfg = self.cfg
        nq, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        T = x.shape[0]
        qkv = F.linear(x, w.qkv)
        qk = rms_norm(qkv[:, : (nq + nkv) * hd].view(T, nq + nkv, hd), w.qk_norm, self._eps, 1.0 / hd)
        cos, sin = rope
        apply_rope_(qk[..., : cos.shape[-1]], cos, sin)  # partial RoPE: the first rotary_dim dims
        kv = torch.stack((qk[:, nq:], qkv[:, (nq + nkv) * hd :].view(T, nkv, hd)), dim=1)
        attn = backend.attention(i, qk[:, :nq], kv)
        return F.linear(attn * torch.sigmoid(F.linear(x, w.gate)), w.o)
