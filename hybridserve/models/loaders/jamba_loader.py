"""Load an HF JambaForCausalLM directory into a JambaLM.

HF names (layer i)::

    model.embed_tokens, model.final_layernorm, lm_head (untied)
    model.layers.i.input_layernorm, .pre_ff_layernorm
    Mamba1 layers:   .mamba.{in_proj (rows x | gate), conv1d (weight [I, 1, K]), x_proj, dt_proj (+ bias),
                     A_log [I, N], D, out_proj, dt_layernorm, b_layernorm, c_layernorm}
    attention:       .self_attn.{q,k,v,o}_proj
    MLP:             .feed_forward.{gate,up,down}_proj, or on expert layers .feed_forward.router and
                     .feed_forward.experts.e.{gate,up,down}_proj (the Hub's checkpoints), or stacked as
                     transformers holds them: .feed_forward.experts.gate_up_proj [E, 2F, D] (gate rows
                     first) and .down_proj [E, D, F] (what a converted GGUF holds, gguf_jamba.py)

As in loader.py, every tensor must be present with its shape, and none may be left over;
a pipeline stage reads its layers only, a tensor-parallel rank cuts each to its share
(mixer channels, attention heads, MLP and expert intermediate columns).
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridserve.models.arch.jamba import JambaLM
from hybridserve.models.arch.routed_experts import RoutedExperts
from hybridserve.models.arch.mamba1 import Mamba1MixerWeights
from hybridserve.models.config import ModelConfig
from hybridserve.models.loaders.checkpoint import (Weights, fill_ends, load_staged, take_attention, take_gate_up,
                                                  take_row_bias)
from hybridserve.models.parallel import PipelineStage, TPGroup


def load_jamba_model(model_dir: Path, cfg: ModelConfig, device: str | torch.device, dtype: torch.dtype,
                     stage: PipelineStage | None = None, tp: TPGroup | None = None) -> JambaLM:
    return load_staged(JambaLM(cfg, dtype, stage, tp), model_dir, cfg, device, dtype, _fill)


def _fill_mixer(m: Mamba1MixerWeights, cfg: ModelConfig, w: Weights, prefix: str, tp: TPGroup) -> None:
    """`cfg` global: each tensor is checked at its full shape, then cut to this rank's channels."""
    assert cfg.jamba is not None
    mc = cfg.jamba.mixer
    I, N, R, hidden = mc.intermediate_size, mc.state_size, mc.dt_rank, cfg.hidden_size
    m.in_proj.copy_(torch.cat([tp.shard(t) for t in w.take(prefix + "in_proj.weight", (2 * I, hidden)).chunk(2)]))
    m.conv_w.copy_(tp.shard(w.take(prefix + "conv1d.weight", (I, 1, mc.conv_kernel))[:, 0]))
    if m.conv_b is not None:
        m.conv_b.copy_(tp.shard(w.take(prefix + "conv1d.bias", (I,))))
    m.x_proj.copy_(tp.shard(w.take(prefix + "x_proj.weight", (R + 2 * N, I)), 1))
    m.dt_norm.copy_(w.take(prefix + "dt_layernorm.weight", (R,)))
    m.b_norm.copy_(w.take(prefix + "b_layernorm.weight", (N,)))
    m.c_norm.copy_(w.take(prefix + "c_layernorm.weight", (N,)))
    m.dt_proj.copy_(tp.shard(w.take(prefix + "dt_proj.weight", (I, R))))
    m.dt_bias.copy_(tp.shard(w.take(prefix + "dt_proj.bias", (I,))))
    m.A.copy_(-torch.exp(tp.shard(w.take(prefix + "A_log", (I, N))).float()))
    m.D.copy_(tp.shard(w.take(prefix + "D", (I,))))
    m.out_proj.copy_(tp.shard(w.take(prefix + "out_proj.weight", (hidden, I)), 1))
    if m.in_proj_bias is not None:
        bias = w.take(prefix + "in_proj.bias", (2 * I,))
        m.in_proj_bias.copy_(torch.cat([tp.shard(t) for t in bias.chunk(2)]))
        take_row_bias(w, m.out_proj_bias, prefix + "out_proj.bias", hidden)


def _fill_experts(e: RoutedExperts, cfg: ModelConfig, w: Weights, prefix: str, tp: TPGroup) -> None:
    H, I = cfg.hidden_size, cfg.intermediate_size
    E = e.router.shape[0]
    e.router.copy_(w.take(prefix + "router.weight", (E, H)))
    if w.has(prefix + "experts.gate_up_proj"):
        gate_up = w.take(prefix + "experts.gate_up_proj", (E, 2 * I, H))
        down = w.take(prefix + "experts.down_proj", (E, H, I))
        for k in range(E):
            e.gate_up[k].copy_(torch.cat([tp.shard(t) for t in gate_up[k].chunk(2)]))
            e.down[k].copy_(tp.shard(down[k], 1))
        return
    for k in range(E):
        x = f"{prefix}experts.{k}."
        e.gate_up[k].copy_(take_gate_up(w, tp, x, (I, H)))
        e.down[k].copy_(tp.shard(w.take(x + "down_proj.weight", (H, I)), 1))


def _fill(model: JambaLM, cfg: ModelConfig, w: Weights) -> None:
    """HF tensors into `model` (its stage's layers, its rank's share); `cfg` the global config."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    tp = model.tp or TPGroup()
    fill_ends(model, cfg, w, "model.embed_tokens.weight", "model.final_layernorm.weight")
    w.keep_layers("model.layers.", model.layer_ids)
    with torch.no_grad():
        for i, layer in zip(model.layer_ids, model.layers):
            p = f"model.layers.{i}."
            layer.norm.copy_(w.take(p + "input_layernorm.weight", (H,)))
            layer.pre_ff_norm.copy_(w.take(p + "pre_ff_layernorm.weight", (H,)))
            if layer.mixer is not None:
                _fill_mixer(layer.mixer, cfg, w, p + "mamba.", tp)
            if layer.attn is not None:
                qkv, o = take_attention(w, cfg, tp, p + "self_attn.")
                layer.attn.qkv.copy_(qkv)
                layer.attn.o.copy_(o)
            f = p + "feed_forward."
            if layer.experts is not None:
                _fill_experts(layer.experts, cfg, w, f, tp)
            elif layer.gate_up is not None and layer.down is not None:
                layer.gate_up.copy_(take_gate_up(w, tp, f, (I, H)))
                layer.down.copy_(tp.shard(w.take(f + "down_proj.weight", (H, I)), 1))
