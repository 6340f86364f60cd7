"""Load an HF Mamba2ForCausalLM, BambaForCausalLM, GraniteMoeHybridForCausalLM or NemotronHForCausalLM
directory into a MambaLM.

HF names per architecture (layer i)::

    Mamba2: backbone.embeddings, backbone.layers.i.norm, backbone.layers.i.mixer.*, backbone.norm_f
    Bamba:  model.embed_tokens, model.layers.i.input_layernorm, model.layers.i.mamba.* or
            .self_attn.{q,k,v,o}_proj, .pre_ff_layernorm, .feed_forward.{gate,up,down}_proj,
            model.final_layernorm
    Nemotron-H: backbone.embeddings, backbone.layers.i.norm, backbone.layers.i.mixer.* (a mixer's,
            attention's {q,k,v,o}_proj or the MLP's up_proj, down_proj), backbone.norm_f
    Granite 4.0-H: Bamba's, but model.norm, .post_attention_layernorm, .shared_mlp.input_linear
            ([gate | up] in one) and .output_linear, .block_sparse_moe.router.layer,
            .block_sparse_moe.input_linear [E, 2I, H] and .output_linear [E, H, I]
    mixer:  in_proj, conv1d (weight [conv_dim, 1, K]), dt_bias, A_log, D, norm, out_proj

As in loader.py, every tensor must be present with its shape, and none may be left over;
a pipeline stage reads its layers only, a tensor-parallel rank cuts each to its share.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hybridserve.models.loaders.checkpoint import (Weights, fill_ends, load_staged, take_attention, take_gate_up,
                                                  take_row_bias)
from hybridserve.models.config import ModelConfig
from hybridserve.models.arch.mamba2 import Mamba2MixerWeights
from hybridserve.models.arch.mamba_config import GATE_ONLY, MambaMixerConfig
from hybridserve.models.arch.mamba_lm import MambaLayerWeights, MambaLM
from hybridserve.models.parallel import PipelineStage, TPGroup, group_rows


def load_mamba_model(model_dir: Path, cfg: ModelConfig, device: str | torch.device, dtype: torch.dtype,
                     stage: PipelineStage | None = None, tp: TPGroup | None = None, build: type[MambaLM] = MambaLM,
                     fill: Callable[[Any, ModelConfig, Weights], None] | None = None) -> MambaLM:
    """`build` and `fill`: another layer layout's model class and its fill (Falcon-H1's)."""
    return load_staged(build(cfg, dtype, stage, tp), model_dir, cfg, device, dtype, fill or _fill)


def _shard_xbc(t: torch.Tensor, mc: MambaMixerConfig, tp: TPGroup) -> torch.Tensor:
    """Rows (or channels) [x | B | C] of a mixer -> this rank's: its heads' x, its groups' B and C."""
    n = mc.n_groups * mc.state_size
    x, B, C = t.split([mc.intermediate_size, n, n])
    return torch.cat([tp.shard(x), group_rows(tp, mc.n_groups, B), group_rows(tp, mc.n_groups, C)])


def _shard_in_proj(t: torch.Tensor, mc: MambaMixerConfig, tp: TPGroup) -> torch.Tensor:
    """in_proj rows [z | x | B | C | dt] (weight or bias) -> this rank's."""
    z, xbc, dt = t.split([mc.intermediate_size, mc.conv_dim, mc.num_heads])
    return torch.cat([tp.shard(z), _shard_xbc(xbc, mc, tp), tp.shard(dt)])


def fill_mixer(m: Mamba2MixerWeights, cfg: ModelConfig, w: Weights, prefix: str, tp: TPGroup,
               in_scale: torch.Tensor | None = None, out_scale: float = 1.0) -> None:
    """`cfg` global: each tensor is checked at its full shape, then cut to this rank's heads.
    in_scale [in_proj_size] scales in_proj's rows, out_scale out_proj (Falcon-H1's multipliers)."""
    mc = cfg.mamba
    assert mc is not None
    H, hidden = mc.num_heads, cfg.hidden_size
    in_proj = w.take(prefix + "in_proj.weight", (mc.in_proj_size, hidden))
    m.in_proj.copy_(_shard_in_proj(in_proj if in_scale is None else in_proj * in_scale[:, None], mc, tp))
    m.conv_w.copy_(_shard_xbc(w.take(prefix + "conv1d.weight", (mc.conv_dim, 1, mc.conv_kernel))[:, 0], mc, tp))
    if m.conv_b is not None:
        m.conv_b.copy_(_shard_xbc(w.take(prefix + "conv1d.bias", (mc.conv_dim,)), mc, tp))
    m.dt_bias.copy_(tp.shard(w.take(prefix + "dt_bias", (H,))))
    m.A.copy_(-torch.exp(tp.shard(w.take(prefix + "A_log", (H,))).float()))
    m.D.copy_(tp.shard(w.take(prefix + "D", (H,))))
    if mc.gate != GATE_ONLY:
        m.norm.copy_(tp.shard(w.take(prefix + "norm.weight", (mc.intermediate_size,))))
    out_proj = w.take(prefix + "out_proj.weight", (hidden, mc.intermediate_size))
    m.out_proj.copy_(tp.shard(out_proj * out_scale if out_scale != 1.0 else out_proj, 1))
    if m.in_proj_bias is not None:
        m.in_proj_bias.copy_(_shard_in_proj(w.take(prefix + "in_proj.bias", (mc.in_proj_size,)), mc, tp))
        take_row_bias(w, m.out_proj_bias, prefix + "out_proj.bias", hidden)


