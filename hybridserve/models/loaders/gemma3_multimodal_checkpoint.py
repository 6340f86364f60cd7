"""A multimodal Gemma 3 checkpoint seen as its text model (models/arch/gemma3_multimodal.py
says which names are which): the published `language_model.model.*` and transformers 5's
`model.language_model.*` renamed to the causal-LM names the decoder loader reads, the vision
tower and projector left out of the names."""

from __future__ import annotations

import torch

from hybridserve.core.errors import ConfigError
from hybridserve.models.arch.gemma3_multimodal import ARCHITECTURE
from hybridserve.models.loaders.file_rows import FileRows
from hybridserve.models.loaders.safetensors_map import MappedCheckpoint

# Prefix of the text model's tensors -> the causal-LM name it stands for, longest first.
_TEXT_PREFIXES = (
    ("language_model.lm_head.", "lm_head."),
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("lm_head.", "lm_head."),
)
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


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
