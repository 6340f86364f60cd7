"""Load an HF Qwen3NextForCausalLM (or Qwen3_5ForCausalLM) directory into a Qwen3NextLM.

HF names (layer i, under model.layers.i.)::

    input_layernorm, post_attention_layernorm                     (1 + w) norms: stored as 1 + w
    linear_attn.in_proj_qkvz  rows per key head: [q dk | k dk | v rep*dv | z rep*dv]  (rep = Hv/Hk)
    linear_attn.in_proj_ba    rows per key head: [b rep | a rep]
                              (Qwen3.5: in_proj_qkv [q | k | v], in_proj_z, in_proj_b, in_proj_a)
    linear_attn.conv1d.weight [conv_dim, 1, K] over [q | k | v], dt_bias, A_log, norm, out_proj
    self_attn.q_proj          rows per head: [query hd | gate hd];  k_proj, v_proj, q_norm, k_norm, o_proj
    mlp.gate, mlp.experts.e.{gate,up,down}_proj (or stacked: mlp.experts.gate_up_proj [E, 2I, H],
                              gate rows first, and mlp.experts.down_proj [E, H, I]),
                              mlp.shared_expert.{gate,up,down}_proj,
    mlp.shared_expert_gate    (or mlp.{gate,up,down}_proj in mlp_only_layers and in Qwen3.5)

As in loader.py, every tensor must be present with its shape and none may be left over
(the multi-token-prediction `mtp.*` weights, which HF ignores too, are dropped); a pipeline
stage reads its layers only, a tensor-parallel rank cuts each to its share.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridserve.models.arch.qwen3_next import GatedAttentionWeights, MoEWeights, Qwen3NextLM
from hybridserve.models.arch.gated_deltanet import GatedDeltaNetWeights
from hybridserve.models.config import ModelConfig
from hybridserve.models.loaders.checkpoint import Weights, fill_ends, load_staged, take_gate_up
from hybridserve.models.parallel import PipelineStage, TPGroup, group_rows


def load_qwen3_next_model(model_dir: Path, cfg: ModelConfig, device: str | torch.device, dtype: torch.dtype,
                          stage: PipelineStage | None = None, tp: TPGroup | None = None) -> Qwen3NextLM:
    return load_staged(Qwen3NextLM(cfg, dtype, stage, tp), model_dir, cfg, device, dtype, _fill)


def _one_plus(t: torch.Tensor) -> torch.Tensor:
    return 1.0 + t


def _fill_mixer(m: GatedDeltaNetWeights, cfg: ModelConfig, w: Weights, prefix: str, tp: TPGroup) -> None:
    """`cfg` global: each tensor checked at its full shape, then cut to this rank's key heads."""
    mc = cfg.gated_deltanet
    assert mc is not None
    Hk, Hv, dk, dv, H = mc.num_k_heads, mc.num_v_heads, mc.head_k_dim, mc.head_v_dim, cfg.hidden_size
    if cfg.family == "qwen3_5":  # separate projections, heads in order: cut each by heads
        q, k, v = w.take(prefix + "in_proj_qkv.weight", (mc.conv_dim, H)).split([mc.key_dim, mc.key_dim, mc.value_dim])
        parts = [q, k, v, w.take(prefix + "in_proj_z.weight", (mc.value_dim, H)),
                 w.take(prefix + "in_proj_b.weight", (Hv, H)), w.take(prefix + "in_proj_a.weight", (Hv, H))]
        m.in_proj.copy_(torch.cat([tp.shard(t) for t in parts]))
    else:  # rows grouped per key head: a rank takes whole groups, then splits them
        rep = Hv // Hk
        qkvz = tp.shard(w.take(prefix + "in_proj_qkvz.weight", (2 * mc.key_dim + 2 * mc.value_dim, H))
                        .view(Hk, 2 * dk + 2 * rep * dv, H))
        ba = tp.shard(w.take(prefix + "in_proj_ba.weight", (2 * Hv, H)).view(Hk, 2 * rep, H))
        parts = [*qkvz.split([dk, dk, rep * dv, rep * dv], dim=1), *ba.split([rep, rep], dim=1)]
        m.in_proj.copy_(torch.cat([t.reshape(-1, H) for t in parts]))
    conv = w.take(prefix + "conv1d.weight", (mc.conv_dim, 1, mc.conv_kernel))[:, 0]
    cq, ck, cv = conv.split([mc.key_dim, mc.key_dim, mc.value_dim])
    m.conv_w.copy_(torch.cat([tp.shard(cq), tp.shard(ck), tp.shard(cv)]))
    m.dt_bias.copy_(tp.shard(w.take(prefix + "dt_bias", (Hv,))))
    m.A.copy_(-torch.exp(tp.shard(w.take(prefix + "A_log", (Hv,))).float()))
    m.norm.copy_(w.take(prefix + "norm.weight", (dv,)))
    m.out_proj.copy_(tp.shard(w.take(prefix + "out_proj.weight", (H, mc.value_dim)), 1))


