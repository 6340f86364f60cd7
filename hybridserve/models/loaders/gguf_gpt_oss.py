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
  [E, 2I]), `ffn_down_exps.bias` [E, H]. Real files store the expert matrices as ggml MXFP4
  (gguf_header.py dequantizes them with the gguf package's kernel; tests check it against
  values worked out from the format).

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


_EXPERT_MERGES = (
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
