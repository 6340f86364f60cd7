"""LFM2 (Lfm2ForCausalLM) over a flat batch, with the DecoderLM interface.

Layer:  h += conv(norm(h)) or attention(norm(h));  h += mlp(ffn_norm(h))

conv is the short gated convolution (short_conv.py), whose state the step backend's
`mamba` (a MambaStateIO) keeps per request as one part; attention is GQA with an RMSNorm
over each head of q and k before RoPE (all of head_dim rotated); the MLP is SwiGLU. As
MambaLM (whose rope setup and heads it shares), a model may be one pipeline stage and one
tensor-parallel rank: attention is cut by heads, the convolution by channels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.models.arch.decoder import rms_norm
from hybridserve.models.arch.lfm2_config import SHORT_CONV
from hybridserve.models.arch.mamba_lm import AttentionWeights, HybridBackend, MambaLM
from hybridserve.models.arch.short_conv import ShortConvWeights, short_conv_mixer
from hybridserve.models.config import FULL, ModelConfig
from hybridserve.models.layers.rope import apply_rope_


class Lfm2LayerWeights(nn.Module):
    """One layer: its operator norm, a short convolution or attention (with q / k norms), the
    FFN norm and SwiGLU MLP. `cfg` is the rank's local config."""

    def __init__(self, cfg: ModelConfig, kind: str, dtype: torch.dtype, row_bias: bool) -> None:
        super().__init__()
        assert cfg.short_conv is not None

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)

        self.norm = p(cfg.hidden_size)
        self.conv = ShortConvWeights(cfg.short_conv, cfg.hidden_size, dtype, row_bias) if kind == SHORT_CONV else None
        self.attn = AttentionWeights(cfg, dtype) if kind == FULL else None
        self.q_norm = p(cfg.head_dim) if kind == FULL else None
        self.k_norm = p(cfg.head_dim) if kind == FULL else None
        self.pre_ff_norm = p(cfg.hidden_size)
        self.gate_up = p(2 * cfg.intermediate_size, cfg.hidden_size)
        self.down = p(cfg.hidden_size, cfg.intermediate_size)


class Lfm2LM(MambaLM):
    """forward(ids, positions, max_position, backend) -> final hidden; logits(h) -> vocab logits.
    Built from the global config; `cfg` is the rank's local view (see DecoderLM)."""

    def _layer_weights(self, cfg: ModelConfig, local: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        assert cfg.short_conv is not None, "Lfm2LM needs an LFM2 config"
        return Lfm2LayerWeights(local, local.layer_types[layer_idx], dtype, self.row_bias)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, max_position: int,
                backend: HybridBackend, hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        """As DecoderLM.forward: [T] ids (first stage) or hidden_in (others) -> stage_output."""
        cfg = self.cfg
        conv_cfg = cfg.short_conv
        assert conv_cfg is not None
        h = self.stage_input(input_ids, hidden_in)
        eps, inv_h = self._eps, 1.0 / cfg.hidden_size
        rope = self._rope.lookup(positions, max_position) if self._rope is not None else None
        for i, w in zip(self.layer_ids, self.layers):
            x = rms_norm(h, w.norm, eps, inv_h)
            if w.conv is not None:
                io = backend.mamba
                (state,) = io.read(i)
                out, token_states, boundary_states = short_conv_mixer(w.conv, conv_cfg, x, state, io.counts,
                                                                      io.verify, io.checkpoints)
                h = h + self.reduce(out)
                io.write(i, (state,), token_states, boundary_states)
            else:
                assert rope is not None
                h = h + self.reduce(self._normed_attention(i, w, x, rope, backend))
            h = self.add_swiglu_mlp(h, w.pre_ff_norm, w.gate_up, w.down)
        return self.stage_output(h)

    def _normed_attention(self, i: int, w: Lfm2LayerWeights, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                          backend: HybridBackend) -> torch.Tensor:
        """GQA attention, q and k each RMS-normed per head (HF's q_layernorm / k_layernorm) before RoPE."""
        cfg = self.cfg
        assert w.attn is not None and w.q_norm is not None and w.k_norm is not None
        nq, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        T = x.shape[0]
        qkv = F.linear(x, w.attn.qkv)
        inv_hd = 1.0 / hd
        q = rms_norm(qkv[:, : nq * hd].view(T, nq, hd), w.q_norm, self._eps, inv_hd)
        k = rms_norm(qkv[:, nq * hd : (nq + nkv) * hd].view(T, nkv, hd), w.k_norm, self._eps, inv_hd)
        cos, sin = rope
        apply_rope_(q, cos, sin)
        apply_rope_(k, cos, sin)
        kv = torch.stack((k, qkv[:, (nq + nkv) * hd :].view(T, nkv, hd)), dim=1)  # [T, 2, nkv, hd]
        return F.linear(backend.attention(i, q, kv), w.attn.o)
