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
check that every stored tensor is used covers the text model only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybridserve.core.errors import ConfigError

if TYPE_CHECKING:  # config.py reads this module's config half in processes that never load torch
    import torch

    from hybridserve.models.loaders.file_rows import FileRows
    from hybridserve.models.loaders.safetensors_map import MappedCheckpoint

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
# Prefix of the text model's tensors -> the causal-LM name it stands for, longest first.
_TEXT_PREFIXES = (
    ("language_model.lm_head.", "lm_head."),
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("lm_head.", "lm_head."),
)
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


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


class TextCheckpoint:
    """A multimodal checkpoint seen as its text model: names renamed as the module docstring
    says, vision tensors absent. Same interface as MappedCheckpoint."""

    def __init__(self, checkpoint: MappedCheckpoint) -> None:
        self._inner = checkpoint
        self._stored: dict[str, str] = {}  # causal-LM name -> stored name
        for name in checkpoint.names():
            if name.startswith(_VISION_PREFIXES):
                continue
            renamed = _renamed(name)
            if renamed is None:
                raise ConfigError(f"{ARCHITECTURE}: tensor {name} is neither the language model's nor the "
                                  "vision tower's")
            self._stored[renamed] = name

    def names(self) -> list[str]:
        return list(self._stored)

    def tensor(self, name: str) -> torch.Tensor:
        return self._inner.tensor(self._stored[name])

    def release(self, name: str, rows: tuple[int, int] | None = None) -> None:
        self._inner.release(self._stored[name], rows)

    def row_reader(self, name: str) -> FileRows:
        return self._inner.row_reader(self._stored[name])


def _renamed(name: str) -> str | None:
    for prefix, replacement in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return None
