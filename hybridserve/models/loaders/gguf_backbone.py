"""An ArchSpec for HF checkpoints rooted at `backbone.` (Mamba2ForCausalLM, NemotronHForCausalLM).

Those checkpoints name the embedding `backbone.embeddings`, the layers `backbone.layers.N.`
and the final norm `backbone.norm_f` (the head stays `lm_head`), and put every block,
attention included, under `mixer.`. The spec plans as any other (HF names under `model.`),
then renames each planned tensor; Q/K rows are restored wherever the query and key
projections sit (`mixer.q_proj` here), not only under `self_attn.`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from hybridserve.models.loaders.gguf_header import GGUFHeader
from hybridserve.models.loaders.gguf_spec import ArchSpec, PlannedTensor, unpermute_rope_rows

_RENAMES = (("model.embed_tokens.", "backbone.embeddings."), ("model.norm.", "backbone.norm_f."),
            ("model.layers.", "backbone.layers."))


def backbone_name(hf_name: str) -> str:
    """`model.`-rooted HF name -> the `backbone.`-rooted one (lm_head unchanged)."""
    for old, new in _RENAMES:
        if hf_name.startswith(old):
            return new + hf_name[len(old):]
    return hf_name


@dataclass(frozen=True)
class BackboneArchSpec(ArchSpec):
    """ArchSpec whose checkpoint is rooted at `backbone.` (see the module docstring)."""

    def plan(self, header: GGUFHeader) -> list[PlannedTensor]:
        return [replace(tensor, hf_name=backbone_name(tensor.hf_name)) for tensor in super().plan(header)]

    def fix_tensor(self, hf_name: str, values: np.ndarray, config: dict[str, Any]) -> np.ndarray:
        module = hf_name.rpartition(".")[0]
        if self.unpermute_qk and module.endswith((".q_proj", ".k_proj")):
            heads = config["num_attention_heads"] if module.endswith("q_proj") else config["num_key_value_heads"]
            return unpermute_rope_rows(values, heads)
        return super().fix_tensor(hf_name, values, config)
