"""An LFM2 GGUF written from a tiny HF checkpoint the way llama.cpp's converter
(convert_hf_to_gguf.py, LFM2Model on TextModel) writes it, stated here from that converter
and gguf-py's constants / tensor map, not from hybridserve's reader:

- keys: TextModel's (block_count, context_length, embedding_length, head_count,
  rope.freq_base, layer_norm_rms_epsilon = norm_eps; no key_length: the HF config has no
  head_dim), head_count_kv as one count per layer with 0 for each "conv" layer, vocab_size,
  shortconv.l_cache = conv_L_cache, and feed_forward_length = the MLP width after LFM2's
  adjustment (2/3 of block_ff_dim / intermediate_size, times block_ffn_dim_multiplier,
  rounded up to block_multiple_of; the converter writes TextModel's unadjusted value first
  and then this one over it);
- tensors: HF's, renamed by gguf-py's tensor map (`conv.conv` -> `shortconv.conv`,
  `operator_norm` -> `attn_norm`, `feed_forward.w1/w3/w2` -> `ffn_gate/up/down`,
  `self_attn.out_proj` -> `attn_output`, `q/k_layernorm` -> `attn_q/k_norm`,
  `model.embedding_norm` -> `token_embd_norm`), the conv weight squeezed from [D, 1, L] to
  [D, L]; a tied head is not stored.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.helpers.gguf_from_hf_recurrent_qwen3next import add_byte_tokenizer, read_checkpoint

_LAYER_NAMES = {
    "operator_norm": "attn_norm", "ffn_norm": "ffn_norm", "feed_forward.w1": "ffn_gate",
    "feed_forward.w3": "ffn_up", "feed_forward.w2": "ffn_down", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_output",
    "self_attn.q_layernorm": "attn_q_norm", "self_attn.k_layernorm": "attn_k_norm",
    "conv.conv": "shortconv.conv", "conv.in_proj": "shortconv.in_proj", "conv.out_proj": "shortconv.out_proj",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                 "model.embedding_norm.weight": "token_embd_norm.weight", "lm_head.weight": "output.weight"}


def adjusted_ff_dim(config: dict) -> int:
    """The converter's _add_feed_forward_length."""
    ff_dim = config.get("block_ff_dim", config.get("intermediate_size"))
    if config["block_auto_adjust_ff_dim"]:
        ff_dim = int(2 * ff_dim / 3)
        if config["block_ffn_dim_multiplier"] is not None:
            ff_dim = int(config["block_ffn_dim_multiplier"] * ff_dim)
        multiple = config["block_multiple_of"]
        ff_dim = multiple * ((ff_dim + multiple - 1) // multiple)
    return ff_dim


def write_lfm2_gguf(hf_dir: Path, path: Path, extra_tensors: dict[str, np.ndarray] | None = None) -> None:
    """`extra_tensors`: written as well, after the model's (a file the reader must refuse)."""
    import gguf

    config, state = read_checkpoint(hf_dir)
    w = gguf.GGUFWriter(str(path), "lfm2")
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv([config["num_key_value_heads"] if t != "conv" else 0 for t in config["layer_types"]])
    w.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(config["norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    w.add_shortconv_l_cache(config["conv_L_cache"])
    w.add_feed_forward_length(adjusted_ff_dim(config))
    add_byte_tokenizer(w, config["vocab_size"], config["bos_token_id"])
    for name, values in {**state, **(extra_tensors or {})}.items():
        if name in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[name]
        elif name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, _, suffix = rest.rpartition(".")
            if module == "conv.conv":
                values = values[:, 0, :]
            name = f"blk.{layer}.{_LAYER_NAMES[module]}.{suffix}"
        w.add_tensor(name, np.ascontiguousarray(values, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
