"""Mamba2, Bamba and Granite 4.0-H language models over a flat batch, with the DecoderLM interface.

Mamba2 layer:  h += mixer(norm(h))
Bamba layer:   h += mixer(norm(h)) or attention(norm(h));  h += mlp(pre_ff_norm(h))
Granite 4.0-H: Bamba's, each add scaled by the residual multiplier, the routed experts'
               sum beside the MLP, the embedding scaled and the logits divided
               (models/arch/mamba_hybrid_config.py)
Nemotron-H:    h += mixer(norm(h)) or attention(norm(h)) or relu2_mlp(norm(h)), one per layer
Falcon-H1:     mixer and attention side by side (models/arch/falcon_h1.py)

The step backend gives attention (the runner's paged attention, for Bamba's attention
layers) and `mamba` (a MambaStateIO: each request's state parts, conv and SSM, of each
Mamba layer). The model knows nothing about blocks or requests beyond the chunk lengths.
As DecoderLM, a model may be one pipeline stage and one tensor-parallel rank
(models/parallel.py: mixers are cut by heads).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.models.config import FULL, ModelConfig
from hybridserve.models.arch.decoder import StagedModel, rms_norm
from hybridserve.models.arch.mamba2 import Mamba2MixerWeights, MambaStateIO, mamba2_mixer
from hybridserve.models.arch.mamba_config import MAMBA
from hybridserve.models.arch.mamba_hybrid_config import MLP_ONLY, HybridOptions
from hybridserve.models.arch.routed_experts import RoutedExperts, routed_experts
from hybridserve.models.parallel import PipelineStage, SharedNormGroups, TPGroup
from hybridserve.models.layers.rope import RopeTable, apply_rope_
from hybridserve.models.layers.span_logits import LogitsBuffer, SpanLogits, span_logits_from


class HybridBackend(Protocol):
    """What a step gives the model: paged attention and the requests' Mamba states."""

    mamba: MambaStateIO

    def attention(self, layer_idx: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        ...


class AttentionWeights(nn.Module):
    """A Bamba attention layer (fused q|k|v, no biases)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.qkv = nn.Parameter(torch.zeros(qkv_out, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.o = nn.Parameter(torch.zeros(cfg.hidden_size, cfg.num_heads * cfg.head_dim, dtype=dtype),
                              requires_grad=False)


class MambaLayerWeights(nn.Module):
    """One layer: its norm, a mixer or attention, and (Bamba) the MLP after it. `cfg` is the
    rank's local config; row_bias and norm_share as for Mamba2MixerWeights."""

    def __init__(self, cfg: ModelConfig, kind: str, dtype: torch.dtype, row_bias: bool = True,
                 norm_share: SharedNormGroups | None = None) -> None:
        super().__init__()
        assert cfg.mamba is not None

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)

        self.norm = p(cfg.hidden_size)
        self.mixer = (Mamba2MixerWeights(cfg.mamba, cfg.hidden_size, dtype, row_bias, norm_share)
                      if kind == MAMBA else None)
        self.attn = AttentionWeights(cfg, dtype) if kind == FULL else None
        opts = cfg.hybrid
        mlp_layers = opts is not None and opts.mlp_layers
        has_mlp = cfg.intermediate_size > 0 and not mlp_layers  # a SwiGLU MLP after the mixer
        self.pre_ff_norm = p(cfg.hidden_size) if has_mlp else None
        self.gate_up = p(2 * cfg.intermediate_size, cfg.hidden_size) if has_mlp else None
        # Nemotron-H's MLP layer: relu(x up^T)^2 down^T, its only block.
        self.up = p(cfg.intermediate_size, cfg.hidden_size) if kind == MLP_ONLY else None
        self.down = p(cfg.hidden_size, cfg.intermediate_size) if has_mlp or kind == MLP_ONLY else None
        self.experts = (RoutedExperts(opts.num_experts, cfg.hidden_size, opts.expert_intermediate_size, dtype)
                        if opts is not None and opts.num_experts else None)


