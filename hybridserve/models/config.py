"""Model configuration read from a Hugging Face `config.json`, normalised across versions.

One `ModelConfig` describes every decoder-only architecture hybridserve runs from an HF
directory (Llama, Mistral, Qwen2, Gemma2, Gemma3 text and its multimodal checkpoints' text
model, OLMo 3, Cohere2, EXAONE 4, Llama 4 text; the Llama 4 extras live in
`llama4_config.Llama4Options`). Fields an implementation would
otherwise silently ignore are checked here: anything we do not honour raises ConfigError
naming the field, so a model never runs with wrong numbers.

Config spellings differ across transformers versions; both are accepted:
- layer kinds: `layer_types` (>= 4.5x / 5.x), or derived from `sliding_window`
  (Mistral), `use_sliding_window` + `max_window_layers` (Qwen2) or
  `sliding_window_pattern` (Gemma3, Cohere2, EXAONE 4; Gemma2 alternates);
- RoPE: `rope_parameters` (5.x, possibly one dict per layer type for Gemma3) or
  `rope_theta` + `rope_scaling` (+ `rope_local_base_freq` for Gemma3 local layers).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridserve.core.errors import ConfigError
from hybridserve.models.arch import gemma3_multimodal
from hybridserve.models.arch.gpt_oss_config import GptOssOptions, parse_gpt_oss_options
from hybridserve.models.arch.jamba_config import JambaOptions, jamba_layer_types, parse_jamba_options
from hybridserve.models.arch.lfm2_config import (ShortConvConfig, lfm2_intermediate_size, lfm2_layer_types,
                                                 parse_short_conv)
from hybridserve.models.arch.llama4_config import CHUNKED, Llama4Options, llama4_layer_types, parse_llama4_options
from hybridserve.models.arch.mamba_config import (
    MAMBA,
    MambaMixerConfig,
    bamba_attention_layers,
    parse_bamba_mixer,
    parse_falcon_h1_mixer,
    parse_mamba2_mixer,
    parse_nemotron_h_mixer,
)
from hybridserve.models.arch.mamba_hybrid_config import (HybridOptions, granite_layer_kinds, granite_uses_rope,
                                                         nemotron_h_layer_kinds, parse_falcon_h1_scales,
                                                         parse_granite_options, parse_nemotron_h_options)
from hybridserve.models.arch.qwen3_next_config import (
    LINEAR,
    GatedDeltaNetConfig,
    Qwen3NextMoE,
    dense_feed_forward,
    parse_gated_deltanet,
    parse_qwen3_next_moe,
    qwen3_next_layer_types,
)

FULL = "full_attention"
SLIDING = "sliding_attention"
__all__ = ["CHUNKED", "FULL", "LINEAR", "SLIDING", "ModelConfig", "RopeConfig", "load_model_config",
           "parse_model_config"]

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    gemma3_multimodal.ARCHITECTURE: "gemma3",  # its language model only (models/arch/gemma3_multimodal.py)
    "Olmo3ForCausalLM": "olmo3",
    "Cohere2ForCausalLM": "cohere2",
    "Exaone4ForCausalLM": "exaone4",
    "Llama4ForCausalLM": "llama4",
    "GptOssForCausalLM": "gpt_oss",  # attention sinks and MoE: models/arch/gpt_oss.py
    # State-space models: mixer parsed by models/arch/mamba_config.py, built by models/loaders/mamba_loader.py.
    "Mamba2ForCausalLM": "mamba2",
    "BambaForCausalLM": "bamba",
    # Short convolution layers + attention: models/arch/lfm2_config.py, models/loaders/lfm2_loader.py.
    "Lfm2ForCausalLM": "lfm2",
    # Mamba1 + attention without RoPE + MoE: models/arch/jamba_config.py, models/loaders/jamba_loader.py.
    "JambaForCausalLM": "jamba",
    "GraniteMoeHybridForCausalLM": "granite_hybrid",  # Bamba's layer with experts and scales: mamba_hybrid_config.py
    "NemotronHForCausalLM": "nemotron_h",  # Mamba2, attention or MLP layers by pattern: mamba_hybrid_config.py
    "FalconH1ForCausalLM": "falcon_h1",  # Mamba2 beside attention in every layer: models/arch/falcon_h1.py
    # Gated DeltaNet + gated attention + MoE: models/arch/qwen3_next_config.py and qwen3_next.py.
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_5",  # Qwen3-Next's layers with a dense MLP in each (text only)
}
_GEMMA = ("gemma2", "gemma3")
# Without layer_types: one full layer after every `pattern - 1` sliding ones.
_DEFAULT_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6, "olmo3": 4, "cohere2": 4, "exaone4": 4, "gpt_oss": 2}
# HF activation names -> ours. gelu_pytorch_tanh is the tanh approximation of GELU.
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                "gelu": "gelu", "gelu_tanh": "gelu_tanh"}
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of one layer type (NeoX half-split layout, as HF applies it)."""

    theta: float
    rope_type: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # "yarn" (models/layers/yarn.py): the frequency band ramped between kept and divided, and the
    # cos/sin scale (None: derived from factor, mscale and mscale_all_dim as HF does).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None


@dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder needs; derived fields are final (no further defaults apply)."""

    architecture: str
    family: str  # llama | mistral | ... | mamba2 | bamba | lfm2 | jamba (SUPPORTED_ARCHITECTURES' values)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    activation: str  # silu | gelu_tanh | gelu | relu2 (Nemotron-H: relu(x)^2)
    # FULL, SLIDING, CHUNKED, MAMBA (mamba_config.py), SHORT_CONV (lfm2_config.py), MAMBA1
    # (jamba_config.py), LINEAR (qwen3_next_config.py) or MLP_ONLY (mamba_hybrid_config.py), one per layer
    layer_types: tuple[str, ...]
    sliding_window: int | None
    rope: dict[str, RopeConfig]  # keyed by layer type; a type left out has no RoPE (Cohere2 / EXAONE 4 full layers)
    max_position_embeddings: int
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Gemma3, EXAONE 4: RMSNorm over head_dim on q and k before RoPE
    qk_norm_over_projection: bool = False  # OLMo 3: that RMSNorm over all heads of q (of k) at once
    gemma_norm: bool = False  # RMSNorm multiplies by (1 + w)
    sandwich_norm: bool = False  # Gemma2/3: norms after attention and around the MLP
    post_norm: bool = False  # OLMo 3, EXAONE 4: no input norm; attention and MLP outputs normed before the add
    parallel_block: bool = False  # Cohere2: attention and MLP read one normed input, added to h together
    logit_scale: float = 1.0  # Cohere2: the logits are multiplied by it
    embed_scale: float = 1.0
    attn_scale: float = 1.0
    attn_softcap: float | None = None
    final_softcap: float | None = None
    tie_word_embeddings: bool = False
    eos_token_id: int | list[int] | None = None
    attention_chunk_size: int | None = None  # CHUNKED layers: a query at p reads (p // C) * C .. p
    llama4: Llama4Options | None = None  # family "llama4" only
    gpt_oss: GptOssOptions | None = None  # family "gpt_oss" only
    # State-space models (Mamba2, Bamba): the mixer of every "mamba" layer in layer_types.
    mamba: MambaMixerConfig | None = None
    # LFM2: the short convolution of every "conv" layer in layer_types (lfm2_config.py).
    short_conv: ShortConvConfig | None = None
    # Jamba: the Mamba1 mixer of every "mamba1" layer and the expert layers (jamba_config.py).
    jamba: JambaOptions | None = None
    # Dims of each head RoPE rotates (the first ones); None: all of head_dim (Bamba: half).
    rotary_dim: int | None = None
    # Mamba2 hybrids past Bamba (Granite 4.0-H, Nemotron-H): their scales, experts and MLP form.
    hybrid: HybridOptions | None = None
    # Qwen3-Next: the Gated DeltaNet of every LINEAR layer, and the feed-forward of every layer.
    gated_deltanet: GatedDeltaNetConfig | None = None
    qwen3_next_moe: Qwen3NextMoE | None = None


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read `<model_dir>/config.json` and normalise it; ConfigError on anything unsupported."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no config.json in {model_dir}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON ({exc})") from None
    return parse_model_config(raw)


def parse_model_config(raw: dict[str, Any]) -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ConfigError(
            f"unsupported architecture {archs or raw.get('model_type')!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if arch == gemma3_multimodal.ARCHITECTURE:
        raw = gemma3_multimodal.text_config(raw)
    family = SUPPORTED_ARCHITECTURES[arch]
    if family == "mamba2":
        return _parse_mamba2(raw, arch)
    if family in ("bamba", "granite_hybrid"):
        return _parse_bamba(raw, arch)
    if family == "lfm2":
        return _parse_lfm2(raw, arch)
    if family == "jamba":
        return _parse_jamba(raw, arch)
    if family == "nemotron_h":
        return _parse_nemotron_h(raw, arch)
    if family == "falcon_h1":
        return _parse_falcon_h1(raw, arch)
    if family in ("qwen3_next", "qwen3_5"):
        return _parse_qwen3_next(raw, arch, family)
    num_layers = _req_int(raw, "num_hidden_layers")
    num_heads = _req_int(raw, "num_attention_heads")
    hidden = _req_int(raw, "hidden_size")
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    head_dim = int(raw.get("head_dim") or hidden // num_heads)
    if family == "cohere2":
        head_dim = hidden // num_heads  # HF's Cohere2Config sets it so, whatever config.json says
    if num_heads % num_kv_heads:
        raise ConfigError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    _check_unhonoured(raw, family)
    llama4 = parse_llama4_options(raw, num_layers, _req_int(raw, "intermediate_size")) if family == "llama4" else None
    chunk = None
    if llama4 is not None:
        layer_types, chunk = llama4_layer_types(raw, llama4)
    else:
        layer_types = _layer_types(raw, family, num_layers)
    window = raw.get("sliding_window") if SLIDING in layer_types else None
    if SLIDING in layer_types and (not isinstance(window, int) or window < 1):
        raise ConfigError(f"sliding layers need a positive integer sliding_window, got {window!r}")
    act_name = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if act_name not in _ACTIVATIONS:
        raise ConfigError(f"unsupported activation {act_name!r} (hidden_act / hidden_activation)")
    gemma = family in _GEMMA
    attn_scale = head_dim**-0.5
    if gemma:
        attn_scale = float(raw.get("query_pre_attn_scalar") or head_dim) ** -0.5
    bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        family=family,
        vocab_size=_req_int(raw, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_req_int(raw, "intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_norm_eps(raw, family),
        activation=_ACTIVATIONS[act_name],
        layer_types=layer_types,
        sliding_window=window,
        rope=_rope_configs(raw, family, set(layer_types)),
        max_position_embeddings=int(raw.get("max_position_embeddings") or 8192),
        qkv_bias=True if family == "qwen2" else bias,
        o_bias=bias if family != "qwen2" else False,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=family in ("gemma3", "olmo3", "exaone4"),
        qk_norm_over_projection=family == "olmo3",
        gemma_norm=gemma,
        sandwich_norm=gemma,
        post_norm=family in ("olmo3", "exaone4"),
        parallel_block=family == "cohere2",
        logit_scale=float(raw.get("logit_scale", 0.0625)) if family == "cohere2" else 1.0,
        embed_scale=math.sqrt(hidden) if gemma else 1.0,
        attn_scale=attn_scale,
        attn_softcap=raw.get("attn_logit_softcapping") if gemma else None,
        final_softcap=raw.get("final_logit_softcapping") if gemma else None,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma or family == "cohere2")),
        eos_token_id=raw.get("eos_token_id"),
        attention_chunk_size=chunk,
        llama4=llama4,
        gpt_oss=parse_gpt_oss_options(raw) if family == "gpt_oss" else None,
    )


def _parse_mamba2(raw: dict[str, Any], arch: str) -> ModelConfig:
    """Every layer a Mamba2 mixer: the attention fields are 0 and the rope table empty."""
    mixer = parse_mamba2_mixer(raw)
    num_layers = _req_int(raw, "num_hidden_layers")
    return ModelConfig(
        architecture=arch, family="mamba2", vocab_size=_req_int(raw, "vocab_size"),
        hidden_size=_req_int(raw, "hidden_size"), intermediate_size=0, num_layers=num_layers, num_heads=0,
        num_kv_heads=0, head_dim=0, rms_norm_eps=mixer.norm_eps, activation="silu",
        layer_types=(MAMBA,) * num_layers, sliding_window=None, rope={},
        max_position_embeddings=int(raw.get("max_position_embeddings") or 1 << 20),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), eos_token_id=raw.get("eos_token_id"),
        mamba=mixer,
    )


def _parse_bamba(raw: dict[str, Any], arch: str) -> ModelConfig:
    """Mamba2 mixers with a few full-attention layers, a SwiGLU MLP after every layer; Granite
    4.0-H (the same mixer fields) adds its scales and experts and lists its layer kinds."""
    mixer = parse_bamba_mixer(raw)
    hidden = _req_int(raw, "hidden_size")
    num_layers = _req_int(raw, "num_hidden_layers")
    granite = SUPPORTED_ARCHITECTURES[arch] == "granite_hybrid"
    if granite:
        layer_types = granite_layer_kinds(raw, num_layers)
    else:
        attn_layers = bamba_attention_layers(raw, num_layers)
        layer_types = tuple(FULL if i in attn_layers else MAMBA for i in range(num_layers))
    num_heads, num_kv_heads, head_dim = _attention_heads(raw, hidden)
    rope_raw = dict(raw.get("rope_parameters") or {"rope_theta": raw.get("rope_theta", 10_000.0)})
    # HF's Bamba rotates half of each head whatever the config says (hard-coded there).
    rope_raw.pop("partial_rotary_factor", None)
    rope = {FULL: _one_rope(rope_raw, "rope_parameters")}
    extra: dict[str, Any] = dict(rotary_dim=head_dim // 2, attn_scale=head_dim**-0.5)
    if granite:
        options = parse_granite_options(raw)
        rope = rope if granite_uses_rope(raw) else {}
        extra = dict(hybrid=options, embed_scale=float(raw.get("embedding_multiplier") or 1.0),
                     attn_scale=float(raw.get("attention_multiplier") or 1.0))
    return ModelConfig(
        architecture=arch, family=SUPPORTED_ARCHITECTURES[arch], vocab_size=_req_int(raw, "vocab_size"),
        hidden_size=hidden, intermediate_size=_req_int(raw, "shared_intermediate_size" if granite else
                                                       "intermediate_size"),
        num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        rms_norm_eps=mixer.norm_eps, activation="silu", layer_types=layer_types, sliding_window=None, rope=rope,
        max_position_embeddings=int(raw.get("max_position_embeddings") or 8192),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), eos_token_id=raw.get("eos_token_id"),
        mamba=mixer, **extra,
    )


def _parse_nemotron_h(raw: dict[str, Any], arch: str) -> ModelConfig:
    """One block per layer by pattern: a Mamba2 mixer, attention without RoPE, or a
    squared-ReLU MLP, each as h += block(norm(h))."""
    mixer = parse_nemotron_h_mixer(raw)
    layer_types = nemotron_h_layer_kinds(raw)
    hidden = _req_int(raw, "hidden_size")
    # Older Nemotron-H files name head_dim attention_head_dim.
    named_head_dim = {"head_dim": raw.get("head_dim") or raw.get("attention_head_dim")}
    num_heads, num_kv_heads, head_dim = _attention_heads({**raw, **named_head_dim}, hidden)
    return ModelConfig(
        architecture=arch, family="nemotron_h", vocab_size=_req_int(raw, "vocab_size"), hidden_size=hidden,
        intermediate_size=_req_int(raw, "intermediate_size"), num_layers=len(layer_types), num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, rms_norm_eps=mixer.norm_eps, activation="relu2",
        layer_types=layer_types, sliding_window=None, rope={},
        max_position_embeddings=int(raw.get("max_position_embeddings") or 4096), attn_scale=head_dim**-0.5,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), eos_token_id=raw.get("eos_token_id"),
        mamba=mixer, hybrid=parse_nemotron_h_options(raw),
    )


def _parse_falcon_h1(raw: dict[str, Any], arch: str) -> ModelConfig:
    """N decoder layers as 2N cache layers: 2j full attention (RoPE on all of each head), 2j + 1
    the Mamba2 mixer beside it (HybridOptions.falcon); num_layers counts the 2N."""
    mixer = parse_falcon_h1_mixer(raw)
    scales = parse_falcon_h1_scales(raw)
    hidden = _req_int(raw, "hidden_size")
    num_layers = _req_int(raw, "num_hidden_layers")
    num_heads, num_kv_heads, head_dim = _attention_heads(raw, hidden)
    rope_raw = raw.get("rope_parameters") or {"rope_theta": raw.get("rope_theta", 10_000.0)}
    return ModelConfig(
        architecture=arch, family="falcon_h1", vocab_size=_req_int(raw, "vocab_size"), hidden_size=hidden,
        intermediate_size=_req_int(raw, "intermediate_size"), num_layers=2 * num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, rms_norm_eps=mixer.norm_eps, activation="silu",
        layer_types=(FULL, MAMBA) * num_layers, sliding_window=None,
        rope={FULL: _one_rope(rope_raw, "rope_parameters")},
        max_position_embeddings=int(raw.get("max_position_embeddings") or 8192), attn_scale=head_dim**-0.5,
        embed_scale=float(raw.get("embedding_multiplier") or 1.0),
        logit_scale=float(raw.get("lm_head_multiplier") or 1.0),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), eos_token_id=raw.get("eos_token_id"),
        mamba=mixer, hybrid=HybridOptions(falcon=scales),
    )


def _parse_lfm2(raw: dict[str, Any], arch: str) -> ModelConfig:
    """Short convolution layers and GQA attention (q / k RMSNorm per head, RoPE), a SwiGLU
    MLP after every layer."""
    hidden = _req_int(raw, "hidden_size")
    num_layers = _req_int(raw, "num_hidden_layers")
    num_heads, num_kv_heads, head_dim = _attention_heads(raw, hidden)
    rope_raw = dict(raw.get("rope_parameters") or {"rope_theta": raw.get("rope_theta", 1_000_000.0)})
    return ModelConfig(
        architecture=arch, family="lfm2", vocab_size=_req_int(raw, "vocab_size"), hidden_size=hidden,
        intermediate_size=lfm2_intermediate_size(raw), num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, rms_norm_eps=float(raw.get("norm_eps", 1e-5)),
        activation="silu", layer_types=lfm2_layer_types(raw, num_layers), sliding_window=None,
        rope={FULL: _one_rope(rope_raw, "rope_parameters")},
        max_position_embeddings=int(raw.get("max_position_embeddings") or 128_000), qk_norm=True,
        attn_scale=head_dim**-0.5,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", raw.get("tie_embedding", True))),
        eos_token_id=raw.get("eos_token_id"), short_conv=parse_short_conv(raw, hidden),
    )


def _parse_jamba(raw: dict[str, Any], arch: str) -> ModelConfig:
    """Mamba1 mixers with a few attention layers (no RoPE: the rope table is empty), a SwiGLU
    MLP or a mixture of experts after every layer."""
    hidden = _req_int(raw, "hidden_size")
    num_layers = _req_int(raw, "num_hidden_layers")
    num_heads, num_kv_heads, head_dim = _attention_heads(raw, hidden)
    return ModelConfig(
        architecture=arch, family="jamba", vocab_size=_req_int(raw, "vocab_size"), hidden_size=hidden,
        intermediate_size=_req_int(raw, "intermediate_size"), num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        activation="silu", layer_types=jamba_layer_types(raw, num_layers), sliding_window=None, rope={},
        max_position_embeddings=int(raw.get("max_position_embeddings") or 262_144), attn_scale=head_dim**-0.5,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), eos_token_id=raw.get("eos_token_id"),
        jamba=parse_jamba_options(raw, hidden, num_layers),
    )


def _attention_heads(raw: dict[str, Any], hidden: int) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim) of a hybrid's attention layers."""
    num_heads = _req_int(raw, "num_attention_heads")
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads:
        raise ConfigError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    return num_heads, num_kv_heads, int(raw.get("head_dim") or hidden // num_heads)


def _parse_qwen3_next(raw: dict[str, Any], arch: str, family: str) -> ModelConfig:
    """Gated DeltaNet layers and gated full-attention layers (q/k norms, partial RoPE), all
    norms (1 + w), every feed-forward a mixture of experts or (mlp_only_layers; Qwen3.5) dense.
    Qwen3.5's multimodal RoPE sections (mrope_section) rotate a text position as plain RoPE
    does: a text token's three position components are equal."""
    hidden = _req_int(raw, "hidden_size")
    num_layers = _req_int(raw, "num_hidden_layers")
    num_heads, num_kv_heads, head_dim = _attention_heads(raw, hidden)
    rope_raw = dict(raw.get("rope_parameters") or {"rope_theta": raw.get("rope_theta", 10_000.0)})
    factor = rope_raw.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25))
    rotary_dim = int(head_dim * float(factor))
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ConfigError(f"partial_rotary_factor {factor} gives {rotary_dim} rotary dims of a head of {head_dim}")
    return ModelConfig(
        architecture=arch, family=family, vocab_size=_req_int(raw, "vocab_size"), hidden_size=hidden,
        intermediate_size=_req_int(raw, "intermediate_size"), num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        activation="silu", layer_types=qwen3_next_layer_types(raw, num_layers), sliding_window=None,
        rope={FULL: _one_rope(rope_raw, "rope_parameters")},
        max_position_embeddings=int(raw.get("max_position_embeddings") or 32768), qk_norm=True, gemma_norm=True,
        attn_scale=head_dim**-0.5, tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        eos_token_id=raw.get("eos_token_id"), rotary_dim=rotary_dim, gated_deltanet=parse_gated_deltanet(raw),
        qwen3_next_moe=(parse_qwen3_next_moe(raw, num_layers) if family == "qwen3_next"
                        else dense_feed_forward(num_layers)),
    )


