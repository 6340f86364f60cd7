"""Load an HF Lfm2ForCausalLM directory into an Lfm2LM.

HF names (layer i)::

    model.embed_tokens, model.embedding_norm (the final norm, despite its name), lm_head (untied)
    model.layers.i.operator_norm, .ffn_norm, .feed_forward.{w1 (gate), w3 (up), w2 (down)}
    conv layers:      .conv.in_proj (rows B | C | x), .conv.conv (weight [D, 1, L]), .conv.out_proj
    attention layers: .self_attn.{q,k,v,out}_proj, .self_attn.{q,k}_layernorm

As in loader.py, every tensor must be present with its shape, and none may be left over;
a pipeline stage reads its layers only, a tensor-parallel rank cuts each to its share
(attention by heads, the convolution by channels, the MLP by intermediate columns).
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridserve.models.arch.lfm2 import Lfm2LM
from hybridserve.models.arch.short_conv import ShortConvWeights
from hybridserve.models.config import ModelConfig
from hybridserve.models.loaders.checkpoint import Weights, fill_ends, load_staged, take_attention, take_row_bias
from hybridserve.models.parallel import PipelineStage, TPGroup


def load_lfm2_model(model_dir: Path, cfg: ModelConfig, device: str | torch.device, dtype: torch.dtype,
                    stage: PipelineStage | None = None, tp: TPGroup | None = None) -> Lfm2LM:
    return load_staged(Lfm2LM(cfg, dtype, stage, tp), model_dir, cfg, device, dtype, _fill)


def _shard_bcx(t: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """in_proj rows (or bias) [B | C | x] -> this rank's channels of each."""
    return torch.cat([tp.shard(part) for part in t.chunk(3)])


def _fill_conv(c: ShortConvWeights, cfg: ModelConfig, w: Weights, prefix: str, tp: TPGroup) -> None:
    """`cfg` global: each tensor is checked at its full shape, then cut to this rank's channels."""
    sc = cfg.short_conv
    assert sc is not None
    D, hidden = sc.channels, cfg.hidden_size
    c.in_proj.copy_(_shard_bcx(w.take(prefix + "in_proj.weight", (3 * D, hidden)), tp))
    c.conv_w.copy_(tp.shard(w.take(prefix + "conv.weight", (D, 1, sc.kernel))[:, 0]))
    c.out_proj.copy_(tp.shard(w.take(prefix + "out_proj.weight", (hidden, D)), 1))
    if sc.bias:
        assert c.in_proj_bias is not None and c.conv_b is not None
        c.in_proj_bias.copy_(_shard_bcx(w.take(prefix + "in_proj.bias", (3 * D,)), tp))
        c.conv_b.copy_(tp.shard(w.take(prefix + "conv.bias", (D,))))
        take_row_bias(w, c.out_proj_bias, prefix + "out_proj.bias", hidden)


def _fill(model: Lfm2LM, cfg: ModelConfig, w: Weights) -> None:
    """HF tensors into `model` (its stage's layers, its rank's share); `cfg` the global config."""
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    tp = model.tp or TPGroup()
    fill_ends(model, cfg, w, "model.embed_tokens.weight", "model.embedding_norm.weight")
    w.keep_layers("model.layers.", model.layer_ids)
    with torch.no_grad():
        for i, layer in zip(model.layer_ids, model.layers):
            p = f"model.layers.{i}."
            layer.norm.copy_(w.take(p + "operator_norm.weight", (H,)))
            if layer.conv is not None:
                _fill_conv(layer.conv, cfg, w, p + "conv.", tp)
            if layer.attn is not None and layer.q_norm is not None and layer.k_norm is not None:
                a = p + "self_attn."
                qkv, o = take_attention(w, cfg, tp, a, o_name="out_proj")
                layer.attn.qkv.copy_(qkv)
                layer.attn.o.copy_(o)
                layer.q_norm.copy_(w.take(a + "q_layernorm.weight", (hd,)))
                layer.k_norm.copy_(w.take(a + "k_layernorm.weight", (hd,)))
            f = p + "feed_forward."
            layer.pre_ff_norm.copy_(w.take(p + "ffn_norm.weight", (H,)))
            layer.gate_up.copy_(torch.cat([tp.shard(w.take(f + "w1.weight", (I, H))),
                                           tp.shard(w.take(f + "w3.weight", (I, H)))]))
            layer.down.copy_(tp.shard(w.take(f + "w2.weight", (H, I)), 1))
