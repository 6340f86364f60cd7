"""What the Mamba2 hybrids beyond Bamba add to its layer: Granite 4.0-H
(GraniteMoeHybridForCausalLM) scales and experts, Nemotron-H (NemotronHForCausalLM) layer
pattern and squared-ReLU MLP.

Pure Python (no torch), parsed by `models/config.py` into `ModelConfig.hybrid`; the layer
these options shape is in `models/arch/mamba_lm.py`::

    Granite 4.0-H layer:  h += r * (mixer or attention)(norm(h))
                          h += r * (shared_mlp(x) + experts(x)),  x = post_attention_norm(h)
    Nemotron-H layer:     h += (mixer or attention or relu2 MLP)(norm(h))    one block per layer
    Falcon-H1 layer:      x = norm(h);  h += mixer(x) + attention(x);  h += mlp(pre_ff_norm(h))

with r the residual multiplier; Granite also scales the embedding and divides the logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridserve.core.errors import ConfigError
from hybridserve.models.arch.mamba_config import MAMBA

# Layer kind of a Nemotron-H layer that is only an MLP (no state, no KV: no cache spec).
MLP_ONLY = "mlp"
SWIGLU = "swiglu"  # act(gate) * up, gate and up one fused projection
RELU2 = "relu2"  # relu(up)^2, no gate


@dataclass(frozen=True)
class FalconH1Scales:
    """Falcon-H1's multipliers. Each scales a weight's input or output, so the loader folds it
    into that weight (models/loaders/falcon_h1_loader.py); embedding and lm_head multipliers
    are ModelConfig.embed_scale and logit_scale."""

    key: float = 1.0  # k after k_proj
    attention_in: float = 1.0  # the attention's input (q, k and v)
    attention_out: float = 1.0  # after o_proj
    ssm_in: float = 1.0  # the mixer's input
    ssm_out: float = 1.0  # after out_proj
    ssm: tuple[float, ...] = (1.0,) * 5  # in_proj's outputs z, x, B, C, dt
    mlp_gate: float = 1.0  # gate_proj's output, before the activation
    mlp_down: float = 1.0  # after down_proj


@dataclass(frozen=True)
class HybridOptions:
    """Per-model numbers of the layer above; the defaults leave Bamba's layer unchanged."""

    residual_multiplier: float = 1.0  # r: every block's output is scaled before its add
    logits_divisor: float = 1.0  # the logits are divided by it (Granite's logits_scaling)
    num_experts: int = 0  # routed experts beside the dense (shared) MLP; 0: none
    experts_per_tok: int = 0  # top-k of the router; the k weights are a softmax over their logits
    expert_intermediate_size: int = 0  # each expert's gate (and up) width
    mlp: str = SWIGLU  # the MLP's form: SWIGLU or RELU2
    # Nemotron-H: the MLP is a layer of its own (MLP_ONLY), not a second block after each layer's mixer.
    mlp_layers: bool = False
    # Falcon-H1: layer 2j is decoder layer j's attention, 2j + 1 its mixer (one cache each), run
    # side by side on one normed input; the MLP follows the pair.
    falcon: FalconH1Scales | None = None


def _count(raw: dict[str, Any], key: str, default: int) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"config.json: {key} must be a non-negative integer, got {value!r}")
    return value


def _positive_float(raw: dict[str, Any], key: str) -> float:
    value = raw.get(key)
    value = 1.0 if value is None else value
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ConfigError(f"config.json: {key} must be a positive number, got {value!r}")
    return float(value)


# Granite writes its layer kinds as HF 5 does ("linear_attention") or as its own files do ("mamba").
_GRANITE_KINDS = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": "full_attention",
                  "full_attention": "full_attention"}


