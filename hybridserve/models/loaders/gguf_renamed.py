"""An ArchSpec for HF checkpoints whose names are not rooted as most are (`model.embed_tokens`,
`model.layers.N.`, `model.norm`): Mamba2ForCausalLM and NemotronHForCausalLM root theirs at
`backbone.` (`backbone.embeddings`, `backbone.layers.N.`, `backbone.norm_f`; the head stays
`lm_head`) and put every block, attention included, under `mixer.`; Bamba names its final
norm `model.final_layernorm`.

The spec plans as any other (HF names under `model.`), then renames each planned tensor by
the first of `renames` whose prefix it starts with; Q/K rows are restored wherever the query
and key projections sit (`mixer.q_proj` too), not only under `self_attn.`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from hybridserve.models.loaders.gguf_header import GGUFHeader
from hybridserve.models.loaders.gguf_spec import ArchSpec, PlannedTensor, unpermute_rope_rows

BACKBONE_RENAMES = (("model.embed_tokens.", "backbone.embeddings."), ("model.norm.", "backbone.norm_f."),
                    ("model.layers.", "backbone.layers."))


@dataclass(frozen=True)
class RenamedArchSpec(ArchSpec):
    """ArchSpec whose planned names are renamed by prefix (see the module docstring)."""

    renames: tuple[tuple[str, str], ...] = ()  # (old prefix, new prefix)

    def renamed(self, hf_name: str) -> str:
        for old, new in self.renames:
            if hf_name.startswith(old):
                return new + hf_name[len(old):]
        return hf_name

    def plan(self, header: GGUFHeader) -> list[PlannedTensor]:
        return [replace(tensor, hf_name=self.renamed(tensor.hf_name)) for tensor in super().plan(header)]

    def fix_tensor(self, hf_name: str, values: np.ndarray, config: dict[str, Any]) -> np.ndarray:
        module = hf_name.rpartition(".")[0]
        if self.unpermute_qk and module.endswith((".q_proj", ".k_proj")):
            heads = config["num_attention_heads"] if module.endswith("q_proj") else config["num_key_value_heads"]
            return unpermute_rope_rows(values, heads)
        return super().fix_tensor(hf_name, values, config)
