"""Jamba (JambaForCausalLM) over a flat batch, with the DecoderLM interface.

Layer:  h += mamba1(norm(h)) or attention(norm(h));  h += mlp or moe(pre_ff_norm(h))

mamba1 is the mixer of mamba1.py, whose (conv, SSM) states the step backend's `mamba` (a
MambaStateIO) keeps per request; attention is GQA without RoPE (positions reach it only
through the Mamba layers); the MLP is SwiGLU, on the expert layers a mixture of experts
(softmax router, top k, the chosen weights not renormalised). As MambaLM (whose heads it
shares), a model may be one pipeline stage and one tensor-parallel rank: attention is cut
by heads, mixers by channels, MLPs and experts by intermediate columns.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.models.arch.decoder import rms_norm
from hybridserve.models.arch.jamba_config import MAMBA1
from hybridserve.models.arch.mamba1 import Mamba1MixerWeights, mamba1_mixer
from hybridserve.models.arch.mamba_lm import AttentionWeights, HybridBackend, MambaLM
from hybridserve.models.arch.routed_experts import RoutedExperts, routed_experts
from hybridserve.models.config import FULL, ModelConfig


class JambaLayerWeights(nn.Module):
    """One layer: its input norm, a Mamba1 mixer or attention, the pre-FFN norm and a dense
    SwiGLU MLP or experts. `cfg` is the rank's local config."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype, row_bias: bool) -> None:
        super().__init__()
        opts = cfg.jamba
        assert opts is not None

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)

        kind = cfg.layer_types[layer_idx]
        self.norm = p(cfg.hidden_size)
        self.mixer = Mamba1MixerWeights(opts.mixer, cfg.hidden_size, dtype, row_bias) if kind == MAMBA1 else None
        self.attn = AttentionWeights(cfg, dtype) if kind == FULL else None
        self.pre_ff_norm = p(cfg.hidden_size)
        moe = layer_idx in opts.expert_layers
        self.experts = (RoutedExperts(opts.num_experts, cfg.hidden_size, cfg.intermediate_size, dtype)
                        if moe else None)
        self.gate_up = None if moe else p(2 * cfg.intermediate_size, cfg.hidden_size)
        self.down = None if moe else p(cfg.hidden_size, cfg.intermediate_size)


class JambaLM(MambaLM):
    """forward(ids, positions, max_position, backend) -> final hidden; logits(h) -> vocab logits.
    Built from the global config; `cfg` is the rank's local view (see DecoderLM)."""

    def _layer_weights(self, cfg: ModelConfig, local: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        assert cfg.jamba is not None, "JambaLM needs a Jamba config"
        return JambaLayerWeights(local, layer_idx, dtype, self.row_bias)

    def setup(self, device: torch.device) -> None:
        """Constants on the model's device (call after moving the weights); no RoPE table."""
        self._eps = torch.tensor(self.cfg.rms_norm_eps, dtype=self.dtype, device=device)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, max_position: int,
                backend: HybridBackend, hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        """As DecoderLM.forward: [T] ids (first stage) or hidden_in (others) -> stage_output."""
        cfg = self.cfg
        assert cfg.jamba is not None
        h = self.stage_input(input_ids, hidden_in)
        eps, inv_h = self._eps, 1.0 / cfg.hidden_size
        for i, w in zip(self.layer_ids, self.layers):
            x = rms_norm(h, w.norm, eps, inv_h)
            if w.mixer is not None:
                io = backend.mamba
                conv, ssm = io.read(i)
                out, token_states, boundary_states = mamba1_mixer(w.mixer, cfg.jamba.mixer, x, conv, ssm, io.counts,
                                                                  io.verify, io.checkpoints, self.reduce)
                h = h + self.reduce(out)
                io.write(i, (conv, ssm), token_states, boundary_states)
            else:
                assert w.attn is not None
                h = h + self.reduce(self._attention(i, w.attn, x, None, backend))  # no RoPE
            if w.experts is not None:
                x = rms_norm(h, w.pre_ff_norm, eps, inv_h)
                h = h + self.reduce(routed_experts(x, w.experts, cfg.jamba.top_k, renormalize=False))
            else:
                assert w.gate_up is not None and w.down is not None
                h = self.add_swiglu_mlp(h, w.pre_ff_norm, w.gate_up, w.down)
        return self.stage_output(h)
