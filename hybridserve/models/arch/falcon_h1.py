"""Falcon-H1 (FalconH1ForCausalLM): a Mamba2 mixer and attention side by side in every layer.

    x = norm(h);  h += mixer(x) + attention(x);  h += mlp(pre_ff_norm(h))

Each decoder layer j is two cache layers, so that its attention keeps K/V and its mixer a
state as in any other hybrid: layer 2j (full attention, RoPE on all of each head) holds the
input norm and the attention, layer 2j + 1 the mixer and the MLP after the pair. A pipeline
stage holds whole pairs. Falcon-H1's multipliers are folded into the weights they scale by
the loader (models/loaders/falcon_h1_loader.py); its embedding and lm_head multipliers are
ModelConfig.embed_scale and logit_scale.
"""

from __future__ import annotations

import torch

from hybridserve.core.errors import ConfigError
from hybridserve.models.arch.decoder import rms_norm
from hybridserve.models.arch.mamba2 import mamba2_mixer
from hybridserve.models.arch.mamba_lm import HybridBackend, MambaLM
from hybridserve.models.config import ModelConfig
from hybridserve.models.parallel import PipelineStage, TPGroup


class FalconH1LM(MambaLM):
    """MambaLM's interface over pairs of cache layers (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, stage: PipelineStage | None = None,
                 tp: TPGroup | None = None) -> None:
        super().__init__(cfg, dtype, stage, tp)
        ids = self.layer_ids
        if ids.start % 2 or ids.stop % 2:
            raise ConfigError(f"a FalconH1 pipeline stage must hold whole layers; this one holds cache layers "
                              f"{ids.start}..{ids.stop - 1} of {cfg.num_layers} (2 per layer)")
        for i, w in zip(ids, self.layers):
            if i % 2 == 0:  # the attention half: the layer's input norm, no MLP
                w.pre_ff_norm = w.gate_up = w.down = None
            else:  # the mixer half reads the attention half's normed input
                w.norm = None

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, max_position: int,
                backend: HybridBackend, hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.cfg
        assert cfg.mamba is not None and self._rope is not None
        h = self.stage_input(input_ids, hidden_in)
        eps, inv_h = self._eps, 1.0 / cfg.hidden_size
        rope = self._rope.lookup(positions, max_position)
        layers = list(zip(self.layer_ids, self.layers))
        io = backend.mamba
        for (a, attn), (m, mix) in zip(layers[::2], layers[1::2]):
            assert attn.attn is not None and mix.mixer is not None and mix.gate_up is not None
            x = rms_norm(h, attn.norm, eps, inv_h)
            conv, ssm = io.read(m)
            out, token_states, boundary_states = mamba2_mixer(mix.mixer, cfg.mamba, x, conv, ssm, io.counts,
                                                              io.verify, io.checkpoints)
            io.write(m, (conv, ssm), token_states, boundary_states)
            h = h + self.reduce(out + self._attention(a, attn.attn, x, rope, backend))
            h = self.add_swiglu_mlp(h, mix.pre_ff_norm, mix.gate_up, mix.down)
        return self.stage_output(h)
