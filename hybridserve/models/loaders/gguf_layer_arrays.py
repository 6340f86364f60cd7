"""Per-layer facts of a hybrid GGUF: keys llama.cpp lets a converter write as one number per
layer (`attention.head_count_kv` with 0 off the attention layers, Nemotron-H's
`feed_forward_length` with 0 off its MLP layers), and which tensors the layers hold."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from hybridserve.core.errors import ConfigError
from hybridserve.models.loaders.gguf_header import GGUFHeader
from hybridserve.models.loaders.gguf_spec import required

PER_LAYER_KEYS = ("attention.head_count", "attention.head_count_kv", "feed_forward_length")


def per_layer(header: GGUFHeader, key: str, default: int = 0) -> list[int]:
    """`<architecture>.<key>` as one int per layer (a scalar applies to every layer)."""
    layers = int(required(header, "block_count"))
    value = header.arch_value(key, default)
    if isinstance(value, np.ndarray):
        if len(value) != layers:
            raise ConfigError(f"{header.path}: {header.architecture}.{key} has {len(value)} entries "
                              f"for {layers} layers")
        return [int(v) for v in value]
    return [int(value)] * layers


def largest_per_layer(header: GGUFHeader) -> GGUFHeader:
    """The header with each per-layer array of PER_LAYER_KEYS replaced by its largest entry (the
    model-wide number HF configs hold), so gguf_spec.common_config reads it as a scalar."""
    keys = {f"{header.architecture}.{key}" for key in PER_LAYER_KEYS}
    metadata = {k: int(v.max(initial=0)) if k in keys and isinstance(v, np.ndarray) else v
                for k, v in header.metadata.items()}
    return replace(header, metadata=metadata)


def block_stems(header: GGUFHeader) -> set[str]:
    """Tensor names inside blk.N., over every layer ("ssm_in.bias")."""
    return {info.name.split(".", 2)[-1] for info in header.tensors if info.name.startswith("blk.")}
