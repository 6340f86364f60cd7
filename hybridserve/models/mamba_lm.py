"""Mamba2 and Bamba language models over a flat batch, with the DecoderLM interface.

Mamba2 layer:  h += mixer(norm(h))
Bamba layer:   h += mixer(norm(h)) or attention(norm(h));  h += mlp(pre_ff_norm(h))

The step backend gives attention (the runner's paged attention, for Bamba's attention
layers) and `mamba` (a MambaStateIO: each request's conv and SSM state of each Mamba
layer). The model knows nothing about blocks or requests beyond the chunk lengths.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.models.config import FULL, ModelConfig
from hybridserve.models.decoder import rms_norm
from hybridserve.models.mamba2 import Mamba2MixerWeights, MambaStateIO, mamba2_mixer
from hybridserve.models.mamba_config import MAMBA
from hybridserve.models.rope import RopeTable, apply_rope_


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
    """One layer: its norm, a mixer or attention, and (Bamba) the MLP after it."""

    def __init__(self, cfg: ModelConfig, kind: str, dtype: torch.dtype) -> None:
        super().__init__()
        assert cfg.mamba is not None

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)

        self.norm = p(cfg.hidden_size)
        self.mixer = Mamba2MixerWeights(cfg.mamba, cfg.hidden_size, dtype) if kind == MAMBA else None
        self.attn = AttentionWeights(cfg, dtype) if kind == FULL else None
        has_mlp = cfg.intermediate_size > 0
        self.pre_ff_norm = p(cfg.hidden_size) if has_mlp else None
        self.gate_up = p(2 * cfg.intermediate_size, cfg.hidden_size) if has_mlp else None
        self.down = p(cfg.hidden_size, cfg.intermediate_size) if has_mlp else None


class MambaLM(nn.Module):
    """forward(ids, positions, max_position, backend) -> final hidden; logits(h) -> vocab logits."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        assert cfg.mamba is not None, "MambaLM needs a Mamba2 / Bamba config"
        self.cfg = cfg
        self.dtype = dtype
        self.embed = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.layers = nn.ModuleList(MambaLayerWeights(cfg, kind, dtype) for kind in cfg.layer_types)
        self.final_norm = nn.Parameter(torch.zeros(cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.lm_head: torch.Tensor | None = None  # set by the loader (tied: the embedding)
        self._rope: RopeTable | None = None

    def setup(self, device: torch.device) -> None:
        """Constants on the model's device (call after moving the weights)."""
        self._eps = torch.tensor(self.cfg.rms_norm_eps, dtype=self.dtype, device=device)
        if FULL in self.cfg.layer_types:
            dim = self.cfg.rotary_dim or self.cfg.head_dim
            self._rope = RopeTable(self.cfg.rope[FULL], dim, min(self.cfg.max_position_embeddings, 4096), device,
                                   self.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, max_position: int,
                backend: HybridBackend) -> torch.Tensor:
        """input_ids, positions: [T] long. Returns hidden [T, hidden]."""
        cfg = self.cfg
        mixer_cfg = cfg.mamba
        assert mixer_cfg is not None
        h = F.embedding(input_ids, self.embed)
        eps, inv_h = self._eps, 1.0 / cfg.hidden_size
        rope = self._rope.lookup(positions, max_position) if self._rope is not None else None
        for i, w in enumerate(self.layers):
            x = rms_norm(h, w.norm, eps, inv_h)
            if w.mixer is not None:
                io = backend.mamba
                conv, ssm = io.read(i)
                out, token_states, boundary_states = mamba2_mixer(w.mixer, mixer_cfg, x, conv, ssm, io.counts,
                                                                  io.verify, io.checkpoints)
                h = h + out
                io.write(i, conv, ssm, token_states, boundary_states)
            else:
                assert w.attn is not None and rope is not None
                h = h + self._attention(i, w.attn, x, rope, backend)
            if w.gate_up is not None:
                x = rms_norm(h, w.pre_ff_norm, eps, inv_h)
                gate, up = F.linear(x, w.gate_up).chunk(2, dim=-1)
                h = torch.addmm(h, F.silu(gate) * up, w.down.t())
        return rms_norm(h, self.final_norm, eps, inv_h)

    def _attention(self, i: int, w: AttentionWeights, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                   backend: HybridBackend) -> torch.Tensor:
        cfg = self.cfg
        nq, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        T = x.shape[0]
        qkv = F.linear(x, w.qkv)
        qk = qkv[:, : (nq + nkv) * hd].view(T, nq + nkv, hd)
        cos, sin = rope
        apply_rope_(qk[..., : cos.shape[-1]], cos, sin)  # partial RoPE: the first rotary_dim dims
        attn = backend.attention(i, qk[:, :nq], qkv[:, nq * hd :].view(T, 2, nkv, hd))
        return F.linear(attn, w.o)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "weights not loaded"
        return F.linear(hidden, self.lm_head)

    def greedy_tokens(self, hidden: torch.Tensor) -> list[int]:
        return self.logits(hidden).argmax(dim=-1).tolist()
