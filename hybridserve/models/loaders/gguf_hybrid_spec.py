"""What the GGUF specs of recurrent hybrids (Falcon-H1, Jamba) add to gguf_spec.py: the HF name
of their final norm, and the merges for the mixer tensors llama.cpp's converter reshapes,
transforms or stores under a bare name (no `.weight` suffix).

llama.cpp's conventions for Mamba-style mixers (its converter's Mamba, Mamba2, Falcon-H1 and
Jamba classes, and the tensor shapes its runtime loads):
- `blk.N.ssm_a` (bare) holds A = -exp(A_log); Mamba2 mixers append a unit axis ([H] -> [H, 1]),
  Mamba1 mixers keep HF's [I, N].
- `blk.N.ssm_d` (bare) holds D; Mamba2's also gains the unit axis.
- `blk.N.ssm_conv1d.weight` is HF's depthwise [C, 1, K] with the unit axis squeezed: [C, K].
Shapes here are numpy order (ggml's reversed), as gguf_header reports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from hybridserve.models.loaders.gguf_spec import (COMMON_BLOCK_NAMES, ArchSpec, BlockMerge, Shape, a_log_from_a, reshaped,
                                                  unsqueezed_conv)

OUTPUT_NORM_TENSOR = "output_norm.weight"
# Llama's block names with the MLP where Falcon-H1 and Jamba keep it (feed_forward., not mlp.).
FEED_FORWARD_BLOCK_NAMES = {stem: hf.replace("mlp.", "feed_forward.") for stem, hf in COMMON_BLOCK_NAMES.items()}


@dataclass(frozen=True)
class HybridArchSpec(ArchSpec):
    """An ArchSpec whose final norm is `final_norm` in HF (model.final_layernorm for Falcon-H1
    and Jamba) rather than model.norm; every other name as ArchSpec maps it."""

    final_norm: str = "model.final_layernorm"

    def hf_name(self, gguf_name: str) -> str | None:
        if gguf_name == OUTPUT_NORM_TENSOR:
            return f"{self.final_norm}.weight"
        return super().hf_name(gguf_name)


def flat(shape: Shape) -> Shape:
    return (int(np.prod(shape)),)


def mixer_merges(mixer: str, state_shape: Callable[[Shape], Shape]) -> tuple[BlockMerge, ...]:
    """The A, D and conv weight of a mixer at HF prefix `mixer` ("mamba."); `state_shape` maps
    the stored A's shape to HF's A_log shape (D follows: HF's D is A_log's first axis)."""
    return (
        reshaped(f"{mixer}A_log", "ssm_a", hf_shape=state_shape, values=a_log_from_a),
        reshaped(f"{mixer}D", "ssm_d", hf_shape=lambda s: (s[0],)),
        unsqueezed_conv(f"{mixer}conv1d.weight", "ssm_conv1d.weight"),
    )
