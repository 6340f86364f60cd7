"""GGUF files written from tiny HF Falcon-H1 and Jamba checkpoints the way llama.cpp's converter
(convert_hf_to_gguf.py: FalconH1Model over Mamba2Model, JambaModel) writes them. The facts are
stated here from that converter and gguf-py, never taken from hybridserve's reader:

- names: the checkpoint's names through gguf-py's TensorNameMap with the suffixes `.weight`
  and `.bias` tried, as the converter maps them. So `mamba.A_log` and `mamba.D` land under the
  bare names `blk.N.ssm_a` / `ssm_d`, and Falcon-H1's `pre_ff_layernorm.weight`, which the
  map knows with its suffix, under the bare `blk.N.ffn_norm`. Mamba2's `dt_bias` is renamed
  `dt_proj.bias` first (`blk.N.ssm_dt.bias`).
- values: A_log stored as A = -exp(A_log); conv1d weights squeezed [C, 1, K] -> [C, K];
  Mamba2's A and D given a trailing unit axis and its gated norm reshaped [G, I / G].
  Falcon-H1: every multiplier folded into a weight (embedding, lm_head, q / k / v / o, the five
  in_proj row segments times ssm_in, out_proj, MLP gate and down), none written as metadata.
  Jamba: each expert layer's per-expert matrices stacked into [E, out, in] tensors.
- metadata: Falcon-H1 the ssm.* keys (time_step_rank = mixer width / mamba_d_head), attention
  and MLP sizes, RoPE base; Jamba one KV head count per layer (0 on mixer layers), ssm.* keys,
  expert counts.

A tiny byte-level vocabulary (tests/helpers/gguf_from_hf.py's) lets the tokenizer be built.
Checkpoints are read from the saved folder, as the converter reads them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tests.helpers.gguf_from_hf import _byte_vocabulary

GGUF_ARCH = {"falcon_h1": "falcon-h1", "jamba": "jamba"}


@dataclass
class GGUFContent:
    """What a file will hold: `metadata` maps a name to (a GGUFWriter method, its arguments...),
    so a test can drop or add one; `tensors` maps GGUF names to float32 arrays."""

    arch: str
    metadata: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)


def read_checkpoint(folder: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    from safetensors.numpy import load_file

    return json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))


def _gguf_name(arch: str, hf_name: str, num_layers: int) -> str:
    import gguf

    arch_enum = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    name = gguf.get_tensor_name_map(arch_enum, num_layers).get_name(hf_name, try_suffixes=(".weight", ".bias"))
    assert name is not None, hf_name
    return name


def _common_metadata(cfg: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    vocab = cfg["vocab_size"]
    return {
        "block_count": ("add_block_count", cfg["num_hidden_layers"]),
        "context_length": ("add_context_length", cfg["max_position_embeddings"]),
        "embedding_length": ("add_embedding_length", cfg["hidden_size"]),
        "feed_forward_length": ("add_feed_forward_length", cfg["intermediate_size"]),
        "head_count": ("add_head_count", cfg["num_attention_heads"]),
        "layer_norm_rms_epsilon": ("add_layer_norm_rms_eps", cfg["rms_norm_eps"]),
        "tokenizer_model": ("add_tokenizer_model", "gpt2"), "tokenizer_pre": ("add_tokenizer_pre", "default"),
        "tokens": ("add_token_list", _byte_vocabulary(vocab)), "token_types": ("add_token_types", [1] * vocab),
        "token_scores": ("add_token_scores", [0.0] * vocab), "bos": ("add_bos_token_id", cfg["bos_token_id"]),
    }


def falcon_h1_content(cfg: dict[str, Any], state: dict[str, np.ndarray]) -> GGUFContent:
    arch, layers = GGUF_ARCH["falcon_h1"], cfg["num_hidden_layers"]
    width, groups, state_size = cfg["mamba_d_ssm"], cfg["mamba_n_groups"], cfg["mamba_d_state"]
    content = GGUFContent(arch, metadata={
        **_common_metadata(cfg),
        "head_count_kv": ("add_head_count_kv", cfg["num_key_value_heads"]),
        "key_length": ("add_key_length", cfg["head_dim"]), "value_length": ("add_value_length", cfg["head_dim"]),
        "ssm_conv_kernel": ("add_ssm_conv_kernel", cfg["mamba_d_conv"]),
        "ssm_inner_size": ("add_ssm_inner_size", width), "ssm_state_size": ("add_ssm_state_size", state_size),
        "ssm_time_step_rank": ("add_ssm_time_step_rank", width // cfg["mamba_d_head"]),
        "ssm_group_count": ("add_ssm_group_count", groups),
        "rope_freq_base": ("add_rope_freq_base", cfg["rope_parameters"]["rope_theta"]),
        "vocab_size": ("add_vocab_size", cfg["vocab_size"]),
    })
    attn_in, (gate_mult, down_mult) = cfg["attention_in_multiplier"], cfg["mlp_multipliers"]
    scale = {"embed_tokens": cfg["embedding_multiplier"], "lm_head": cfg["lm_head_multiplier"],
             "q_proj": attn_in, "k_proj": attn_in * cfg["key_multiplier"], "v_proj": attn_in,
             "o_proj": cfg["attention_out_multiplier"], "out_proj": cfg["ssm_out_multiplier"],
             "gate_proj": gate_mult, "down_proj": down_mult}
    segments = np.cumsum([width, width, groups * state_size, groups * state_size])
    for hf_name, values in state.items():
        module = hf_name.removesuffix(".weight").rpartition(".")[2]
        values = values * np.float32(scale.get(module, 1.0))
        if module == "in_proj":
            rows = np.split(values, segments)
            values = np.concatenate([r * np.float32(m * cfg["ssm_in_multiplier"])
                                     for r, m in zip(rows, cfg["ssm_multipliers"])])
        elif hf_name.endswith("mamba.norm.weight"):
            values = values.reshape(groups, width // groups)
        elif hf_name.endswith(("A_log", ".D")):
            values = (-np.exp(values) if hf_name.endswith("A_log") else values).reshape(-1, 1)
        elif hf_name.endswith("conv1d.weight"):
            values = values.squeeze()
        content.tensors[_gguf_name(arch, hf_name.replace(".dt_bias", ".dt_proj.bias"), layers)] = values
    return content


def jamba_content(cfg: dict[str, Any], state: dict[str, np.ndarray]) -> GGUFContent:
    arch, layers = GGUF_ARCH["jamba"], cfg["num_hidden_layers"]
    period, offset = cfg["attn_layer_period"], cfg["attn_layer_offset"]
    kv_per_layer = [cfg["num_key_value_heads"] if i >= offset and (i - offset) % period == 0 else 0
                    for i in range(layers)]
    content = GGUFContent(arch, metadata={
        **_common_metadata(cfg),
        "head_count_kv": ("add_head_count_kv", kv_per_layer),
        "ssm_conv_kernel": ("add_ssm_conv_kernel", cfg["mamba_d_conv"]),
        "ssm_inner_size": ("add_ssm_inner_size", cfg["mamba_expand"] * cfg["hidden_size"]),
        "ssm_state_size": ("add_ssm_state_size", cfg["mamba_d_state"]),
        "ssm_time_step_rank": ("add_ssm_time_step_rank", cfg["mamba_dt_rank"]),
        "expert_count": ("add_expert_count", cfg["num_experts"]),
        "expert_used_count": ("add_expert_used_count", cfg["num_experts_per_tok"]),
    })
    experts = cfg["num_experts"]
    for hf_name, values in state.items():
        if ".experts." in hf_name:
            if ".experts.0." not in hf_name:
                continue  # stacked with expert 0
            layer, which = hf_name.split(".")[2], hf_name.split(".")[-2]
            stacked = np.stack([state[hf_name.replace(".experts.0.", f".experts.{e}.")] for e in range(experts)])
            content.tensors[_gguf_name(arch, f"model.layers.{layer}.mlp.experts.{which}.weight", layers)] = stacked
            continue
        if hf_name.endswith("A_log"):
            values = -np.exp(values)
        elif hf_name.endswith("conv1d.weight"):
            values = values.squeeze()
        content.tensors[_gguf_name(arch, hf_name, layers)] = values
    return content


CONTENT = {"falcon_h1": falcon_h1_content, "jamba": jamba_content}


def write_gguf(content: GGUFContent, path: Path) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), content.arch)
    for adder, *arguments in content.metadata.values():
        getattr(writer, adder)(*arguments)
    for name, values in content.tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(values, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
