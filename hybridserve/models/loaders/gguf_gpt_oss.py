"""GGUF spec of gpt-oss (`gpt-oss`), as llama.cpp's converter writes it.

Tensors (E experts, I = expert intermediate size, H = hidden; shapes in numpy order):
- attention as Llama's with biases, no Q/K permutation (llama.cpp rotates gpt-oss in the
  NeoX half-split layout, as HF does); `attn_sinks.weight` [heads] is HF's `self_attn.sinks`;
  `post_attention_norm` is the norm before the experts (HF `post_attention_layernorm`);
- `ffn_gate_inp` (weight [E, H], bias [E]) is the router;
- experts: HF keeps gate and up in one [E, H, 2I] matrix with gate at even columns and up at
  odd ones, and down as [E, I, H] (x @ W). llama.cpp writes `ffn_gate_exps` and
  `ffn_up_exps` [E, I, H] (or, fused, `ffn_gate_up_exps` [E, 2I, H]: the gate rows, then the
  up rows), `ffn_down_exps` [E, H, I], and biases `ffn_{gate,up}_exps.bias` [E, I] (fused
  [E, 2I]), `ffn_down_exps.bias` [E, H]. Real files store the expert matrices as ggml MXFP4;
  those are kept packed, their nibbles reordered into HF's MXFP4 layout (`hf_mxfp4`), and
  dequantized when the model loads (models/arch/gpt_oss.py), as a HF MXFP4 checkpoint is.
  Expert matrices of any other type are dequantized into the cache like every other tensor.

Config facts the file does not hold are llama.cpp's fixed ones for gpt-oss (`GPT_OSS_DEFAULTS`):
the SwiGLU clamp and slope, and YaRN without truncation of its frequency band (gpt-oss's
config.json says `truncate: false`). Layers alternate sliding / full from layer 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridserve.models.loaders.gguf_header import GGUFHeader
from hybridserve.models.loaders.gguf_spec import (COMMON_BLOCK_NAMES, ArchSpec, BlockMerge, common_config, layer_types,
                                                  required, sliding_layer_flags)


@dataclass(frozen=True)
class GptOssDefaults:
    """gpt-oss facts llama.cpp hard-codes rather than storing in the file."""

    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    sliding_window_pattern: int = 2  # layers 0, 2, ... slide
    yarn_truncate: bool = False


GPT_OSS_DEFAULTS = GptOssDefaults()
MXFP4_GGML_TYPE = 39  # ggml's type number for MXFP4 (gguf.GGMLQuantizationType.MXFP4)
MXFP4_BLOCK = 32  # values per e8m0 scale


def _gpt_oss_config(header: GGUFHeader) -> dict[str, Any]:
    d = GPT_OSS_DEFAULTS
    config = common_config(header)
    if config.get("rope_scaling", {}).get("rope_type") == "yarn":
        config["rope_scaling"]["truncate"] = d.yarn_truncate
    config.update(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss",
        head_dim=int(header.arch_value("attention.key_length")
                     or config["hidden_size"] // config["num_attention_heads"]),
        intermediate_size=int(header.arch_value("expert_feed_forward_length") or config["intermediate_size"]),
        num_local_experts=int(required(header, "expert_count")),
        num_experts_per_tok=int(required(header, "expert_used_count")),
        swiglu_limit=d.swiglu_limit, swiglu_alpha=d.swiglu_alpha, hidden_act="silu",
        sliding_window=int(required(header, "attention.sliding_window")),
        layer_types=layer_types(sliding_layer_flags(header, d.sliding_window_pattern)),
        rope_theta=float(header.arch_value("rope.freq_base", 150_000.0)), rope_scaling=config.get("rope_scaling"),
    )
    if any(info.ggml_type == MXFP4_GGML_TYPE for info in header.tensors if "_exps." in info.name):
        config["quantization_config"] = {"quant_method": "mxfp4"}  # the experts are kept packed (see _EXPERT_MERGES)
    return config


def _interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """[..., n] and [..., n] -> [..., 2n] with gate at even positions, up at odd ones."""
    return np.stack((gate, up), axis=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])


def _gate_up_from_split(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return _interleave(gate.swapaxes(1, 2), up.swapaxes(1, 2))  # [E, I, H] twice -> [E, H, 2I]


def _gate_up_from_fused(fused: np.ndarray) -> np.ndarray:
    gate, up = np.split(fused, 2, axis=1)  # [E, 2I, H]: gate rows, then up rows
    return _gate_up_from_split(gate, up)


def _gate_up_bias_from_fused(fused: np.ndarray) -> np.ndarray:
    return _interleave(*np.split(fused, 2, axis=-1))


def _transposed_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (shape[0], shape[2], shape[1])


def hf_mxfp4(stored: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml MXFP4 rows [..., G * 17] -> HF's (blocks [..., G, 16], scales [..., G]).

    A ggml block is its e8m0 scale byte, then 16 bytes where byte j holds value j (low nibble)
    and value j + 16 (high nibble); HF's byte k holds values 2k and 2k + 1. Same scale byte.
    """
    blocks = stored.reshape(*stored.shape[:-1], -1, 1 + MXFP4_BLOCK // 2)
    nibbles = blocks[..., 1:]
    codes = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1)  # the block's 32 values in order
    return codes[..., 0::2] | (codes[..., 1::2] << 4), np.ascontiguousarray(blocks[..., 0])


