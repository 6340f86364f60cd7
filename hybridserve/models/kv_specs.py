"""The KV cache spec of every layer of a model: what decides its KV cache groups.

Pure Python (no torch), so the engine can size the cache and build its KVCacheConfig
before any weights are loaded.
"""

from __future__ import annotations

from hybridserve.core.errors import ConfigError
from hybridserve.core.kv.spec import (ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheSpec, MambaSpec,
                                      SlidingWindowSpec)
from hybridserve.models.config import CHUNKED, LINEAR, SLIDING, ModelConfig
from hybridserve.models.arch.jamba_config import MAMBA1
from hybridserve.models.arch.lfm2_config import SHORT_CONV
from hybridserve.models.arch.mamba_config import MAMBA
from hybridserve.models.arch.mamba_hybrid_config import MLP_ONLY


def layer_name(layer_idx: int) -> str:
    """The KV layer name of decoder layer `layer_idx` (the runner maps names back by this)."""
    return f"layers.{layer_idx}"


def layer_index(name: str) -> int:
    return int(name.rsplit(".", 1)[1])


def model_kv_layer_specs(cfg: ModelConfig, block_size: int, dtype: str = "float32") -> dict[str, KVCacheSpec]:
    """{layer name: spec}: sliding layers get SlidingWindowSpec(window), chunked-local layers
    ChunkedLocalAttentionSpec(chunk size; ConfigError unless a multiple of block_size), Mamba
    layers a MambaSpec (one state per request: conv state and SSM state), short convolution layers
    one too (its conv state only), Mamba1 layers (conv state and per-channel SSM state) and Gated
    DeltaNet layers (conv state and recurrent state); MLP-only layers (Nemotron-H) nothing; the
    rest full attention."""
    specs: dict[str, KVCacheSpec] = {}
    for i, kind in enumerate(cfg.layer_types):
        if kind == MLP_ONLY:
            continue
        if kind == MAMBA:
            assert cfg.mamba is not None
            specs[layer_name(i)] = MambaSpec(block_size=block_size, shapes=cfg.mamba.state_shapes, dtype=dtype)
        elif kind == SHORT_CONV:
            assert cfg.short_conv is not None
            specs[layer_name(i)] = MambaSpec(block_size=block_size, shapes=cfg.short_conv.state_shapes, dtype=dtype)
        elif kind == MAMBA1:
            assert cfg.jamba is not None
            specs[layer_name(i)] = MambaSpec(block_size=block_size, shapes=cfg.jamba.mixer.state_shapes, dtype=dtype)
        elif kind == LINEAR:  # Gated DeltaNet: a conv and a recurrent state, paged as Mamba's
            assert cfg.gated_deltanet is not None
            specs[layer_name(i)] = MambaSpec(block_size=block_size, shapes=cfg.gated_deltanet.state_shapes,
                                             dtype=dtype)
        elif kind == SLIDING:
            assert cfg.sliding_window is not None
            specs[layer_name(i)] = SlidingWindowSpec(
                block_size=block_size, num_kv_heads=cfg.num_kv_heads, head_size=cfg.head_dim, dtype=dtype,
                sliding_window=cfg.sliding_window,
            )
        elif kind == CHUNKED:
            assert cfg.attention_chunk_size is not None  # parse_model_config guarantees it
            specs[layer_name(i)] = ChunkedLocalAttentionSpec(
                block_size=block_size, num_kv_heads=cfg.num_kv_heads, head_size=cfg.head_dim, dtype=dtype,
                attention_chunk_size=cfg.attention_chunk_size,
            )
        else:
            specs[layer_name(i)] = FullAttentionSpec(
                block_size=block_size, num_kv_heads=cfg.num_kv_heads, head_size=cfg.head_dim, dtype=dtype
            )
    return specs


def cached_layers(cfg: ModelConfig, layers: range | None = None) -> set[int]:
    """The layers (of `layers`, default all) that have a KV cache spec: every one but MLP-only layers."""
    return {i for i in (range(cfg.num_layers) if layers is None else layers) if cfg.layer_types[i] != MLP_ONLY}


def kv_dtype_problem(kv_dtype: str, model_dtype: str, cfg: ModelConfig) -> str:
    """Why a model computing in `model_dtype` cannot keep its cache in `kv_dtype` ('' where
    it can): the cache is in the model's own dtype, or in bfloat16 under a float32 model
    whose layers all attend (its K/V rounded as they are written, widened as attention reads
    them); recurrent states stay in the model's dtype, which updates them step after step."""
    if kv_dtype == model_dtype:
        return ""
    if (model_dtype, kv_dtype) != ("float32", "bfloat16"):
        return (f"kv_cache_dtype {kv_dtype} under a {model_dtype} model: the cache is in the model's dtype, "
                "or bfloat16 under a float32 model")
    recurrent = sorted({kind for kind in cfg.layer_types if kind in (MAMBA, SHORT_CONV, MAMBA1, LINEAR)})
    if recurrent:
        return (f"kv_cache_dtype bfloat16 under a float32 model needs attention layers only; this one has "
                f"{', '.join(recurrent)} layers, whose states stay float32")
    return ""


def resolve_kv_dtype(requested: str, model_dtype: str, quantization: str, cfg: ModelConfig) -> str:
    """The KV cache's dtype for `requested` ("auto" or a dtype), or ConfigError. "auto": the
    model's own dtype, but bfloat16 under a float32 model with quantized weights (quantization
    not "none": their error is well above bf16's rounding of K/V; llama.cpp keeps a GGUF's
    cache in f16 alike) where kv_dtype_problem allows it: half the cache's memory, and half
    the bytes decode attention reads. An unquantized float32 model, the exact reference,
    keeps float32."""
    if requested == "auto":
        if model_dtype == "float32" and quantization != "none" and not kv_dtype_problem("bfloat16", model_dtype, cfg):
            return "bfloat16"
        return model_dtype
    problem = kv_dtype_problem(requested, model_dtype, cfg)
    if problem:
        raise ConfigError(problem)
    return requested
