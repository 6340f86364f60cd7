"""The tiny Gemma 3 with int8 layers (sandwich norms, q/k norms, GELU, a bfloat16 KV cache)
and one prefill step through it, for the int8 chains' tests."""

from __future__ import annotations

import torch

from hybridserve.models.layers import smoothing
from hybridserve.models.loaders.loader import load_model
from tests.helpers import hf_tiny

# Three sequences, 150 rows in one step: past compiled_chains.DEFAULT_MIN_ROWS, so the compiled chains serve.
LENGTHS = [61, 50, 39]


def toy_encode(text: str) -> list[int]:
    """A tokenizer for the tiny models (vocabulary 256): BOS, then one id per byte."""
    return [2] + [b % 256 for b in text.encode()]


def int8_model(compile: bool = True):  # type: ignore[no-untyped-def]
    return load_model(hf_tiny.tiny_model_dir("gemma3"), "cpu", torch.bfloat16, "int8", encode=toy_encode,
                      compile=compile)


def prefill(model, lengths: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The final hidden of one step over `lengths` sequences of random ids."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 256, (sum(lengths),), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])
    backend = smoothing._SequencesAttention(lengths, model.cfg.attn_scale, model.cfg.attn_softcap,
                                            torch.device("cpu"))
    with torch.inference_mode():
        return model.forward(ids, positions, int(positions.max()), backend)
