"""Load an HF Mamba2ForCausalLM or BambaForCausalLM directory into a MambaLM.

HF names per architecture (layer i)::

    Mamba2: backbone.embeddings, backbone.layers.i.norm, backbone.layers.i.mixer.*, backbone.norm_f
    Bamba:  model.embed_tokens, model.layers.i.input_layernorm, model.layers.i.mamba.* or
            .self_attn.{q,k,v,o}_proj, .pre_ff_layernorm, .feed_forward.{gate,up,down}_proj,
            model.final_layernorm
    mixer:  in_proj, conv1d (weight [conv_dim, 1, K]), dt_bias, A_log, D, norm, out_proj

As in loader.py, every tensor must be present with its shape, and none may be left over.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridserve.models.config import ModelConfig
from hybridserve.models.checkpoint import Weights, open_checkpoint, place_weights
from hybridserve.models.mamba2 import Mamba2MixerWeights
from hybridserve.models.mamba_lm import AttentionWeights, MambaLM


def load_mamba_model(model_dir: Path, cfg: ModelConfig, device: str | torch.device, dtype: torch.dtype) -> MambaLM:
    model = MambaLM(cfg, dtype)
    w = Weights(open_checkpoint(model_dir), dtype)
    _fill(model, cfg, w)
    place_weights(model, cfg, w, device)
    model.setup(torch.device(device))
    return model.eval()


def _fill_mixer(m: Mamba2MixerWeights, cfg: ModelConfig, w: Weights, prefix: str) -> None:
    mc = cfg.mamba
    assert mc is not None
    H, hidden = mc.num_heads, cfg.hidden_size
    m.in_proj.copy_(w.take(prefix + "in_proj.weight", (mc.in_proj_size, hidden)))
    m.conv_w.copy_(w.take(prefix + "conv1d.weight", (mc.conv_dim, 1, mc.conv_kernel))[:, 0])
    if m.conv_b is not None:
        m.conv_b.copy_(w.take(prefix + "conv1d.bias", (mc.conv_dim,)))
    m.dt_bias.copy_(w.take(prefix + "dt_bias", (H,)))
    m.A.copy_(-torch.exp(w.take(prefix + "A_log", (H,)).float()))
    m.D.copy_(w.take(prefix + "D", (H,)))
    m.norm.copy_(w.take(prefix + "norm.weight", (mc.intermediate_size,)))
    m.out_proj.copy_(w.take(prefix + "out_proj.weight", (hidden, mc.intermediate_size)))
    if m.in_proj_bias is not None and m.out_proj_bias is not None:
        m.in_proj_bias.copy_(w.take(prefix + "in_proj.bias", (mc.in_proj_size,)))
        m.out_proj_bias.copy_(w.take(prefix + "out_proj.bias", (hidden,)))


def _fill_attention(a: AttentionWeights, cfg: ModelConfig, w: Weights, prefix: str) -> None:
    H, hd, nq, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    a.qkv.copy_(torch.cat([w.take(prefix + "q_proj.weight", (nq * hd, H)),
                           w.take(prefix + "k_proj.weight", (nkv * hd, H)),
                           w.take(prefix + "v_proj.weight", (nkv * hd, H))]))
    a.o.copy_(w.take(prefix + "o_proj.weight", (H, nq * hd)))


def _fill(model: MambaLM, cfg: ModelConfig, w: Weights) -> None:
    H, I = cfg.hidden_size, cfg.intermediate_size
    mamba2 = cfg.family == "mamba2"
    root = "backbone." if mamba2 else "model."
    with torch.no_grad():
        embed = root + ("embeddings.weight" if mamba2 else "embed_tokens.weight")
        model.embed.copy_(w.take(embed, (cfg.vocab_size, H)))
        model.final_norm.copy_(w.take(root + ("norm_f.weight" if mamba2 else "final_layernorm.weight"), (H,)))
        if not cfg.tie_word_embeddings:
            model.lm_head = torch.nn.Parameter(w.take("lm_head.weight", (cfg.vocab_size, H)), requires_grad=False)
        else:
            w.discard("lm_head.weight")
        for i, layer in enumerate(model.layers):
            p = f"{root}layers.{i}."
            layer.norm.copy_(w.take(p + ("norm.weight" if mamba2 else "input_layernorm.weight"), (H,)))
            if layer.mixer is not None:
                _fill_mixer(layer.mixer, cfg, w, p + ("mixer." if mamba2 else "mamba."))
            if layer.attn is not None:
                _fill_attention(layer.attn, cfg, w, p + "self_attn.")
            if layer.gate_up is not None and layer.down is not None and layer.pre_ff_norm is not None:
                f = p + "feed_forward."
                layer.pre_ff_norm.copy_(w.take(p + "pre_ff_layernorm.weight", (H,)))
                layer.gate_up.copy_(torch.cat([w.take(f + "gate_proj.weight", (I, H)),
                                               w.take(f + "up_proj.weight", (I, H))]))
                layer.down.copy_(w.take(f + "down_proj.weight", (H, I)))