def granite_layer_kinds(raw: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """Granite 4.0-H's `layer_types` (every layer a mixer when absent, as HF defaults)."""
    given = raw.get("layer_types") or raw.get("layers_block_type") or ["mamba"] * num_layers
    if len(given) != num_layers:
        raise ConfigError(f"layer_types has {len(given)} entries for {num_layers} layers")
    bad = sorted({k for k in given if k not in _GRANITE_KINDS}, key=str)
    if bad:
        raise ConfigError(f"unsupported layer type(s) {bad} in layer_types (mamba or attention)")
    return tuple(_GRANITE_KINDS[k] for k in given)


def parse_granite_options(raw: dict[str, Any]) -> HybridOptions:
    """Granite 4.0-H's multipliers and experts; ConfigError on what we do not implement."""
    if raw.get("attention_bias"):
        raise ConfigError("attention_bias=true is not supported for GraniteMoeHybrid")
    experts = _count(raw, "num_local_experts", 8)
    top_k = _count(raw, "num_experts_per_tok", 2) if experts else 0
    if experts and not 1 <= top_k <= experts:
        raise ConfigError(f"num_experts_per_tok {top_k} must be in 1..num_local_experts ({experts})")
    if experts and not raw.get("intermediate_size", 11008):
        raise ConfigError("intermediate_size (each expert's) must be positive with num_local_experts > 0")
    return HybridOptions(
        residual_multiplier=_positive_float(raw, "residual_multiplier"),
        logits_divisor=_positive_float(raw, "logits_scaling"), num_experts=experts, experts_per_tok=top_k,
        expert_intermediate_size=_count(raw, "intermediate_size", 11008) if experts else 0,
    )


def granite_uses_rope(raw: dict[str, Any]) -> bool:
    """Whether the attention layers rotate (HF's position_embedding_type "rope"; None or "nope": no)."""
    kind = raw.get("position_embedding_type")
    if kind not in (None, "nope", "rope"):
        raise ConfigError(f"position_embedding_type {kind!r} is not supported (rope or nope)")
    return kind == "rope"


# Nemotron-H's layer kinds: its pattern's characters, or the names its layer list uses.
_NEMOTRON_KINDS = {"M": MAMBA, "mamba": MAMBA, "linear_attention": MAMBA, "*": "full_attention",
                   "attention": "full_attention", "full_attention": "full_attention", "-": MLP_ONLY, "mlp": MLP_ONLY}
_NEMOTRON_MOE = ("E", "moe")


def nemotron_h_layer_kinds(raw: dict[str, Any]) -> tuple[str, ...]:
    """Nemotron-H's layers from `layers_block_type` (or `layer_types`), else from
    `hybrid_override_pattern` (M Mamba2, * attention, - MLP); their count is the model's, as
    in HF (which ignores num_hidden_layers)."""
    given = raw.get("layers_block_type") or raw.get("layer_types") or raw.get("hybrid_override_pattern")
    if not given or not isinstance(given, (list, str)):
        raise ConfigError("NemotronH needs layers_block_type or hybrid_override_pattern")
    if any(k in _NEMOTRON_MOE for k in given):
        raise ConfigError("NemotronH mixture-of-experts layers (moe / 'E') are not supported")
    bad = sorted({str(k) for k in given if k not in _NEMOTRON_KINDS})
    if bad:
        raise ConfigError(f"unsupported NemotronH layer kind(s) {bad} (M / mamba, * / attention, - / mlp)")
    return tuple(_NEMOTRON_KINDS[k] for k in given)


def parse_nemotron_h_options(raw: dict[str, Any]) -> HybridOptions:
    """Nemotron-H's squared-ReLU MLP layers; ConfigError on what we do not implement."""
    act = raw.get("mlp_hidden_act", "relu2")
    if act != "relu2":
        raise ConfigError(f"unsupported mlp_hidden_act {act!r} for NemotronH (relu2 only)")
    for key in ("mlp_bias", "attention_bias"):
        if raw.get(key):
            raise ConfigError(f"{key}=true is not supported for NemotronH")
    return HybridOptions(mlp=RELU2, mlp_layers=True)


def _floats(raw: dict[str, Any], key: str, count: int) -> tuple[float, ...]:
    value = raw.get(key) or [1.0] * count
    if not isinstance(value, list) or len(value) != count or not all(isinstance(v, (int, float)) for v in value):
        raise ConfigError(f"config.json: {key} must be a list of {count} numbers, got {value!r}")
    return tuple(float(v) for v in value)


def parse_falcon_h1_scales(raw: dict[str, Any]) -> FalconH1Scales:
    """Falcon-H1's multipliers; ConfigError on biases (none implemented)."""
    for key in ("attention_bias", "mlp_bias", "projectors_bias"):
        if raw.get(key):
            raise ConfigError(f"{key}=true is not supported for FalconH1")
    gate, down = _floats(raw, "mlp_multipliers", 2)

    def one(key: str) -> float:
        value = raw.get(key)
        return 1.0 if value is None else float(value)

    return FalconH1Scales(key=one("key_multiplier"), attention_in=one("attention_in_multiplier"),
                          attention_out=one("attention_out_multiplier"), ssm_in=one("ssm_in_multiplier"),
                          ssm_out=one("ssm_out_multiplier"), ssm=_floats(raw, "ssm_multipliers", 5), mlp_gate=gate,
                          mlp_down=down)
