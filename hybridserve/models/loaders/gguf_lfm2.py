"""GGUF spec of LFM2 (`lfm2`), as llama.cpp's converter writes it.

Tensors are HF's, renamed, except the short convolution's depthwise weight, squeezed from
[D, 1, L] to [D, L]. Names: `shortconv.{conv,in_proj,out_proj}` (HF `conv.conv`, ...),
`attn_norm` / `ffn_norm` (HF `operator_norm` / `ffn_norm`), `ffn_{gate,up,down}` (HF
`feed_forward.w1` / `w3` / `w2`), `attn_output` (HF `self_attn.out_proj`), `attn_{q,k}_norm`
(HF `self_attn.{q,k}_layernorm`) and `token_embd_norm`, which is HF's `model.embedding_norm`:
despite its name, the norm after the last layer. No norm offset, no Q/K permutation (llama.cpp
rotates LFM2 in the NeoX half-split layout, as HF does); no `output` tensor when the head is tied.

Config: `attention.head_count_kv` is one count per layer, 0 for a convolution layer (how
llama.cpp's runtime tells them apart; a file with a single count has attention where the
layer has `attn_q`); `feed_forward_length` is the MLP width HF derives from its config
(2/3, multiplier, rounding), so the HF config states it with the adjustment off;
`shortconv.l_cache` is the kernel length L.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from hybridserve.core.errors import ConfigError
from hybridserve.models.arch.lfm2_config import SHORT_CONV
from hybridserve.models.loaders.gguf_header import GGUFHeader
from hybridserve.models.loaders.gguf_spec import (ArchSpec, common_config, renamed, required, tensor_rows,
                                                  unsqueezed_conv)

_EMBEDDING_NORM = "token_embd_norm"  # the final norm (HF model.embedding_norm)


def _kv_heads_per_layer(header: GGUFHeader, layers: int) -> list[int]:
    """KV heads of each layer, 0 for a short convolution layer."""
    counts = header.arch_value("attention.head_count_kv")
    if isinstance(counts, np.ndarray):
        if len(counts) != layers:
            raise ConfigError(f"{header.path}: attention.head_count_kv has {len(counts)} counts for {layers} layers")
        return [int(count) for count in counts]
    count = int(counts if counts is not None else required(header, "attention.head_count"))
    return [count if tensor_rows(header, f"blk.{i}.attn_q.weight") else 0 for i in range(layers)]


def _lfm2_config(header: GGUFHeader) -> dict[str, Any]:
    layers = int(required(header, "block_count"))
    per_layer = _kv_heads_per_layer(header, layers)
    attention_kv = {count for count in per_layer if count}
    if len(attention_kv) > 1:
        raise ConfigError(f"{header.path}: attention layers with different KV head counts {sorted(attention_kv)}")
    kv_heads = attention_kv.pop() if attention_kv else int(required(header, "attention.head_count"))
    single = replace(header, metadata={**header.metadata, f"{header.architecture}.attention.head_count_kv": kv_heads})
    config = common_config(single)
    head_dim = header.arch_value("attention.key_length")
    if head_dim is not None and int(head_dim) * config["num_attention_heads"] != config["hidden_size"]:
        raise ConfigError(f"{header.path}: attention.key_length {head_dim} is not hidden size / heads, "
                          f"which LFM2 always uses")
    if header.arch_value("attention.sliding_window", 0):  # LFM2.5's audio tokenizer, not a causal LM of HF's
        raise ConfigError(f"{header.path}: LFM2 with a sliding window (attention.sliding_window) is not supported")
    conv_layers = [i for i, count in enumerate(per_layer) if not count]
    config.update(
        architectures=["Lfm2ForCausalLM"], model_type="lfm2", norm_eps=config.pop("rms_norm_eps"),
        block_auto_adjust_ff_dim=False, conv_L_cache=int(required(header, "shortconv.l_cache")),
        conv_bias=bool(conv_layers) and tensor_rows(header, f"blk.{conv_layers[0]}.shortconv.in_proj.bias") is not None,
        layer_types=[SHORT_CONV if not count else "full_attention" for count in per_layer],
        # llama.cpp's RoPE base for a file without rope.freq_base (converters always write it)
        rope_parameters={"rope_type": "default", "rope_theta": float(header.arch_value("rope.freq_base", 10_000.0)),
                         **(config.pop("rope_scaling", None) or {})},
    )
    return config


# The short convolution's tensors have a four-part GGUF name (blk.N.shortconv.<part>).
_SHORT_CONV_MERGES = (
    unsqueezed_conv("conv.conv.weight", "shortconv.conv.weight"),
    renamed("conv.conv.bias", "shortconv.conv.bias"),
    *(renamed(f"conv.{projection}.{suffix}", f"shortconv.{projection}.{suffix}")
      for projection in ("in_proj", "out_proj") for suffix in ("weight", "bias")),
)


class _Lfm2Spec(ArchSpec):
    """LFM2's spec: also maps the global `token_embd_norm`."""

    def hf_name(self, gguf_name: str) -> str | None:
        stem, _, suffix = gguf_name.rpartition(".")
        if stem == _EMBEDDING_NORM:
            return f"model.embedding_norm.{suffix}"
        return super().hf_name(gguf_name)


LFM2_SPEC = _Lfm2Spec(
    gguf_arch="lfm2", family="lfm2",
    block_names={
        "attn_norm": "operator_norm", "ffn_norm": "ffn_norm",
        "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2",
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.out_proj", "attn_q_norm": "self_attn.q_layernorm",
        "attn_k_norm": "self_attn.k_layernorm",
    },
    norm_modules=frozenset(), norm_weight_offset=0.0, unpermute_qk=False, build_config=_lfm2_config,
    block_merges=_SHORT_CONV_MERGES,
)
