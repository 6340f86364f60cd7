"""gpt-oss's HF checkpoint into GptOssLM (models/arch/gpt_oss.py): its stage's layers, its
rank's share; expert weights plain or MXFP4 (models/loaders/mxfp4.py)."""

from __future__ import annotations

import torch

from hybridserve.models.arch.gpt_oss import GptOssExperts, GptOssLM
from hybridserve.models.config import ModelConfig
from hybridserve.models.loaders.checkpoint import Weights, fill_ends, take_qkv, take_row_bias
from hybridserve.models.loaders.mxfp4 import dequantize_mxfp4
from hybridserve.models.parallel import TPGroup


def _expert_matrix(w: Weights, name: str, shape: tuple[int, int, int], dtype: torch.dtype) -> torch.Tensor:
    """Expert weights [E, in, out] as HF's experts read them: a plain tensor `name`, or its
    MXFP4 form (`name`_blocks [E, out, in / 32, 16], `name`_scales [E, out, in / 32]: rows
    are output features), dequantized one expert at a time to bound the load's peak."""
    if name in w.checkpoint.names():
        return w.take(name, shape)
    E, n_in, n_out = shape
    blocks = w.take(name + "_blocks", (E, n_out, n_in // 32, 16), dtype=torch.uint8)
    scales = w.take(name + "_scales", (E, n_out, n_in // 32), dtype=torch.uint8)
    out = torch.empty(shape, dtype=dtype)
    for e in range(E):
        out[e] = dequantize_mxfp4(blocks[e], scales[e], dtype).t()
    return out


def _split_gate_up(t: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """[..., 2I] with gate and up alternating (gate at even columns) -> this rank's
    [gate | up] columns."""
    gate, up = t[..., 0::2], t[..., 1::2]
    return torch.cat([tp.shard(gate, -1), tp.shard(up, -1)], dim=-1)


def fill_gpt_oss(model: GptOssLM, cfg: ModelConfig, w: Weights) -> None:
    """Copy HF GptOssForCausalLM tensors into `model` (its stage's layers, its rank's share;
    `cfg` the global config). Expert weights may be plain or MXFP4 (models/loaders/mxfp4.py)."""
    opts = cfg.gpt_oss
    assert opts is not None
    H, hd, I, E, nq = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, opts.num_experts, cfg.num_heads
    tp = model.tp or TPGroup()
    fill_ends(model, cfg, w, "model.embed_tokens.weight", "model.norm.weight")
    w.keep_layers("model.layers.", model.layer_ids)
    with torch.no_grad():
        for k, (i, layer) in enumerate(zip(model.layer_ids, model.layers)):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            layer.input_norm.copy_(w.take(p + "input_layernorm.weight", (H,)))
            layer.qkv.copy_(take_qkv(w, cfg, tp, a))
            if layer.qkv_bias is not None:
                layer.qkv_bias.copy_(take_qkv(w, cfg, tp, a, "bias"))
            layer.o.copy_(tp.shard(w.take(a + "o_proj.weight", (H, nq * hd)), 1))
            if cfg.o_bias:
                take_row_bias(w, layer.o_bias, a + "o_proj.bias", H)
            model.sinks[k].copy_(tp.shard(w.take(a + "sinks", (nq,))))
            layer.post_attn_norm.copy_(w.take(p + "post_attention_layernorm.weight", (H,)))
            m = p + "mlp."
            ex = model.experts[str(i)]
            assert isinstance(ex, GptOssExperts)
            ex.router.copy_(w.take(m + "router.weight", (E, H)))
            ex.router_bias.copy_(w.take(m + "router.bias", (E,)))
            ex.gate_up.copy_(_split_gate_up(_expert_matrix(w, m + "experts.gate_up_proj", (E, H, 2 * I), w.dtype), tp))
            ex.gate_up_bias.copy_(_split_gate_up(w.take(m + "experts.gate_up_proj_bias", (E, 2 * I)), tp))
            ex.down.copy_(tp.shard(_expert_matrix(w, m + "experts.down_proj", (E, I, H), w.dtype), 1))
            down_bias = w.take(m + "experts.down_proj_bias", (E, H))
            if ex.down_bias is not None:  # rank 0 adds it for all (see the module docstring)
                ex.down_bias.copy_(down_bias)
            w.release_taken()
