"""Gemma 3's multimodal checkpoints (`Gemma3ForConditionalGeneration`: 4B, 12B, 27B) served as
text models: the language model is read from under the multimodal prefixes and the vision
tower is left on disk.

Config: the language model's numbers sit in a nested `text_config`, and the published
config.json files state only what differs from `Gemma3TextConfig`'s defaults (gemma-3-4b-it
gives hidden_size, intermediate_size, num_hidden_layers, rope_scaling, sliding_window and
nothing else), so the defaults are filled in here, as transformers fills them; the generation
facts (eos_token_id, tie_word_embeddings) are top-level.

Weights: the published checkpoints store the text model as `language_model.model.*` (its
head, when stored, `language_model.lm_head.weight`); transformers 5's own layout is
`model.language_model.*` with the head at `lm_head.weight`. Both are renamed to the causal-LM
names the decoder loader reads (`model.layers.*`, `model.norm.weight`, ...). The vision tower
and the projector are not mapped at all: they are dropped from the names, so the loader's
check that every stored tensor is used covers the text model only
(models/loaders/gemma3_multimodal_checkpoint.py).
"""

from __future__ import annotations

from typing import Any

from hybridserve.core.errors import ConfigError

ARCHITECTURE = "Gemma3ForConditionalGeneration"

# Gemma3TextConfig's defaults (transformers 4.50 .. 5.x) for what a text_config may omit.
_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6, "attention_bias": False,
    "final_logit_softcapping": None, "attn_logit_softcapping": None,
}



def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The causal-LM config.json of a multimodal Gemma 3 config: its text_config with the
    defaults it omits, the top-level generation facts, and the multimodal architecture name
    kept (so messages name the checkpoint the user gave)."""
    nested = raw.get("text_config")
    if not isinstance(nested, dict):
        raise ConfigError(f"{ARCHITECTURE}: config.json has no text_config object")
    out = {**_TEXT_DEFAULTS, **nested, "architectures": [ARCHITECTURE]}
    for key in ("eos_token_id", "tie_word_embeddings"):
        if key in raw:
            out[key] = raw[key]
    out.setdefault("tie_word_embeddings", True)  # Gemma3Config's default
    return out