def _packed_gate_up(gate: np.ndarray, up: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gate and up rows [E, I, ...] interleaved into HF's [E, 2I, ...] (gate at even rows)."""
    (gate_blocks, gate_scales), (up_blocks, up_scales) = hf_mxfp4(gate), hf_mxfp4(up)
    return _interleave_rows(gate_blocks, up_blocks), _interleave_rows(gate_scales, up_scales)


def _interleave_rows(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return np.stack((gate, up), axis=2).reshape(gate.shape[0], 2 * gate.shape[1], *gate.shape[2:])


def _packed_shapes(rows: int, cols: int, experts: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return (experts, rows, cols // MXFP4_BLOCK, MXFP4_BLOCK // 2), (experts, rows, cols // MXFP4_BLOCK)


_PACKED = dict(packed_type=MXFP4_GGML_TYPE, packed_parts=("blocks", "scales"))
_EXPERT_MERGES = (
    # MXFP4 expert matrices stay packed, in HF's MXFP4 layout (models/loaders/mxfp4.py);
    # rows are output features in both formats, so nothing is transposed.
    BlockMerge("mlp.experts.gate_up_proj", ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
               shape=lambda g, u: _packed_shapes(2 * g[1], g[2], g[0]), build=_packed_gate_up, **_PACKED),
    BlockMerge("mlp.experts.gate_up_proj", ("ffn_gate_up_exps.weight",),
               shape=lambda f: _packed_shapes(f[1], f[2], f[0]),
               build=lambda fused: _packed_gate_up(*np.split(fused, 2, axis=1)), **_PACKED),
    BlockMerge("mlp.experts.down_proj", ("ffn_down_exps.weight",),
               shape=lambda d: _packed_shapes(d[1], d[2], d[0]), build=hf_mxfp4, **_PACKED),
    BlockMerge("mlp.experts.gate_up_proj", ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
               shape=lambda g, u: (g[0], g[2], 2 * g[1]), build=_gate_up_from_split),
    BlockMerge("mlp.experts.gate_up_proj", ("ffn_gate_up_exps.weight",),
               shape=lambda f: (f[0], f[2], f[1]), build=_gate_up_from_fused),
    BlockMerge("mlp.experts.gate_up_proj_bias", ("ffn_gate_exps.bias", "ffn_up_exps.bias"),
               shape=lambda g, u: (g[0], 2 * g[1]), build=_interleave),
    BlockMerge("mlp.experts.gate_up_proj_bias", ("ffn_gate_up_exps.bias",),
               shape=lambda f: f, build=_gate_up_bias_from_fused),
    BlockMerge("mlp.experts.down_proj", ("ffn_down_exps.weight",),
               shape=_transposed_shape, build=lambda down: down.swapaxes(1, 2)),
    BlockMerge("mlp.experts.down_proj_bias", ("ffn_down_exps.bias",), shape=lambda b: b, build=lambda b: b),
)

GPT_OSS_SPEC = ArchSpec(
    gguf_arch="gpt-oss", family="gpt_oss",
    block_names={
        **{k: v for k, v in COMMON_BLOCK_NAMES.items() if not k.startswith("ffn_")},
        "attn_sinks": "self_attn.sinks", "post_attention_norm": "post_attention_layernorm",
        "ffn_gate_inp": "mlp.router",
    },
    norm_modules=frozenset(), norm_weight_offset=0.0, unpermute_qk=False, build_config=_gpt_oss_config,
    block_merges=_EXPERT_MERGES,
)
