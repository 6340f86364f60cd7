"""gpt-oss specifics of a `config.json` (`GptOssForCausalLM`, model_type gpt_oss).

Pure Python (no torch), like llama4_config.py: the engine reads the layer types before any
weights load. The shared fields (alternating sliding / full layers from `layer_types`,
YaRN RoPE, attention biases) go through config.py; what only gpt-oss has is here: every
layer's feed-forward is a top-k mixture of experts whose router has a bias, and whose
experts apply a clamped SwiGLU, (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)
with g = clamp(gate, max=limit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridserve.core.errors import ConfigError

# Checkpoint formats of the expert weights we read: plain tensors (no quantization_config)
# or MXFP4 blocks and scales (models/loaders/mxfp4.py), dequantized at load.
_QUANT_METHODS = (None, "mxfp4")


@dataclass(frozen=True)
class GptOssOptions:
    num_experts: int
    num_experts_per_tok: int  # top-k; the chosen logits are softmaxed among themselves
    swiglu_alpha: float
    swiglu_limit: float
    mxfp4: bool  # whether config.json says the expert weights are stored as MXFP4


def _positive(raw: dict[str, Any], key: str, default: float) -> float:
    value = raw.get(key)
    value = default if value is None else value
    if not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"config.json: {key} must be a positive number, got {value!r}")
    return float(value)


def parse_gpt_oss_options(raw: dict[str, Any]) -> GptOssOptions:
    """GptOssOptions with HF's defaults for absent keys; ConfigError on values we would run wrong."""
    num_experts = int(_positive(raw, "num_local_experts", 128))
    top_k = int(_positive(raw, "num_experts_per_tok", raw.get("experts_per_token") or 4))
    if top_k > num_experts:
        raise ConfigError(f"num_experts_per_tok {top_k} exceeds num_local_experts {num_experts}")
    quant = raw.get("quantization_config") or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method not in _QUANT_METHODS:
        raise ConfigError(f"quantization_config.quant_method {method!r} is not supported for gpt-oss "
                          f"(supported: MXFP4 expert weights, or none)")
    return GptOssOptions(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        swiglu_alpha=_positive(raw, "swiglu_alpha", 1.702),
        swiglu_limit=_positive(raw, "swiglu_limit", 7.0),
        mxfp4=method == "mxfp4",
    )
