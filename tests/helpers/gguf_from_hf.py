"""GGUF files written from tiny HF models the way llama.cpp's converter (convert_hf_to_gguf.py)
writes them, for the sliding-window families: its architecture names, metadata keys, tensor
names and layouts, stated here from llama.cpp's converter and gguf-py constants rather than
taken from hybridserve's reader (which these files test).

Per family: `cohere2` (no output tensor: tied; biases dropped; no sliding pattern key, so the
reader falls back on llama.cpp's fixed 3:1), `olmo2` for OLMo 3 (a per-layer sliding flag
array, YaRN keys with `rope.scaling.attn_factor`), `exaone4` (flags, Llama 3 scaling as a
`rope_freqs` tensor), `gpt-oss` (sinks, router, experts split into gate / up and transposed,
optionally MXFP4). A tiny byte-level vocabulary lets the tokenizer be built.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

GGUF_ARCH = {"cohere2": "cohere2", "olmo3": "olmo2", "exaone4": "exaone4", "gpt_oss": "gpt-oss"}
_ATTENTION = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output"}
_MLP = {"mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_POST_NORMS = {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm"}
BLOCK_NAMES = {
    "cohere2": {**_ATTENTION, **_MLP, "input_layernorm": "attn_norm"},
    "olmo3": {**_ATTENTION, **_MLP, **_POST_NORMS},
    "exaone4": {**_ATTENTION, **_MLP, **_POST_NORMS},
    "gpt_oss": {**_ATTENTION, "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
                "mlp.router": "ffn_gate_inp", "self_attn.sinks": "attn_sinks"},
}


def _byte_vocabulary(size: int) -> list[str]:
    """GPT-2's byte-to-character table for the first 256 ids, then filler tokens."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)] + [f"<extra_{i}>" for i in range(size - 256)]


def gpt_oss_expert_tensors(state: dict[str, np.ndarray], layer: int) -> dict[str, np.ndarray]:
    """llama.cpp's expert tensors of one gpt-oss layer from HF's: gate_up [E, H, 2I] (gate at
    even columns) transposed to [E, 2I, H] and split by row parity, down [E, I, H] transposed."""
    m = f"model.layers.{layer}.mlp.experts."
    gate_up = state[m + "gate_up_proj"].swapaxes(1, 2)
    bias = state[m + "gate_up_proj_bias"]
    return {
        "ffn_gate_exps.weight": gate_up[:, 0::2], "ffn_up_exps.weight": gate_up[:, 1::2],
        "ffn_gate_exps.bias": bias[:, 0::2], "ffn_up_exps.bias": bias[:, 1::2],
        "ffn_down_exps.weight": state[m + "down_proj"].swapaxes(1, 2), "ffn_down_exps.bias": state[m + "down_proj_bias"],
    }


def make_experts_mxfp4_exact(model: torch.nn.Module) -> None:
    """Replace a gpt-oss model's expert matrices by their MXFP4 round trip in llama.cpp's
    layout (blocks of 32 along each GGUF row), so an MXFP4 file holds them exactly."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    def exact(values: np.ndarray) -> np.ndarray:
        mx = GGMLQuantizationType.MXFP4
        return dequantize(quantize(np.ascontiguousarray(values), mx), mx).reshape(values.shape)

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                gguf_layout = param.numpy().swapaxes(1, 2)  # rows of the GGUF tensor are HF columns
                param.copy_(torch.from_numpy(exact(gguf_layout).swapaxes(1, 2).copy()))


def write_gguf(kind: str, config: Any, state: dict[str, np.ndarray], path: str, mxfp4_experts: bool = False,
               rope_freqs: np.ndarray | None = None) -> None:
    """Write `state` (HF names, float32) of a tiny `kind` model with HF `config` to `path`."""
    import gguf

    arch = GGUF_ARCH[kind]
    w = gguf.GGUFWriter(path, arch)
    heads, layers = config.num_attention_heads, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if kind == "cohere2":
        w.add_layer_norm_eps(config.layer_norm_eps)
        w.add_logit_scale(config.logit_scale)
        w.add_rope_dimension_count(head_dim)
        w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    else:
        w.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    full_rope = rope.get("full_attention", rope)
    w.add_rope_freq_base(full_rope["rope_theta"])
    w.add_sliding_window(config.sliding_window)
    if kind in ("olmo3", "exaone4"):
        w.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])
    if full_rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(full_rope["factor"])
        w.add_rope_scaling_orig_ctx_len(full_rope["original_max_position_embeddings"])
        if "attention_factor" in full_rope:  # OLMo 3's converter writes it under rope.scaling.attn_factor
            w.add_rope_scaling_attn_factors(full_rope["attention_factor"])
        if kind == "gpt_oss":
            w.add_rope_scaling_yarn_beta_fast(full_rope["beta_fast"])
            w.add_rope_scaling_yarn_beta_slow(full_rope["beta_slow"])
    if kind == "gpt_oss":
        w.add_expert_count(config.num_local_experts)
        w.add_expert_used_count(config.num_experts_per_tok)
        w.add_expert_feed_forward_length(config.intermediate_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(_byte_vocabulary(config.vocab_size))
    w.add_token_types([1] * config.vocab_size)
    w.add_token_scores([0.0] * config.vocab_size)  # no merges: transformers derives them (none) from these
    w.add_bos_token_id(config.bos_token_id)

    def add(name: str, values: np.ndarray, mxfp4: bool = False) -> None:
        if mxfp4:
            mx = gguf.GGMLQuantizationType.MXFP4
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(values, np.float32), mx), raw_dtype=mx)
        else:
            w.add_tensor(name, np.ascontiguousarray(values, np.float32))

    add("token_embd.weight", state["model.embed_tokens.weight"])
    add("output_norm.weight", state["model.norm.weight"])
    if not config.tie_word_embeddings:
        add("output.weight", state["lm_head.weight"])
    if rope_freqs is not None:
        add("rope_freqs.weight", rope_freqs)
    for i in range(layers):
        prefix = f"model.layers.{i}."
        for name, values in state.items():
            if not name.startswith(prefix) or ".experts." in name:
                continue
            module, _, suffix = name[len(prefix):].rpartition(".")
            if name.endswith("self_attn.sinks"):
                module, suffix = "self_attn.sinks", "weight"
            if kind == "cohere2" and suffix == "bias":
                continue
            add(f"blk.{i}.{BLOCK_NAMES[kind][module]}.{suffix}", values)
        if kind == "gpt_oss":
            for name, values in gpt_oss_expert_tensors(state, i).items():
                add(f"blk.{i}.{name}", values, mxfp4=mxfp4_experts and name.endswith("weight"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