def _norm_eps(raw: dict[str, Any], family: str) -> float:
    if family == "cohere2":  # a LayerNorm (models/arch/cohere2.py), HF's default eps 1e-5
        return float(raw.get("layer_norm_eps", 1e-5))
    return float(raw.get("rms_norm_eps", 1e-6))


def _req_int(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def _check_unhonoured(raw: dict[str, Any], family: str) -> None:
    """Fields that change the numbers and that this implementation does not implement."""
    if raw.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention=true is not supported (causal decoding only)")
    if int(raw.get("pretraining_tp") or 1) != 1:
        raise ConfigError(f"pretraining_tp={raw['pretraining_tp']} is not supported")
    if raw.get("partial_rotary_factor", 1.0) not in (None, 1, 1.0):
        raise ConfigError(f"partial_rotary_factor={raw['partial_rotary_factor']} is not supported")
    if raw.get("attention_chunk_size") and family != "llama4":
        raise ConfigError(f"attention_chunk_size is not supported for {family}")
    if family == "mistral" and raw.get("layer_types"):
        # HF's Mistral ignores layer_types and slides every layer; refusing avoids guessing.
        if any(t != SLIDING for t in raw["layer_types"]) or raw.get("sliding_window") is None:
            raise ConfigError("MistralForCausalLM with mixed layer_types is not supported (use Ministral)")


def _layer_types(raw: dict[str, Any], family: str, num_layers: int) -> tuple[str, ...]:
    window = raw.get("sliding_window")
    if family == "qwen2" and not raw.get("use_sliding_window", False):
        window = None  # Qwen2 ignores sliding_window unless use_sliding_window is set
    given = raw.get("layer_types")
    if given is not None and family != "mistral":
        if len(given) != num_layers:
            raise ConfigError(f"layer_types has {len(given)} entries for {num_layers} layers")
        bad = sorted({t for t in given if t not in (FULL, SLIDING)})
        if bad:
            raise ConfigError(f"unsupported layer type(s) {bad} in layer_types")
        if window is None and SLIDING in given:
            return tuple(FULL for _ in given)  # HF: a sliding layer without a window is full
        return tuple(given)
    if family in ("llama",):
        return tuple(FULL for _ in range(num_layers))
    if family == "mistral":
        return tuple((SLIDING if window is not None else FULL) for _ in range(num_layers))
    if family == "qwen2":
        max_window_layers = int(raw.get("max_window_layers", num_layers))
        return tuple(SLIDING if window is not None and i >= max_window_layers else FULL for i in range(num_layers))
    if family in ("olmo3", "cohere2", "exaone4") and window is None:
        return tuple(FULL for _ in range(num_layers))  # HF: no window, no sliding layer
    pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern")
    if family in ("gemma2", "olmo3", "gpt_oss") or not pattern:
        pattern = _DEFAULT_SLIDING_PATTERN[family]
    if isinstance(pattern, str):  # EXAONE 4 spells it as letters, e.g. "LLLG": local, local, local, global
        if not pattern or set(pattern) - {"L", "G"}:
            raise ConfigError(f"sliding_window_pattern {pattern!r}: expected letters L (local) and G (global)")
        return tuple(SLIDING if pattern[i % len(pattern)] == "L" else FULL for i in range(num_layers))
    return tuple(SLIDING if (i + 1) % int(pattern) else FULL for i in range(num_layers))


def _rope_configs(raw: dict[str, Any], family: str, layer_types: set[str]) -> dict[str, RopeConfig]:
    tables = _rope_tables(raw, family, layer_types)
    # Cohere2's full layers never rotate; EXAONE 4's do not once the model has a window (HF:
    # RoPE where sliding_window is None or the layer slides).
    if family == "cohere2" or (family == "exaone4" and raw.get("sliding_window") is not None):
        tables.pop(FULL, None)
    return tables


def _rope_tables(raw: dict[str, Any], family: str, layer_types: set[str]) -> dict[str, RopeConfig]:
    params = raw.get("rope_parameters")
    if family == "olmo3" and not (isinstance(params, dict) and (FULL in params or SLIDING in params)):
        # transformers < 5 spelling: rope_scaling scales the full layers only (Olmo3Config).
        full = dict(params or raw.get("rope_scaling") or {})
        full.setdefault("rope_theta", raw.get("rope_theta", 500_000.0))
        local = {"rope_theta": full["rope_theta"]}
        return {FULL: _one_rope(full, "rope_parameters.full_attention"),
                SLIDING: _one_rope(local, "rope_parameters.sliding_attention")}
    if family == "gemma3":
        if isinstance(params, dict) and (FULL in params or SLIDING in params):
            full = params.get(FULL) or {"rope_theta": 1_000_000.0}
            local = params.get(SLIDING) or {"rope_theta": 10_000.0}
        else:
            full = dict(params or raw.get("rope_scaling") or {})
            full.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))
            local = {"rope_theta": raw.get("rope_local_base_freq", 10_000.0)}
        return {FULL: _one_rope(full, "rope_parameters.full_attention"),
                SLIDING: _one_rope(local, "rope_parameters.sliding_attention")}
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        out = {t: _one_rope(params[t], f"rope_parameters.{t}") for t in (FULL, SLIDING) if t in params}
        missing = layer_types - set(out)
        if missing:
            raise ConfigError(f"rope_parameters has no entry for layer type(s) {sorted(missing)}")
        return out
    if isinstance(params, dict):
        one = dict(params)
    else:
        one = dict(raw.get("rope_scaling") or {})
    one.setdefault("rope_theta", raw.get("rope_theta", 500_000.0 if family == "llama4" else 10_000.0))
    rope = _one_rope(one, "rope_parameters" if params else "rope_scaling")
    return {FULL: rope, SLIDING: rope, CHUNKED: rope}


