"""Load an HF FalconH1ForCausalLM directory into a FalconH1LM, its multipliers folded into weights.

HF names (decoder layer j): model.embed_tokens, model.layers.j.input_layernorm,
.mamba.* (a Mamba2 mixer's, norm.weight only with mamba_rms_norm), .self_attn.{q,k,v,o}_proj,
.pre_ff_layernorm, .feed_forward.{gate,up,down}_proj, model.final_layernorm. Decoder layer j is
cache layers 2j (norm, attention) and 2j + 1 (mixer, MLP): see models/arch/falcon_h1.py.

Folding: HF scales a projection's input or output by a constant; the same constant times the
weight gives the same product (to float rounding), so the model runs no multiplier at all::

    in_proj rows  *= ssm_in * ssm_multipliers[z | x | B | C | dt]     out_proj  *= ssm_out
    q, v rows     *= attention_in        k rows *= attention_in * key   o_proj    *= attention_out
    gate_proj     *= mlp_multipliers[0]                                 down_proj *= mlp_multipliers[1]
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridserve.models.arch.falcon_h1 import FalconH1LM
from hybridserve.models.config import ModelConfig
from hybridserve.models.loaders.checkpoint import Weights, fill_ends, take_attention, take_gate_up
from hybridserve.models.loaders.mamba_loader import fill_mixer, load_mamba_model
from hybridserve.models.parallel import PipelineStage, TPGroup


def load_falcon_h1_model(model_dir: Path, cfg: ModelConfig, device: str | torch.device, dtype: torch.dtype,
                         stage: PipelineStage | None = None, tp: TPGroup | None = None) -> FalconH1LM:
    model = load_mamba_model(model_dir, cfg, device, dtype, stage, tp, build=FalconH1LM, fill=_fill)
    assert isinstance(model, FalconH1LM)
    return model


def _in_proj_scale(cfg: ModelConfig) -> torch.Tensor:
    """One factor per in_proj row: [z (I) | x (I) | B (G*N) | C (G*N) | dt (H)]."""
    mc, sc = cfg.mamba, cfg.hybrid.falcon if cfg.hybrid else None
    assert mc is not None and sc is not None
    gn = mc.n_groups * mc.state_size
    sizes = (mc.intermediate_size, mc.intermediate_size, gn, gn, mc.num_heads)
    return torch.cat([torch.full((n,), f * sc.ssm_in) for n, f in zip(sizes, sc.ssm)])


def _fill(model: FalconH1LM, cfg: ModelConfig, w: Weights) -> None:
    """`cfg` global; `model` a stage of whole layer pairs, a rank's share of heads and columns."""
    sc = cfg.hybrid.falcon if cfg.hybrid else None
    assert sc is not None
    H, I = cfg.hidden_size, cfg.intermediate_size
    tp = model.tp or TPGroup()
    fill_ends(model, cfg, w, "model.embed_tokens.weight", "model.final_layernorm.weight")
    w.keep_layers("model.layers.", range(model.layer_ids.start // 2, model.layer_ids.stop // 2))
    local = model.cfg
    q_rows, k_rows = local.num_heads * cfg.head_dim, local.num_kv_heads * cfg.head_dim
    in_scale = _in_proj_scale(cfg)
    with torch.no_grad():
        for i, layer in zip(model.layer_ids, model.layers):
            p = f"model.layers.{i // 2}."
            if layer.attn is not None and layer.norm is not None:
                layer.norm.copy_(w.take(p + "input_layernorm.weight", (H,)))
                qkv, o = take_attention(w, cfg, tp, p + "self_attn.")
                qkv = qkv * sc.attention_in
                qkv[q_rows : q_rows + k_rows] *= sc.key
                layer.attn.qkv.copy_(qkv)
                layer.attn.o.copy_(o * sc.attention_out)
            if layer.mixer is not None:
                fill_mixer(layer.mixer, cfg, w, p + "mamba.", tp, in_scale=in_scale, out_scale=sc.ssm_out)
            if layer.gate_up is not None and layer.down is not None and layer.pre_ff_norm is not None:
                f = p + "feed_forward."
                layer.pre_ff_norm.copy_(w.take(p + "pre_ff_layernorm.weight", (H,)))
                gate_up = take_gate_up(w, tp, f, (I, H))
                gate_up[: local.intermediate_size] *= sc.mlp_gate
                layer.gate_up.copy_(gate_up)
                layer.down.copy_(tp.shard(w.take(f + "down_proj.weight", (H, I)) * sc.mlp_down, 1))
