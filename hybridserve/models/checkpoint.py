"""Reading an HF checkpoint directory into a model: the mapped safetensors files, tensors
taken by name with shape checks and dtype conversion, and the final placement. Shared by
the decoder loader (loader.py) and the Mamba loader (mamba_loader.py); imports neither.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hybridserve.core.errors import ConfigError
from hybridserve.models.config import ModelConfig
from hybridserve.models.safetensors_map import MappedCheckpoint

# Buffers some checkpoints carry that hold nothing we need (recomputed from the config).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def open_checkpoint(model_dir: Path) -> MappedCheckpoint:
    """The directory's safetensors files (sharded or not), mapped, not read."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no .safetensors weights in {model_dir}")
    return MappedCheckpoint([model_dir / name for name in files])


class Weights:
    """Takes tensors by HF name, checking shape and converting dtype; tracks leftovers.

    A tensor already in the model dtype is returned as a view of the mapped file (no copy)."""

    def __init__(self, checkpoint: MappedCheckpoint, dtype: torch.dtype) -> None:
        self.checkpoint = checkpoint
        self.dtype = dtype
        self._unread = set(checkpoint.names())
        self._taken: list[str] = []

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self._unread:
            raise ConfigError(f"checkpoint is missing tensor {name}")
        self._unread.discard(name)
        self._taken.append(name)
        t = self.checkpoint.tensor(name)
        if tuple(t.shape) != shape:
            raise ConfigError(f"tensor {name} has shape {tuple(t.shape)}, expected {shape}")
        return t.to(self.dtype)

    def discard(self, name: str) -> None:
        """A tensor the model does not need (e.g. a tied head stored anyway)."""
        self._unread.discard(name)

    def leftovers(self) -> list[str]:
        return sorted(k for k in self._unread if not k.endswith(_IGNORED_SUFFIXES))

    def release_taken(self) -> None:
        """Give back the file pages of the tensors taken so far (called per layer, so the load
        holds one layer's source pages at a time); what the model still reads as a view (the
        embedding, unfused weights) is read again, page by page, as it is used."""
        for name in self._taken:
            self.checkpoint.release(name)
        self._taken.clear()

    def release_all(self) -> None:
        """Give back every file page (after packing, which reads the unfused weights again)."""
        for name in self.checkpoint.names():
            self.checkpoint.release(name)


def place_weights(model: torch.nn.Module, cfg: ModelConfig, w: Weights, device: str | torch.device) -> None:
    """After filling: refuse checkpoint tensors nothing read, move to `device`, tie the head."""
    left = w.leftovers()
    if left:
        raise ConfigError(f"checkpoint has {len(left)} tensor(s) this implementation would ignore, e.g. {left[0]}")
    model.to(device)
    if cfg.tie_word_embeddings:
        model.lm_head = model.embed