def _fill(model: MambaLM, cfg: ModelConfig, w: Weights) -> None:
    """HF tensors into `model` (its stage's layers, its rank's share); `cfg` the global config."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    backbone = cfg.family in ("mamba2", "nemotron_h")  # their names: backbone., mixer. for every block
    root = "backbone." if backbone else "model."
    tp = model.tp or TPGroup()
    final_norm = "norm_f" if backbone else "norm" if cfg.family == "granite_hybrid" else "final_layernorm"
    fill_ends(model, cfg, w, root + ("embeddings.weight" if backbone else "embed_tokens.weight"),
              root + final_norm + ".weight")
    w.keep_layers(root + "layers.", model.layer_ids)
    with torch.no_grad():
        for i, layer in zip(model.layer_ids, model.layers):
            p = f"{root}layers.{i}."
            layer.norm.copy_(w.take(p + ("norm.weight" if backbone else "input_layernorm.weight"), (H,)))
            if layer.mixer is not None:
                fill_mixer(layer.mixer, cfg, w, p + ("mixer." if backbone else "mamba."), tp)
            if layer.up is not None and layer.down is not None:  # Nemotron-H's MLP layer
                layer.up.copy_(tp.shard(w.take(p + "mixer.up_proj.weight", (I, H))))
                layer.down.copy_(tp.shard(w.take(p + "mixer.down_proj.weight", (H, I)), 1))
            if layer.attn is not None:
                qkv, o = take_attention(w, cfg, tp, p + ("mixer." if backbone else "self_attn."))
                layer.attn.qkv.copy_(qkv)
                layer.attn.o.copy_(o)
            if cfg.family == "granite_hybrid":
                _fill_granite_ffn(layer, cfg, w, p, tp)
            elif layer.gate_up is not None and layer.down is not None and layer.pre_ff_norm is not None:
                f = p + "feed_forward."
                layer.pre_ff_norm.copy_(w.take(p + "pre_ff_layernorm.weight", (H,)))
                layer.gate_up.copy_(take_gate_up(w, tp, f, (I, H)))
                layer.down.copy_(tp.shard(w.take(f + "down_proj.weight", (H, I)), 1))


def _split_gate_up(t: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    """[gate | up] along `dim` -> this rank's columns of each, still gate then up."""
    gate, up = t.chunk(2, dim=dim)
    return torch.cat([tp.shard(gate, dim), tp.shard(up, dim)], dim=dim)


def _fill_granite_ffn(layer: MambaLayerWeights, cfg: ModelConfig, w: Weights, p: str, tp: TPGroup) -> None:
    """Granite 4.0-H's shared MLP and routed experts (intermediate columns cut per rank)."""
    assert layer.pre_ff_norm is not None and layer.gate_up is not None and layer.down is not None
    H, I = cfg.hidden_size, cfg.intermediate_size
    layer.pre_ff_norm.copy_(w.take(p + "post_attention_layernorm.weight", (H,)))
    layer.gate_up.copy_(_split_gate_up(w.take(p + "shared_mlp.input_linear.weight", (2 * I, H)), tp, 0))
    layer.down.copy_(tp.shard(w.take(p + "shared_mlp.output_linear.weight", (H, I)), 1))
    ex, opts = layer.experts, cfg.hybrid
    if ex is None or opts is None:
        return
    E, EI, m = opts.num_experts, opts.expert_intermediate_size, p + "block_sparse_moe."
    ex.router.copy_(w.take(m + "router.layer.weight", (E, H)))
    ex.gate_up.copy_(_split_gate_up(w.take(m + "input_linear.weight", (E, 2 * EI, H)), tp, 1))
    ex.down.copy_(tp.shard(w.take(m + "output_linear.weight", (E, H, EI)), 2))