def _fill_attention(a: GatedAttentionWeights, cfg: ModelConfig, w: Weights, prefix: str, tp: TPGroup) -> None:
    nq, nkv, hd, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    query_gate = w.take(prefix + "q_proj.weight", (nq * 2 * hd, H)).view(nq, 2, hd, H)
    a.qkv.copy_(torch.cat([tp.shard(query_gate[:, 0].reshape(nq * hd, H)),
                           group_rows(tp, nkv, w.take(prefix + "k_proj.weight", (nkv * hd, H))),
                           group_rows(tp, nkv, w.take(prefix + "v_proj.weight", (nkv * hd, H)))]))
    a.gate.copy_(tp.shard(query_gate[:, 1].reshape(nq * hd, H)))
    q_norm = _one_plus(w.take(prefix + "q_norm.weight", (hd,)))
    k_norm = _one_plus(w.take(prefix + "k_norm.weight", (hd,)))
    nq_local = a.gate.shape[0] // hd
    a.qk_norm.copy_(torch.cat([q_norm.expand(nq_local, hd), k_norm.expand(a.qk_norm.shape[0] - nq_local, hd)]))
    a.o.copy_(tp.shard(w.take(prefix + "o_proj.weight", (H, nq * hd)), 1))


def _fill_moe(m: MoEWeights, cfg: ModelConfig, w: Weights, prefix: str, tp: TPGroup) -> None:
    moe = cfg.qwen3_next_moe
    assert moe is not None
    H, I, Is = cfg.hidden_size, moe.moe_intermediate_size, moe.shared_intermediate_size
    E = moe.num_experts
    m.router.copy_(w.take(prefix + "gate.weight", (E, H)))
    stacked = prefix + "experts.gate_up_proj"
    if stacked in w.checkpoint.names():  # transformers' own layout (a converted GGUF's too)
        gate_up = w.take(stacked, (E, 2 * I, H))
        down = w.take(prefix + "experts.down_proj", (E, H, I))
        for e in range(E):
            m.gate_up[e].copy_(torch.cat([tp.shard(gate_up[e, :I]), tp.shard(gate_up[e, I:])]))
            m.down[e].copy_(tp.shard(down[e], 1))
    else:
        for e in range(E):
            ex = f"{prefix}experts.{e}."
            m.gate_up[e].copy_(take_gate_up(w, tp, ex, (I, H)))
            m.down[e].copy_(tp.shard(w.take(ex + "down_proj.weight", (H, I)), 1))
    m.shared_gate_up.copy_(take_gate_up(w, tp, prefix + "shared_expert.", (Is, H)))
    m.shared_down.copy_(tp.shard(w.take(prefix + "shared_expert.down_proj.weight", (H, Is)), 1))
    m.shared_gate.copy_(w.take(prefix + "shared_expert_gate.weight", (1, H)))


def _fill(model: Qwen3NextLM, cfg: ModelConfig, w: Weights) -> None:
    """HF tensors into `model` (its stage's layers, its rank's share); `cfg` the global config."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    tp = model.tp or TPGroup()
    for name in w.leftovers():
        if name.startswith("mtp."):
            w.discard(name)
    fill_ends(model, cfg, w, "model.embed_tokens.weight", "model.norm.weight", norm=_one_plus)
    w.keep_layers("model.layers.", model.layer_ids)
    with torch.no_grad():
        for i, layer in zip(model.layer_ids, model.layers):
            p = f"model.layers.{i}."
            layer.norm.copy_(_one_plus(w.take(p + "input_layernorm.weight", (H,))))
            layer.post_norm.copy_(_one_plus(w.take(p + "post_attention_layernorm.weight", (H,))))
            if layer.mixer is not None:
                _fill_mixer(layer.mixer, cfg, w, p + "linear_attn.", tp)
            if layer.attn is not None:
                _fill_attention(layer.attn, cfg, w, p + "self_attn.", tp)
            if layer.moe is not None:
                _fill_moe(layer.moe, cfg, w, p + "mlp.", tp)
            if layer.gate_up is not None and layer.down is not None:
                layer.gate_up.copy_(take_gate_up(w, tp, p + "mlp.", (I, H)))
                layer.down.copy_(tp.shard(w.take(p + "mlp.down_proj.weight", (H, I)), 1))
