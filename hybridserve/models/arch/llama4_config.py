"""Llama 4 text specifics of a `config.json` (`Llama4ForCausalLM`, model_type llama4_text).

Pure Python (no torch): the engine sizes the KV cache from the layer types before any
weights load. Three per-layer choices are independent of each other:

    layer i:        0      1      2      3      4 ...   (no_rope_layer_interval = 4)
    RoPE            yes    yes    yes    no     yes     no_rope_layers[i] == 1
    attention       chunk  chunk  chunk  full   chunk   RoPE layers are chunked when
                                                        attention_chunk_size is set
    feed-forward    MoE or dense (intermediate_size_mlp): moe_layers / interleave_moe_layer_step

`layer_types` from the file wins over the derivation (as in HF); RoPE follows
`no_rope_layers` whatever the attention type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridserve.core.errors import ConfigError

CHUNKED = "chunked_attention"
_FULL = "full_attention"  # equal to config.FULL (kept local: config.py imports this module)


@dataclass(frozen=True)
class Llama4Options:
    """What a Llama 4 layer does beyond the shared decoder. Tuples have one entry per layer."""

    rope_layers: tuple[bool, ...]  # False: a NoPE layer (no rotary, temperature tuning instead)
    moe_layers: tuple[bool, ...]  # True: router + experts + shared expert; False: dense MLP
    num_experts: int
    num_experts_per_tok: int  # top-k of the router (1 in released Llama 4 models)
    intermediate_size_mlp: int  # dense layers; experts and the shared expert use intermediate_size
    use_qk_norm: bool  # L2 (weightless RMS) norm of q and k, after RoPE, on RoPE layers only
    attn_temperature_tuning: bool  # NoPE layers scale q by 1 + attn_scale * log1p(floor((p+1) / floor_scale))
    floor_scale: float
    temperature_scale: float  # HF's `attn_scale` (not the softmax scale)


def _int_list(raw: dict[str, Any], key: str) -> list[int] | None:
    value = raw.get(key)
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise ConfigError(f"config.json: {key} must be a list of integers, got {value!r}")
    return value


def _pos_int(raw: dict[str, Any], key: str, default: int) -> int:
    value = raw.get(key, default)
    if value is None:
        value = default
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def parse_llama4_options(raw: dict[str, Any], num_layers: int, intermediate_size: int) -> Llama4Options:
    """Llama4Options with HF's defaults for absent keys; ConfigError on inconsistent values."""
    no_rope = _int_list(raw, "no_rope_layers")
    if no_rope is None:
        interval = _pos_int(raw, "no_rope_layer_interval", 4)
        no_rope = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(no_rope) < num_layers:  # HF indexes it by layer: shorter lists are unusable
        raise ConfigError(f"no_rope_layers has {len(no_rope)} entries for {num_layers} layers")
    moe = raw.get("moe_layers")  # unlike no_rope_layers, an empty list means "no MoE layer"
    if moe is not None and (not isinstance(moe, list) or not all(isinstance(v, int) for v in moe)):
        raise ConfigError(f"config.json: moe_layers must be a list of integers, got {moe!r}")
    if moe is None:
        step = _pos_int(raw, "interleave_moe_layer_step", 1)
        moe = list(range(step - 1, num_layers, step))
    num_experts = _pos_int(raw, "num_local_experts", 16)
    top_k = _pos_int(raw, "num_experts_per_tok", 1)
    if top_k > num_experts:
        raise ConfigError(f"num_experts_per_tok {top_k} exceeds num_local_experts {num_experts}")
    floor_scale = raw.get("floor_scale", 8192)
    if not isinstance(floor_scale, (int, float)) or floor_scale <= 0:
        raise ConfigError(f"config.json: floor_scale must be positive, got {floor_scale!r}")
    return Llama4Options(
        rope_layers=tuple(bool(no_rope[i]) for i in range(num_layers)),
        moe_layers=tuple(i in set(moe) for i in range(num_layers)),
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        intermediate_size_mlp=_pos_int(raw, "intermediate_size_mlp", intermediate_size),
        use_qk_norm=bool(raw.get("use_qk_norm", True)),
        attn_temperature_tuning=bool(raw.get("attn_temperature_tuning", True)),
        floor_scale=float(floor_scale),
        temperature_scale=float(raw.get("attn_scale", 0.1)),
    )


def llama4_layer_types(raw: dict[str, Any], opts: Llama4Options) -> tuple[tuple[str, ...], int | None]:
    """(layer types, attention_chunk_size): CHUNKED layers need a positive chunk size."""
    chunk = raw.get("attention_chunk_size")
    if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
        raise ConfigError(f"config.json: attention_chunk_size must be a positive integer, got {chunk!r}")
    given = raw.get("layer_types")
    n = len(opts.rope_layers)
    if given is None:
        types = tuple(CHUNKED if rope and chunk is not None else _FULL for rope in opts.rope_layers)
    else:
        if len(given) != n:
            raise ConfigError(f"layer_types has {len(given)} entries for {n} layers")
        bad = sorted({t for t in given if t not in (_FULL, CHUNKED)})
        if bad:
            raise ConfigError(f"unsupported layer type(s) {bad} in layer_types for Llama 4")
        types = tuple(given)
    if CHUNKED in types and chunk is None:
        raise ConfigError("layer_types has chunked_attention layers but attention_chunk_size is not set")
    return types, (chunk if CHUNKED in types else None)
