"""A Qwen3-Next GGUF written from a tiny HF checkpoint the way llama.cpp's converter
(convert_hf_to_gguf.py, Qwen3NextModel on Qwen2MoeModel on TextModel) writes it, stated here
from that converter and gguf-py's constants / tensor map, not from hybridserve's reader:

- keys: TextModel's (block_count, context_length, embedding_length, feed_forward_length =
  intermediate_size, head_count, head_count_kv, rope.freq_base, layer_norm_rms_epsilon,
  expert_count, expert_used_count, key_length = value_length = head_dim), Qwen2MoE's
  expert_feed_forward_length and expert_shared_feed_forward_length, and Qwen3-Next's
  ssm.conv_kernel, ssm.state_size (key head dim), ssm.group_count (key heads),
  ssm.time_step_rank (value heads), ssm.inner_size (value heads * value head dim),
  full_attention_interval and rope.dimension_count = int(head_dim * partial_rotary_factor).
  The converter reads full_attention_interval from the HF config (default 4); transformers
  keeps only layer_types, so the interval is taken here from the model's layer_types.
- tensors: every norm weight ending in "norm.weight" but the mixer's `linear_attn.norm` is
  stored plus 1; `A_log` as `ssm_a` = -exp(A_log); `dt_bias` as `ssm_dt.bias`; conv1d
  squeezed to [C, K]; `in_proj_qkvz` cut per key head into q, k, v, z and written as
  `attn_qkv` (all q, all k, all v) and `attn_gate` (all z) — or, as converters before that
  split did, unchanged as `ssm_in` (`legacy_qkvz`); per-expert matrices stacked into
  `ffn_{gate,up,down}_exps`; the rest renamed by gguf-py's tensor map.
A tiny byte-level vocabulary lets the tokenizer be built.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tests.helpers.gguf_from_hf import _byte_vocabulary

_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "linear_attn.in_proj_ba": "ssm_ba", "linear_attn.conv1d": "ssm_conv1d", "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out", "linear_attn.in_proj_qkvz": "ssm_in",
    "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}


def add_byte_tokenizer(writer: Any, vocab_size: int, bos_token_id: int) -> None:
    """A GPT-2 style vocabulary of bytes and filler tokens, without merges."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(_byte_vocabulary(vocab_size))
    writer.add_token_types([1] * vocab_size)
    writer.add_token_scores([0.0] * vocab_size)
    writer.add_bos_token_id(bos_token_id)


def read_checkpoint(hf_dir: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The HF config and its tensors (float32), as the converter reads the files."""
    from safetensors.numpy import load_file

    return json.loads((hf_dir / "config.json").read_text()), load_file(str(hf_dir / "model.safetensors"))


def _split_qkvz(weight: np.ndarray, config: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """HF's per-key-head [q | k | v | z] rows -> (all q, all k, all v rows; all z rows)."""
    k_heads, dk = config["linear_num_key_heads"], config["linear_key_head_dim"]
    per_head_v = config["linear_num_value_heads"] // k_heads * config["linear_value_head_dim"]
    grouped = weight.reshape(k_heads, 2 * dk + 2 * per_head_v, weight.shape[1])
    q, k, v, z = np.split(grouped, [dk, 2 * dk, 2 * dk + per_head_v], axis=1)
    flat = [part.reshape(-1, weight.shape[1]) for part in (q, k, v, z)]
    return np.concatenate(flat[:3]), flat[3]


def _full_attention_interval(layer_types: list[str]) -> int:
    interval = layer_types.index("full_attention") + 1
    assert all(((i + 1) % interval == 0) == (t == "full_attention") for i, t in enumerate(layer_types))
    return interval


def write_qwen3next_gguf(hf_dir: Path, path: Path, legacy_qkvz: bool = False,
                        extra_tensors: dict[str, np.ndarray] | None = None) -> None:
    """`extra_tensors`: written as well, after the model's (a file the reader must refuse)."""
    import gguf

    config, state = read_checkpoint(hf_dir)
    w = gguf.GGUFWriter(str(path), "qwen3next")
    head_dim, rope = config["head_dim"], config["rope_parameters"]
    keys = {
        w.add_block_count: config["num_hidden_layers"], w.add_context_length: config["max_position_embeddings"],
        w.add_embedding_length: config["hidden_size"], w.add_feed_forward_length: config["intermediate_size"],
        w.add_head_count: config["num_attention_heads"], w.add_head_count_kv: config["num_key_value_heads"],
        w.add_rope_freq_base: rope["rope_theta"], w.add_layer_norm_rms_eps: config["rms_norm_eps"],
        w.add_expert_count: config["num_experts"], w.add_expert_used_count: config["num_experts_per_tok"],
        w.add_key_length: head_dim, w.add_value_length: head_dim,
        w.add_expert_feed_forward_length: config["moe_intermediate_size"],
        w.add_expert_shared_feed_forward_length: config["shared_expert_intermediate_size"],
        w.add_ssm_conv_kernel: config["linear_conv_kernel_dim"], w.add_ssm_state_size: config["linear_key_head_dim"],
        w.add_ssm_group_count: config["linear_num_key_heads"],
        w.add_ssm_time_step_rank: config["linear_num_value_heads"],
        w.add_ssm_inner_size: config["linear_value_head_dim"] * config["linear_num_value_heads"],
        w.add_full_attention_interval: _full_attention_interval(config["layer_types"]),
        w.add_rope_dimension_count: int(head_dim * rope.get("partial_rotary_factor", 0.25)),
    }
    for add_key, value in keys.items():
        add_key(value)
    add_byte_tokenizer(w, config["vocab_size"], config["bos_token_id"])

    def add(name: str, values: np.ndarray) -> None:
        w.add_tensor(name, np.ascontiguousarray(values, np.float32))

    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, values in state.items():
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            values = values + np.float32(1.0)
        if name in _GLOBAL_NAMES:
            add(_GLOBAL_NAMES[name], values)
            continue
        _, _, layer, rest = name.split(".", 3)
        module, _, suffix = rest.rpartition(".")
        blk = f"blk.{layer}."
        if ".experts." in rest:  # mlp.experts.<e>.<gate|up|down>_proj.weight
            _, _, expert, projection, _ = rest.split(".")
            experts.setdefault((int(layer), projection), {})[int(expert)] = values
        elif rest == "linear_attn.A_log":
            add(blk + "ssm_a", -np.exp(values))
        elif rest == "linear_attn.dt_bias":
            add(blk + "ssm_dt.bias", values)
        elif module == "linear_attn.conv1d":
            add(blk + "ssm_conv1d.weight", values[:, 0, :])
        elif module == "linear_attn.in_proj_qkvz" and not legacy_qkvz:
            qkv, z = _split_qkvz(values, config)
            add(blk + "attn_qkv.weight", qkv)
            add(blk + "attn_gate.weight", z)
        else:
            add(f"{blk}{_LAYER_NAMES[module]}.{suffix}", values)
    for (layer, projection), by_expert in sorted(experts.items()):
        stem = projection.removesuffix("_proj")
        add(f"blk.{layer}.ffn_{stem}_exps.weight", np.stack([by_expert[e] for e in sorted(by_expert)]))
    for name, values in (extra_tensors or {}).items():
        add(name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
