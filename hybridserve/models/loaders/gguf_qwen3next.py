"""GGUF spec of Qwen3-Next (`qwen3next`), as llama.cpp's converter writes it.

Hk key heads of dk, Hv value heads of dv (rep = Hv / Hk value heads per key head), E experts
of I columns, hidden H; shapes in numpy order. What the converter changes, undone here:
- every (1 + w) RMSNorm but the mixer's gated one (input / post-attention / q / k / final)
  is stored as 1 + w, so HF's weight is `gguf - 1` (`ssm_norm` is stored as it is);
- the mixer's `A_log` is stored as `ssm_a` = -exp(A_log) (no `.weight` suffix), `dt_bias`
  as `ssm_dt.bias`, the depthwise `conv1d` weight [C, 1, K] squeezed to [C, K];
- HF's `in_proj_qkvz` holds, per key head, [q dk | k dk | v rep*dv | z rep*dv]; current
  converters split it into `attn_qkv` (all q, then all k, then all v, each in key-head order)
  and `attn_gate` (z), older ones wrote it unchanged as `ssm_in`; both are read.
  `in_proj_ba` is `ssm_ba`, unchanged;
- the experts are stacked: `ffn_{gate,up}_exps` [E, I, H] (or fused `ffn_gate_up_exps`
  [E, 2I, H], gate rows first) and `ffn_down_exps` [E, H, I]; they become HF's own stacked
  `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]. The shared
  expert's gate `ffn_gate_inp_shexp` may be stored as [H] (HF: [1, H]).

Config: the mixer's sizes are the `ssm.*` keys (group_count = Hk, time_step_rank = Hv,
state_size = dk, inner_size = Hv * dv, conv_kernel = K); which layers are linear comes from
`attention.recurrent_layers` (one flag per layer), else `full_attention_interval`; the RoPE
share of a head from `rope.dimension_count`. A layer without a router (`ffn_gate_inp`) has a
dense MLP (HF's `mlp_only_layers`). As llama.cpp's runtime does: the top-k expert weights
are renormalised, the expert width defaults to feed_forward_length / experts used and the
shared expert's to feed_forward_length.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from hybridserve.core.errors import ConfigError
from hybridserve.models.arch.qwen3_next_config import LINEAR
from hybridserve.models.loaders.gguf_header import GGUFHeader
from hybridserve.models.loaders.gguf_spec import (COMMON_BLOCK_NAMES, ArchSpec, BlockMerge, PlannedTensor,
                                                  a_log_from_a, common_config, renamed, required, reshaped,
                                                  tensor_rows, unsqueezed_conv)

FULL_ATTENTION_INTERVAL = 4  # llama.cpp's default for a file with neither layer key
NORM_WEIGHT_OFFSET = 1.0  # GGUF weight = HF weight + 1 for the (1 + w) norms


@dataclass(frozen=True)
class MixerHeads:
    """The Gated DeltaNet head layout the `ssm.*` keys describe."""

    k_heads: int  # Hk
    v_heads: int  # Hv, a multiple of Hk
    k_dim: int  # dk
    v_dim: int  # dv

    @classmethod
    def of(cls, header: GGUFHeader) -> MixerHeads:
        k_heads, v_heads = int(required(header, "ssm.group_count")), int(required(header, "ssm.time_step_rank"))
        inner = int(required(header, "ssm.inner_size"))
        if k_heads < 1 or v_heads % k_heads or inner % v_heads:
            raise ConfigError(f"{header.path}: ssm.time_step_rank {v_heads} value heads do not split into "
                              f"ssm.group_count {k_heads} key heads and ssm.inner_size {inner}")
        return cls(k_heads, v_heads, int(required(header, "ssm.state_size")), inner // v_heads)

    def qkvz(self, qkv: np.ndarray, z: np.ndarray) -> np.ndarray:
        """`attn_qkv` and `attn_gate` rows back into HF's per-key-head [q | k | v | z] groups."""
        hidden, key_rows = qkv.shape[1], self.k_heads * self.k_dim
        q, k, v = np.split(qkv, [key_rows, 2 * key_rows])
        groups = [part.reshape(self.k_heads, -1, hidden) for part in (q, k, v, z)]
        return np.concatenate(groups, axis=1).reshape(-1, hidden)


