"""GGUF spec of `granitehybrid`: llama.cpp files Granite 4.0-H (HF GraniteMoeHybridForCausalLM)
and Bamba (HF BambaForCausalLM) under this one architecture. Their mixers are gguf_mamba2.py's.

Facts from llama.cpp's converter and runtime:
- Which layer is which: `attention.head_count_kv` is one count per layer, 0 off the attention
  layers (llama.cpp's rule for a Mamba2 layer).
- Which model: `rope.scaling.finetuned` is llama.cpp's switch for RoPE (absent: on). The
  converter turns it off for every Granite 4.0-H and on for Bamba, whose attention rotates
  `rope.dimension_count` = half of each head. A file rotating part of each head is read as
  Bamba (HF's Bamba rotates exactly half); otherwise as Granite 4.0-H, with RoPE over whole
  heads where the switch is on.
- Granite 4.0-H: its multipliers are `embedding_scale`, `residual_scale`, `attention.scale`
  and `logit_scale` (the logits are divided by it); absent, llama.cpp scales the attention
  by 1/sqrt(head_dim) and leaves the rest unscaled. Experts: `ffn_gate_exps` and
  `ffn_up_exps` [E, I, H] are the halves of HF's `block_sparse_moe.input_linear` [E, 2I, H]
  (gate first), `ffn_down_exps` its output_linear; the shared MLP is `ffn_{gate,up,down}_shexp`
  (`expert_shared_feed_forward_length` wide), or `ffn_{gate,up,down}` in a model without
  experts, whose shared MLP is its only one; `ffn_norm` is the norm before them.
- Bamba: its SwiGLU MLP is `ffn_{gate,up,down}` (HF's feed_forward.*), `ffn_norm` its
  pre_ff_layernorm, `output_norm` its final_layernorm.
- Both go through llama.cpp's Llama converter, which interleaves Q/K rows per head (over the
  whole head) even where no RoPE is applied; they are restored.
- Head dim is hidden / heads (HF's rule for both; the converter drops any other).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridserve.core.errors import ConfigError
from hybridserve.models.loaders.gguf_header import GGUFHeader
from hybridserve.models.loaders.gguf_layer_arrays import block_stems, largest_per_layer, per_layer
from hybridserve.models.loaders.gguf_mamba2 import (Mamba2Sizes, mamba2_block_names, mamba2_expand, mamba2_merges,
                                                    mamba2_sizes)
from hybridserve.models.loaders.gguf_renamed import RenamedArchSpec
from hybridserve.models.loaders.gguf_spec import ArchSpec, BlockMerge, PlannedTensor, common_config, float32_value, \
    required

ATTENTION_NAMES = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj"}


def _head_dim(header: GGUFHeader, config: dict[str, Any]) -> int:
    heads = config["num_attention_heads"]
    head_dim = config["hidden_size"] // heads if heads else 0
    if header.arch_value("attention.key_length") not in (None, head_dim):
        raise ConfigError(f"{header.path}: attention.key_length {header.arch_value('attention.key_length')} is not "
                          f"hidden / heads = {head_dim}, which {header.architecture} models require")
    return head_dim


def _rotated_dims(header: GGUFHeader, head_dim: int) -> int:
    """How many dims of each head RoPE turns: 0 with the switch off."""
    if not header.arch_value("rope.scaling.finetuned", True):
        return 0
    return int(header.arch_value("rope.dimension_count", head_dim))


def is_bamba(header: GGUFHeader) -> bool:
    """Whether a granitehybrid file is Bamba's: RoPE on part of each head (see the module docstring)."""
    config = common_config(largest_per_layer(header))
    head_dim = _head_dim(header, config)
    return 0 < _rotated_dims(header, head_dim) < head_dim


def _mixer_fields(header: GGUFHeader, s: Mamba2Sizes, hidden: int) -> dict[str, Any]:
    """The `mamba_*` fields Bamba's and Granite 4.0-H's configs share."""
    return dict(mamba_n_heads=s.num_heads, mamba_d_head=s.head_dim, mamba_d_state=s.state_size,
                mamba_n_groups=s.n_groups, mamba_d_conv=s.conv_kernel, mamba_expand=mamba2_expand(header, s, hidden),
                mamba_conv_bias=s.conv_bias, mamba_proj_bias=s.proj_bias, hidden_act="silu",
                rope_theta=float(header.arch_value("rope.freq_base", 10_000.0)))


def _bamba_config(header: GGUFHeader) -> dict[str, Any]:
    config = common_config(largest_per_layer(header))
    head_dim = _head_dim(header, config)
    rotated = _rotated_dims(header, head_dim)
    if rotated != head_dim // 2:
        raise ConfigError(f"{header.path}: RoPE over {rotated} of {head_dim} head dims; Bamba rotates half of each "
                          f"head and Granite 4.0-H all of it")
    stems = block_stems(header)
    config.update(
        architectures=["BambaForCausalLM"], model_type="bamba", attn_rotary_emb=rotated,
        attn_layer_indices=[i for i, kv in enumerate(per_layer(header, "attention.head_count_kv")) if kv],
        attention_bias="attn_q.bias" in stems, mlp_bias="ffn_up.bias" in stems,
        **_mixer_fields(header, mamba2_sizes(header), config["hidden_size"]),
    )
    return config


