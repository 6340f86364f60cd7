"""Llama 4's HF checkpoint into Llama4LM (models/arch/llama4.py): its stage's layers, its
rank's share, q/k rows of the RoPE layers reordered to the half split RoPE here expects."""

from __future__ import annotations

import torch

from hybridserve.models.arch.llama4 import Llama4Experts, Llama4LM
from hybridserve.models.config import ModelConfig
from hybridserve.models.loaders.checkpoint import Weights, fill_ends, take_gate_up, take_qkv, take_row_bias
from hybridserve.models.parallel import TPGroup


def interleaved_to_half_split(w: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Rows of a q/k projection (weight [heads*hd, in] or bias [heads*hd]) reordered per head
    from Llama 4's interleaved RoPE pairs (2i, 2i+1) to the half split (i, i + hd/2)."""
    perm = torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))
    return w.reshape(num_heads, head_dim, *w.shape[1:])[:, perm].reshape(w.shape)


def fill_llama4(model: Llama4LM, cfg: ModelConfig, w: Weights) -> None:
    """Copy HF Llama4ForCausalLM tensors into `model` (its stage's layers, its rank's share;
    `cfg` the global config, shapes checked by `w.take`)."""
    opts = cfg.llama4
    assert opts is not None
    H, hd, I, E = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, opts.num_experts
    nq = cfg.num_heads
    tp = model.tp or TPGroup()
    fill_ends(model, cfg, w, "model.embed_tokens.weight", "model.norm.weight")
    w.keep_layers("model.layers.", model.layer_ids)
    with torch.no_grad():
        for i, layer in zip(model.layer_ids, model.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            rope = opts.rope_layers[i]

            def qk(t: torch.Tensor, heads: int, rope: bool = rope) -> torch.Tensor:
                return interleaved_to_half_split(t, heads, hd) if rope else t

            layer.input_norm.copy_(w.take(p + "input_layernorm.weight", (H,)))
            layer.qkv.copy_(take_qkv(w, cfg, tp, a, qk=qk))
            if layer.qkv_bias is not None:
                layer.qkv_bias.copy_(take_qkv(w, cfg, tp, a, "bias", qk=qk))
            layer.o.copy_(tp.shard(w.take(a + "o_proj.weight", (H, nq * hd)), 1))
            if cfg.o_bias:
                take_row_bias(w, layer.o_bias, a + "o_proj.bias", H)
            layer.post_attn_norm.copy_(w.take(p + "post_attention_layernorm.weight", (H,)))
            f = p + "feed_forward."
            if opts.moe_layers[i]:
                ex = model.experts[str(i)]
                assert isinstance(ex, Llama4Experts)
                ex.router.copy_(w.take(f + "router.weight", (E, H)))
                # [E, H, gate | up]: this rank's columns of each half.
                gate, up = w.take(f + "experts.gate_up_proj", (E, H, 2 * I)).chunk(2, dim=2)
                ex.gate_up.copy_(torch.cat([tp.shard(gate, 2), tp.shard(up, 2)], dim=2))
                ex.down.copy_(tp.shard(w.take(f + "experts.down_proj", (E, I, H)), 1))
                f += "shared_expert."
                size = I
            else:
                size = opts.intermediate_size_mlp
            layer.gate_up.copy_(take_gate_up(w, tp, f, (size, H)))
            layer.down.copy_(tp.shard(w.take(f + "down_proj.weight", (H, size)), 1))