def _one_rope(p: dict[str, Any], where: str) -> RopeConfig:
    rope_type = p.get("rope_type") or p.get("type") or "default"
    if rope_type not in _ROPE_TYPES:
        raise ConfigError(f"{where}: rope_type {rope_type!r} is not supported (supported: {', '.join(_ROPE_TYPES)})")
    if p.get("partial_rotary_factor", 1.0) not in (None, 1, 1.0):
        raise ConfigError(f"{where}: partial_rotary_factor={p['partial_rotary_factor']} is not supported")
    theta = p.get("rope_theta")
    if theta is None:
        raise ConfigError(f"{where}: rope_theta is missing")
    factor = float(p.get("factor", 1.0) or 1.0)
    if rope_type == "default":
        factor = 1.0
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=factor,
        low_freq_factor=float(p.get("low_freq_factor", 1.0)),
        high_freq_factor=float(p.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(p.get("original_max_position_embeddings", 8192)),
        **(_yarn_fields(p, where) if rope_type == "yarn" else {}),
    )


def _yarn_fields(p: dict[str, Any], where: str) -> dict[str, Any]:
    if p.get("original_max_position_embeddings") is None:  # YaRN's band depends on it: no default
        raise ConfigError(f"{where}: rope_type 'yarn' needs original_max_position_embeddings")

    def number(key: str) -> float | None:
        return None if p.get(key) is None else float(p[key])

    return dict(beta_fast=float(p.get("beta_fast") or 32.0), beta_slow=float(p.get("beta_slow") or 1.0),
                truncate=bool(p.get("truncate", True)), attention_factor=number("attention_factor"),
                mscale=number("mscale"), mscale_all_dim=number("mscale_all_dim"))