def _layer_types(header: GGUFHeader, layers: int) -> list[str]:
    flags = header.arch_value("attention.recurrent_layers")
    if flags is not None:
        if len(flags) != layers:
            raise ConfigError(f"{header.path}: attention.recurrent_layers has {len(flags)} flags for {layers} layers")
        recurrent = [bool(flag) for flag in flags]
    else:
        interval = int(header.arch_value("full_attention_interval", FULL_ATTENTION_INTERVAL))
        if interval < 1:
            raise ConfigError(f"{header.path}: full_attention_interval {interval} is not positive")
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    return [LINEAR if linear else "full_attention" for linear in recurrent]


def _qwen3next_config(header: GGUFHeader) -> dict[str, Any]:
    config = common_config(header)
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    head_dim = int(header.arch_value("attention.key_length") or hidden // config["num_attention_heads"])
    rotary = int(header.arch_value("rope.dimension_count", head_dim))
    heads = MixerHeads.of(header)
    used = int(required(header, "expert_used_count"))
    rope = {"rope_type": "default", "rope_theta": float(header.arch_value("rope.freq_base", 10_000.0)),
            **(config.pop("rope_scaling", None) or {}), "partial_rotary_factor": rotary / head_dim}
    config.update(
        architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", head_dim=head_dim, hidden_act="silu",
        rope_parameters=rope, layer_types=_layer_types(header, layers),
        linear_num_key_heads=heads.k_heads, linear_num_value_heads=heads.v_heads,
        linear_key_head_dim=heads.k_dim, linear_value_head_dim=heads.v_dim,
        linear_conv_kernel_dim=int(required(header, "ssm.conv_kernel")),
        num_experts=int(required(header, "expert_count")), num_experts_per_tok=used,
        moe_intermediate_size=int(header.arch_value("expert_feed_forward_length")
                                  or config["intermediate_size"] // used),
        shared_expert_intermediate_size=int(header.arch_value("expert_shared_feed_forward_length")
                                            or config["intermediate_size"]),
        norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(layers) if tensor_rows(header, f"blk.{i}.ffn_gate_inp.weight") is None],
    )
    return config


# Tensors renamed or reshaped whatever the file's head counts (see the module docstring).
_FIXED_MERGES = (
    unsqueezed_conv("linear_attn.conv1d.weight", "ssm_conv1d.weight"),
    reshaped("linear_attn.A_log", "ssm_a", hf_shape=lambda s: s, values=a_log_from_a),
    renamed("linear_attn.dt_bias", "ssm_dt.bias"),
    BlockMerge("mlp.shared_expert_gate.weight", ("ffn_gate_inp_shexp.weight",),
               shape=lambda s: (1, s[-1]), build=lambda w: w.reshape(1, -1)),
    BlockMerge("mlp.experts.gate_up_proj", ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
               shape=lambda g, u: (g[0], g[1] + u[1], g[2]), build=lambda g, u: np.concatenate((g, u), axis=1)),
    renamed("mlp.experts.gate_up_proj", "ffn_gate_up_exps.weight"),
    renamed("mlp.experts.down_proj", "ffn_down_exps.weight"),
)


class _Qwen3NextSpec(ArchSpec):
    """Qwen3-Next's spec: the split q/k/v/z rows are put back per key head, which needs the
    file's head counts, so that merge is made per file."""

    def plan(self, header: GGUFHeader) -> list[PlannedTensor]:
        heads = MixerHeads.of(header)
        qkvz = BlockMerge("linear_attn.in_proj_qkvz.weight", ("attn_qkv.weight", "attn_gate.weight"),
                          shape=lambda qkv, z: (qkv[0] + z[0], qkv[1]), build=heads.qkvz)
        return ArchSpec.plan(replace(self, block_merges=(qkvz, *self.block_merges)), header)


QWEN3NEXT_SPEC = _Qwen3NextSpec(
    gguf_arch="qwen3next", family="qwen3_next",
    block_names={
        **COMMON_BLOCK_NAMES,  # attention, the dense layers' MLP, attn_norm (input_layernorm)
        "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "ssm_in": "linear_attn.in_proj_qkvz", "ssm_ba": "linear_attn.in_proj_ba",
        "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj",
        "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    },
    norm_modules=frozenset({"input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "model.norm"}),
    norm_weight_offset=NORM_WEIGHT_OFFSET, unpermute_qk=False, build_config=_qwen3next_config,
    block_merges=_FIXED_MERGES,
)
