"""GGUF specs of the sliding-window families llama.cpp converts without changing a weight:
Cohere2 (`cohere2`), OLMo 3 (`olmo2`: llama.cpp files OLMo 3 under OLMo 2's architecture, with
a sliding window added) and EXAONE 4 (`exaone4`).

Facts from llama.cpp's converter and loader:
- No Q/K permutation: llama.cpp rotates OLMo 2/3 and EXAONE 4 in the NeoX half-split layout,
  and Cohere2 in the interleaved one, each the layout HF uses for that model, so every tensor
  is HF's own, renamed. Norm weights are stored as they are (no +1 folded in).
- Which layers slide: `attention.sliding_window_pattern`, one flag per layer, when the
  converter wrote it (OLMo 3, EXAONE 4, newer Cohere2 files); Cohere2 files without it get
  llama.cpp's fixed pattern (3 sliding, then 1 full).
- Cohere2: LayerNorm epsilon under `attention.layer_norm_epsilon`, `logit_scale`, biases
  dropped by the converter (they are zero), embedding tied (no output tensor), full layers
  without RoPE (models/config.py knows that from the family).
- OLMo 3: one RoPE base for every layer; YaRN (`rope.scaling.*`) applies to the full layers
  only (llama.cpp runs the sliding ones unscaled, as HF's Olmo3 does), which is what HF's
  older `rope_scaling` spelling means for Olmo3 (models/config.py reads it so).
- EXAONE 4: Llama 3 RoPE scaling as a `rope_freqs` tensor (gguf_rope_freqs.py).
"""

from __future__ import annotations

from typing import Any

from hybridserve.core.errors import ConfigError
from hybridserve.models.loaders.gguf_header import GGUFHeader
from hybridserve.models.loaders.gguf_rope_freqs import ROPE_FREQS_TENSOR, rope_freqs_scaling
from hybridserve.models.loaders.gguf_spec import (COMMON_BLOCK_NAMES, POST_NORM_BLOCK_NAMES, ArchSpec, common_config,
                                                  float32_value, layer_types, required, sliding_layer_flags)

COHERE2_SLIDING_PATTERN = 4  # llama.cpp's fixed Cohere2 pattern: layers 3, 7, ... are full
OLMO3_SLIDING_PATTERN = 4  # the converter's default for OLMo 3 configs without layer_types
COHERE2_LOGIT_SCALE = 0.0625  # HF's Cohere2Config default, for a file without logit_scale


def _windowed(header: GGUFHeader, config: dict[str, Any], default_pattern: int) -> None:
    """sliding_window and layer_types from the file (no window: every layer full)."""
    window = header.arch_value("attention.sliding_window")
    if window is None:
        config.update(sliding_window=None, layer_types=["full_attention"] * config["num_hidden_layers"])
        return
    config.update(sliding_window=int(window), layer_types=layer_types(sliding_layer_flags(header, default_pattern)))


def _head_dim(header: GGUFHeader, config: dict[str, Any]) -> int:
    return int(header.arch_value("attention.key_length") or config["hidden_size"] // config["num_attention_heads"])


def _check_full_rotary(header: GGUFHeader, head_dim: int) -> None:
    rotated = header.arch_value("rope.dimension_count")
    if rotated is not None and int(rotated) != head_dim:
        raise ConfigError(f"{header.path}: RoPE over {rotated} of {head_dim} head dims (partial rotary) "
                          f"is not supported")


def _cohere2_config(header: GGUFHeader) -> dict[str, Any]:
    config = common_config(header)
    head_dim = config["hidden_size"] // config["num_attention_heads"]  # HF's Cohere2 derives it so
    _check_full_rotary(header, head_dim)
    config.pop("rms_norm_eps")
    config.update(
        architectures=["Cohere2ForCausalLM"], model_type="cohere2", head_dim=head_dim, hidden_act="silu",
        layer_norm_eps=float32_value(required(header, "attention.layer_norm_epsilon")),
        logit_scale=float32_value(header.arch_value("logit_scale", COHERE2_LOGIT_SCALE)),
        rope_theta=float(header.arch_value("rope.freq_base", 10_000.0)),
    )
    _windowed(header, config, COHERE2_SLIDING_PATTERN)
    return config


def _olmo3_config(header: GGUFHeader) -> dict[str, Any]:
    if header.arch_value("attention.sliding_window") is None:
        raise ConfigError(f"{header.path} is an OLMo 2 file (olmo2 without a sliding window); "
                          f"only OLMo 3 (Olmo3ForCausalLM) is supported")
    config = common_config(header)
    head_dim = _head_dim(header, config)
    _check_full_rotary(header, head_dim)
    config.update(
        architectures=["Olmo3ForCausalLM"], model_type="olmo3", head_dim=head_dim, hidden_act="silu",
        rope_theta=float(header.arch_value("rope.freq_base", 500_000.0)), rope_scaling=config.get("rope_scaling"),
    )
    _windowed(header, config, OLMO3_SLIDING_PATTERN)
    return config


def _exaone4_config(header: GGUFHeader) -> dict[str, Any]:
    config = common_config(header)
    head_dim = _head_dim(header, config)
    _check_full_rotary(header, head_dim)
    theta = float(header.arch_value("rope.freq_base", 1_000_000.0))
    config.update(
        architectures=["Exaone4ForCausalLM"], model_type="exaone4", head_dim=head_dim, hidden_act="silu",
        rope_theta=theta, rope_scaling=rope_freqs_scaling(header, theta, head_dim) or config.get("rope_scaling"),
    )
    _windowed(header, config, OLMO3_SLIDING_PATTERN)
    return config


_POST_NORM_DECODER = {**COMMON_BLOCK_NAMES, **POST_NORM_BLOCK_NAMES}
del _POST_NORM_DECODER["attn_norm"]  # no norm before attention: its output is normed instead

COHERE2_SPEC = ArchSpec(
    gguf_arch="cohere2", family="cohere2", block_names=COMMON_BLOCK_NAMES, norm_modules=frozenset(),
    norm_weight_offset=0.0, unpermute_qk=False, build_config=_cohere2_config,
)
OLMO2_SPEC = ArchSpec(
    gguf_arch="olmo2", family="olmo3", block_names=_POST_NORM_DECODER, norm_modules=frozenset(),
    norm_weight_offset=0.0, unpermute_qk=False, build_config=_olmo3_config,
)
EXAONE4_SPEC = ArchSpec(
    gguf_arch="exaone4", family="exaone4", block_names=_POST_NORM_DECODER, norm_modules=frozenset(),
    norm_weight_offset=0.0, unpermute_qk=False, build_config=_exaone4_config,
    consumed_tensors=frozenset({ROPE_FREQS_TENSOR}),
)