class MambaLM(StagedModel):
    """forward(ids, positions, max_position, backend) -> final hidden; logits(h) -> vocab logits.
    Built from the global config; `cfg` is the rank's local view (see DecoderLM)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, stage: PipelineStage | None = None,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        local = self.init_stage(cfg, dtype, stage, tp)
        self.layers = nn.ModuleList(self._layer_weights(cfg, local, i, dtype) for i in self.layer_ids)
        self._rope: RopeTable | None = None
        self._logits_buffer: LogitsBuffer | None = None
        self.opts = cfg.hybrid or HybridOptions()  # logits reads it for every subclass

    def _layer_weights(self, cfg: ModelConfig, local: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        """Layer `layer_idx`'s parameters, from the global config and the rank's (a hook: Qwen3-Next,
        LFM2 and Jamba build their own layers)."""
        mixer = cfg.mamba
        assert mixer is not None, "MambaLM needs a Mamba2 / Bamba config"
        share = None
        if self.tp is not None and self.tp.size > mixer.n_groups:  # groups span ranks
            share = SharedNormGroups(self.tp, mixer.n_groups, mixer.intermediate_size // mixer.n_groups)
        return MambaLayerWeights(local, local.layer_types[layer_idx], dtype, self.row_bias, share)

    def setup(self, device: torch.device) -> None:
        """Constants on the model's device (call after moving the weights)."""
        self._eps = torch.tensor(self.cfg.rms_norm_eps, dtype=self.dtype, device=device)
        self._embed_scale = torch.tensor(self.cfg.embed_scale, dtype=self.dtype, device=device)
        if FULL in self.cfg.rope and FULL in self.cfg.layer_types:  # Granite 4.0-H's may have no RoPE
            dim = self.cfg.rotary_dim or self.cfg.head_dim
            self._rope = RopeTable(self.cfg.rope[FULL], dim, min(self.cfg.max_position_embeddings, 4096), device,
                                   self.dtype)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, max_position: int,
                backend: HybridBackend, hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        """As DecoderLM.forward: [T] ids (first stage) or hidden_in (others) -> stage_output."""
        cfg = self.cfg
        mixer_cfg = cfg.mamba
        assert mixer_cfg is not None
        h = self.stage_input(input_ids, hidden_in)
        eps, inv_h = self._eps, 1.0 / cfg.hidden_size
        rope = self._rope.lookup(positions, max_position) if self._rope is not None else None
        scaled = self.opts.residual_multiplier != 1.0
        for i, w in zip(self.layer_ids, self.layers):
            x = rms_norm(h, w.norm, eps, inv_h)
            if w.mixer is not None:
                io = backend.mamba
                conv, ssm = io.read(i)
                out, token_states, boundary_states = mamba2_mixer(w.mixer, mixer_cfg, x, conv, ssm, io.counts,
                                                                  io.verify, io.checkpoints)
                io.write(i, (conv, ssm), token_states, boundary_states)
            elif w.attn is not None:
                out = self._attention(i, w.attn, x, rope, backend)
            else:
                assert w.up is not None and w.down is not None
                out = F.linear(torch.square(F.relu(F.linear(x, w.up))), w.down)
            out = self.reduce(out)
            h = h + out * self.opts.residual_multiplier if scaled else h + out
            if w.gate_up is not None:
                if w.experts is None and not scaled:  # Bamba: the down projection fused with the add
                    h = self.add_swiglu_mlp(h, w.pre_ff_norm, w.gate_up, w.down)
                    continue
                x = rms_norm(h, w.pre_ff_norm, eps, inv_h)
                gate, up = F.linear(x, w.gate_up).chunk(2, dim=-1)
                out = F.linear(F.silu(gate) * up, w.down)
                if w.experts is not None:
                    out = routed_experts(x, w.experts, self.opts.experts_per_tok) + out
                h = h + self.reduce(out) * self.opts.residual_multiplier
        return self.stage_output(h)

    def add_swiglu_mlp(self, h: torch.Tensor, norm: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
                       ) -> torch.Tensor:
        """h + down(silu(gate) * up) of norm(h): gate_up the fused rows, down row-parallel."""
        x = rms_norm(h, norm, self._eps, 1.0 / self.cfg.hidden_size)
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        return self.add_row_parallel(h, F.silu(gate) * up, lambda y: F.linear(y, down),
                                     lambda r, y: torch.addmm(r, y, down.t()))

    def _attention(self, i: int, w: AttentionWeights, x: torch.Tensor,
                   rope: tuple[torch.Tensor, torch.Tensor] | None, backend: HybridBackend) -> torch.Tensor:
        cfg = self.cfg
        nq, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        T = x.shape[0]
        qkv = F.linear(x, w.qkv)
        qk = qkv[:, : (nq + nkv) * hd].view(T, nq + nkv, hd)
        if rope is not None:  # None: attention without positions (Granite 4.0-H's "nope")
            cos, sin = rope
            apply_rope_(qk[..., : cos.shape[-1]], cos, sin)  # partial RoPE: the first rotary_dim dims
        attn = backend.attention(i, qk[:, :nq], qkv[:, nq * hd :].view(T, 2, nkv, hd))
        return F.linear(attn, w.o)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "weights not loaded"
        logits = F.linear(hidden, self.lm_head)
        if self.cfg.logit_scale != 1.0:  # Falcon-H1's lm_head_multiplier
            logits = logits * self.cfg.logit_scale
        return logits / self.opts.logits_divisor if self.opts.logits_divisor != 1.0 else logits

    def greedy_tokens(self, hidden: torch.Tensor) -> list[int]:
        return self.logits(hidden).argmax(dim=-1).tolist()

    def span_logits(self, hidden: torch.Tensor, inv_temperature: torch.Tensor, stored: bool = True) -> SpanLogits:
        """The logits of the rows that sample, with the span summaries sampling reads (always
        stored: `stored` False is a hint this head has no use for)."""
        if self._logits_buffer is None:
            self._logits_buffer = LogitsBuffer(self.cfg.vocab_size)
        return span_logits_from(self.logits(hidden), inv_temperature, self._logits_buffer)
