"""The README's supported-models table, generated from the code's one list of architectures.

    PYTHONPATH=. python tests/helpers/readme_models.py     # prints the table to paste into README.md

Rows come from `SUPPORTED_ARCHITECTURES` and the GGUF column from the GGUF converter's
`ARCH_SPECS` (the family each spec's files become), imported from whichever module under hybridserve/ defines them. What the
code does not state per architecture (its layer kinds, and which features the test suite
checks against Hugging Face for it) is written below, once per family;
tests/test_readme.py fails when an architecture is added without it.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# family -> (layer kinds, features whose greedy output tests/ checks against HF for it).
# async: sync and async scheduling; spec: n-gram drafts; prefix: prefix-cache hits.
FAMILY_FACTS: dict[str, tuple[str, frozenset[str]]] = {
    "llama": ("full attention", frozenset({"async", "pp", "tp"})),
    "mistral": ("sliding window", frozenset({"async", "spec", "prefix", "pp", "tp"})),
    "qwen2": ("sliding window + full", frozenset({"async", "pp", "tp"})),
    "gemma2": ("sliding window + full, alternating", frozenset({"async", "tp"})),
    "gemma3": ("sliding window + full, 5:1", frozenset({"async", "spec", "prefix", "pp", "tp"})),
    "olmo3": ("sliding window + full, 3:1", frozenset({"async", "spec", "prefix", "pp", "tp"})),
    "cohere2": ("sliding window + full (NoPE), 3:1", frozenset({"async", "spec", "prefix", "pp", "tp"})),
    "exaone4": ("sliding window + full (NoPE), 3:1", frozenset({"async", "spec", "prefix", "pp", "tp"})),
    "gpt_oss": ("sliding window + full, alternating; sinks, MoE", frozenset({"async", "spec", "prefix", "pp", "tp"})),
    "llama4": ("chunked local + full (NoPE), MoE", frozenset({"async", "spec", "prefix", "pp", "tp"})),
    "mamba2": ("Mamba2", frozenset({"async", "spec", "prefix", "pp", "tp"})),
    "bamba": ("Mamba2 + full attention", frozenset({"async", "spec", "prefix", "pp", "tp"})),
    "granite_hybrid": ("Mamba2 + full attention, MoE", frozenset({"async", "spec", "prefix", "pp", "tp"})),
    "nemotron_h": ("Mamba2 + full attention (NoPE) + MLP-only, by pattern",
                   frozenset({"async", "spec", "prefix", "pp", "tp"})),
    "falcon_h1": ("Mamba2 beside full attention in every layer", frozenset({"async", "spec", "prefix", "pp", "tp"})),
    "qwen3_next": ("Gated DeltaNet + gated full, 3:1; MoE", frozenset({"async", "spec", "prefix", "pp", "tp"})),
    "qwen3_5": ("Gated DeltaNet + gated full, 3:1", frozenset({"async", "prefix", "tp"})),
    "lfm2": ("short convolution + full attention", frozenset({"async", "spec", "prefix", "pp", "tp"})),
    "jamba": ("Mamba1 + full attention (NoPE), MoE", frozenset({"async", "spec", "prefix", "pp", "tp"})),
}
FEATURES = (("async", "sync / async"), ("spec", "n-gram spec"), ("prefix", "prefix cache"),
            ("pp", "PP"), ("tp", "TP"))


def _defined(name: str):
    """The value of `name` from the module under hybridserve/ that assigns it at top level."""
    pattern = re.compile(rf"^{name}\s*[:=]", re.M)
    for path in sorted((REPO / "hybridserve").rglob("*.py")):
        if pattern.search(path.read_text()):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            return getattr(importlib.import_module(module), name)
    raise LookupError(f"no module under hybridserve/ defines {name}")


def supported_models_table() -> str:
    """The markdown table, one row per entry of SUPPORTED_ARCHITECTURES, in its order."""
    archs: dict[str, str] = _defined("SUPPORTED_ARCHITECTURES")
    # A spec converting files of several families (granitehybrid: Granite 4.0-H and Bamba) lists them.
    gguf = {family for spec in _defined("ARCH_SPECS").values() for family in getattr(spec, "families", (spec.family,))}
    head = ["`config.json` architecture", "layers"] + [title for _, title in FEATURES] + ["`.gguf`"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arch, family in archs.items():
        if family not in FAMILY_FACTS:
            raise KeyError(f"{arch} (family {family!r}) has no entry in tests/helpers/readme_models.py FAMILY_FACTS")
        layers, tested = FAMILY_FACTS[family]
        cells = [f"`{arch}`", layers] + ["tested" if key in tested else "-" for key, _ in FEATURES]
        cells.append("yes" if family in gguf else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(supported_models_table(), end="")