def _granite_hybrid_config(header: GGUFHeader) -> dict[str, Any]:
    if is_bamba(header):
        return _bamba_config(header)
    config = common_config(largest_per_layer(header))
    head_dim = _head_dim(header, config)
    experts = int(header.arch_value("expert_count", 0))
    shared_rows = next((info.shape[0] for info in header.tensors
                        if info.name.endswith(("ffn_up_shexp.weight", ".ffn_up.weight"))), None)
    shared = header.arch_value("expert_shared_feed_forward_length") or shared_rows
    if not shared:
        raise ConfigError(f"{header.path} has no shared MLP (ffn_up_shexp or ffn_up) and no "
                          f"{header.architecture}.expert_shared_feed_forward_length")
    config.update(
        architectures=["GraniteMoeHybridForCausalLM"], model_type="granitemoehybrid",
        layer_types=["attention" if kv else "mamba" for kv in per_layer(header, "attention.head_count_kv")],
        shared_intermediate_size=int(shared), num_local_experts=experts,
        num_experts_per_tok=int(required(header, "expert_used_count")) if experts else 0,
        position_embedding_type="rope" if _rotated_dims(header, head_dim) else "nope",
        embedding_multiplier=float32_value(header.arch_value("embedding_scale", 1.0)),
        residual_multiplier=float32_value(header.arch_value("residual_scale", 1.0)),
        attention_multiplier=float32_value(header.arch_value("attention.scale", head_dim**-0.5 if head_dim else 1.0)),
        logits_scaling=float32_value(header.arch_value("logit_scale", 1.0)),
        attention_bias="attn_q.bias" in block_stems(header),
        **_mixer_fields(header, mamba2_sizes(header), config["hidden_size"]),
    )
    return config


def _concat_rows(axis: int) -> dict[str, Any]:
    """[gate; up] stacked along `axis`: HF's fused input_linear from llama.cpp's halves."""
    def shape(gate: tuple[int, ...], up: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(g + u if i == axis else g for i, (g, u) in enumerate(zip(gate, up)))

    return dict(shape=shape, build=lambda gate, up: np.concatenate((gate, up), axis=axis))


_ATTENTION = {stem: f"self_attn.{hf}" for stem, hf in ATTENTION_NAMES.items()}
BAMBA_SPEC = RenamedArchSpec(
    gguf_arch="granitehybrid", family="bamba",
    block_names={"attn_norm": "input_layernorm", "ffn_norm": "pre_ff_layernorm", **_ATTENTION,
                 "ffn_gate": "feed_forward.gate_proj", "ffn_up": "feed_forward.up_proj",
                 "ffn_down": "feed_forward.down_proj", **mamba2_block_names("mamba")},
    norm_modules=frozenset(), norm_weight_offset=0.0, unpermute_qk=True, build_config=_bamba_config,
    block_merges=mamba2_merges("mamba"), renames=(("model.norm.", "model.final_layernorm."),),
)


@dataclass(frozen=True)
class GraniteHybridSpec(ArchSpec):
    """Granite 4.0-H's names, or `bamba`'s for a Bamba file (is_bamba). Both restore Q/K rows
    under self_attn. alone and fold nothing into norms, so fix_tensor is the same for both."""

    bamba: ArchSpec = BAMBA_SPEC

    @property
    def families(self) -> tuple[str, ...]:
        return self.family, self.bamba.family

    def plan(self, header: GGUFHeader) -> list[PlannedTensor]:
        return self.bamba.plan(header) if is_bamba(header) else super().plan(header)


GRANITE_HYBRID_SPEC = GraniteHybridSpec(
    gguf_arch="granitehybrid", family="granite_hybrid",
    block_names={
        "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", **_ATTENTION,
        "ffn_gate_inp": "block_sparse_moe.router.layer", "ffn_down_exps": "block_sparse_moe.output_linear",
        "ffn_down_shexp": "shared_mlp.output_linear", "ffn_down": "shared_mlp.output_linear",
        **mamba2_block_names("mamba"),
    },
    norm_modules=frozenset(), norm_weight_offset=0.0, unpermute_qk=True, build_config=_granite_hybrid_config,
    block_merges=(
        *mamba2_merges("mamba"),
        BlockMerge("block_sparse_moe.input_linear.weight", ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
                   **_concat_rows(axis=1)),
        BlockMerge("shared_mlp.input_linear.weight", ("ffn_gate_shexp.weight", "ffn_up_shexp.weight"),
                   **_concat_rows(axis=0)),
        BlockMerge("shared_mlp.input_linear.weight", ("ffn_gate.weight", "ffn_up.weight"), **_concat_rows(axis=0)),
    ),
)
