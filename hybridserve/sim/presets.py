"""GPU and model-layout presets for the simulator, loaded from presets.json.

A model layout knows only what KV sizing and the cost model need: the attention kind of
every layer, head shapes, window/chunk sizes, Mamba state shapes and parameter counts
(total for weight memory, active-per-token for FLOPs, which differ for MoE models).

Invariant: `kv_cache_config` sizes the pool from the same `group_layers` /
`bytes_per_block` the engine uses, so the simulated pool is the pool a real engine with
these settings would allocate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from hybridserve.core.errors import ConfigError
from hybridserve.core.kv.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    cdiv,
    group_layers,
)

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # share of a GPU's memory for weights + KV cache

PRESETS_PATH = Path(__file__).with_name("presets.json")
# "mlp": a layer that is only an MLP (Nemotron-H's): no KV cache, no state.
LAYER_KINDS = ("full", "sliding", "chunked", "mamba", "mlp")
GB = 1e9


@dataclass(frozen=True)
class GpuPreset:
    name: str
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float
    peak_flops: float
    source: str = ""


@dataclass(frozen=True)
class EngineOverheads:
    """Per-step overheads (seconds). See the `engine` comment in presets.json."""

    fixed_step_overhead_s: float
    cpu_step_overhead_s: float
    pp_stage_overhead_s: float


@dataclass(frozen=True)
class MambaShape:
    d_inner: int
    d_conv: int
    nheads: int
    head_dim: int
    d_state: int
    # Channels the conv runs over: d_inner for Mamba-1, d_inner + 2 * n_groups * d_state
    # for Mamba-2 (x, B and C). 0: d_inner.
    conv_dim: int = 0

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_dim or self.d_inner, self.d_conv - 1)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        return (self.nheads, self.head_dim, self.d_state)


@dataclass(frozen=True)
class ModelLayout:
    """One model's layer layout. `layer_kinds[i]` is one of LAYER_KINDS."""

    name: str
    layer_kinds: tuple[str, ...]
    hidden_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    total_params: float
    active_params: float
    weight_bytes_per_param: float
    vocab_size: int
    max_position_embeddings: int
    sliding_window: int = 0
    attention_chunk_size: int = 0
    mamba: MambaShape | None = None
    source: str = ""

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def weight_bytes(self) -> float:
        """Bytes of all weights (total params: every expert of an MoE is resident)."""
        return self.total_params * self.weight_bytes_per_param

    def layer_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for kind in self.layer_kinds:
            counts[kind] = counts.get(kind, 0) + 1
        return counts

    def spec_for(self, kind: str, block_size: int, dtype: str, num_speculative_blocks: int) -> KVCacheSpec:
        if kind == "full":
            return FullAttentionSpec(block_size, self.num_kv_heads, self.head_dim, dtype)
        if kind == "sliding":
            return SlidingWindowSpec(block_size, self.num_kv_heads, self.head_dim, dtype, self.sliding_window)
        if kind == "chunked":
            return ChunkedLocalAttentionSpec(
                block_size, self.num_kv_heads, self.head_dim, dtype, self.attention_chunk_size
            )
        if kind == "mamba":
            assert self.mamba is not None  # guaranteed by _parse_layout
            shapes = (self.mamba.conv_state_shape, self.mamba.ssm_state_shape)
            return MambaSpec(block_size, shapes, dtype, num_speculative_blocks)
        raise ConfigError(f"layout {self.name}: unknown layer kind {kind!r}")

    def layer_specs(
        self, block_size: int, dtype: str = "bfloat16", num_speculative_blocks: int = 0
    ) -> dict[str, KVCacheSpec]:
        """Spec of every layer but MLP-only ones, keyed by layer name (`layers.{i}.attn` / `layers.{i}.mamba`)."""
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        # Specs are frozen and hashable: build one per kind and reuse it.
        specs = {k: self.spec_for(k, block_size, dtype, num_speculative_blocks)
                 for k in set(self.layer_kinds) - {"mlp"}}
        return {
            f"layers.{i}.{'mamba' if kind == 'mamba' else 'attn'}": specs[kind]
            for i, kind in enumerate(self.layer_kinds) if kind != "mlp"
        }

    def kv_cache_config(
        self,
        gpu: GpuPreset,
        block_size: int,
        num_blocks: int | None = None,
        gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
        *,
        dtype: str = "bfloat16",
        num_speculative_blocks: int = 0,
        pipeline_parallel_size: int = 1,
    ) -> KVCacheConfig:
        """The KV pool this model gets on `gpu`.

        pool blocks = (memory * utilization - weights) / bytes_per_block, per GPU. With
        pipeline parallelism each stage holds 1/pp of the weights and of every block.
        `num_blocks` overrides the computed size (the weights must still fit).
        """
        if not 0 < gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if pipeline_parallel_size < 1:
            raise ConfigError(f"pipeline_parallel_size must be >= 1, got {pipeline_parallel_size}")
        groups = group_layers(self.layer_specs(block_size, dtype, num_speculative_blocks))
        probe = KVCacheConfig(num_blocks=1, groups=groups)
        budget = gpu.memory_bytes * gpu_memory_utilization
        weights = self.weight_bytes / pipeline_parallel_size
        if weights >= budget:
            raise ConfigError(
                f"{self.name} weights need {weights / GB:.1f} GB per GPU but {gpu.name} has "
                f"{budget / GB:.1f} GB at gpu_memory_utilization {gpu_memory_utilization}; "
                f"use a bigger GPU or a larger pipeline_parallel_size"
            )
        if num_blocks is None:
            per_gpu_block = cdiv(probe.bytes_per_block, pipeline_parallel_size)
            num_blocks = int((budget - weights) // per_gpu_block)
        if num_blocks < 2:
            raise ConfigError(
                f"{self.name} on {gpu.name}: the KV pool has {num_blocks} blocks; it needs at least 2 "
                f"(the null block and one usable block)"
            )
        return KVCacheConfig(num_blocks=num_blocks, groups=groups)


def _require(raw: dict[str, Any], key: str, where: str) -> Any:
    if key not in raw:
        raise ConfigError(f"presets: {where} lacks {key!r}")
    return raw[key]


def _parse_layout(name: str, raw: dict[str, Any]) -> ModelLayout:
    where = f"model layout {name}"
    pattern = tuple(_require(raw, "layer_pattern", where))
    num_layers = int(_require(raw, "num_layers", where))
    if not pattern or any(k not in LAYER_KINDS for k in pattern):
        raise ConfigError(f"presets: {where} layer_pattern must use {LAYER_KINDS}")
    kinds = tuple(pattern[i % len(pattern)] for i in range(num_layers))
    # Full-attention layers at listed indices (a layout that repeats no pattern, e.g. Bamba's).
    attention_layers = [int(i) for i in raw.get("attention_layers", ())]
    if any(not 0 <= i < num_layers for i in attention_layers):
        raise ConfigError(f"presets: {where} attention_layers must be in [0, {num_layers})")
    kinds = tuple("full" if i in attention_layers else k for i, k in enumerate(kinds))
    mamba = MambaShape(**raw["mamba"]) if "mamba" in raw else None
    if "mamba" in kinds and mamba is None:
        raise ConfigError(f"presets: {where} has mamba layers but no 'mamba' shapes")
    if "sliding" in kinds and int(raw.get("sliding_window", 0)) < 1:
        raise ConfigError(f"presets: {where} has sliding layers but no sliding_window")
    if "chunked" in kinds and int(raw.get("attention_chunk_size", 0)) < 1:
        raise ConfigError(f"presets: {where} has chunked layers but no attention_chunk_size")
    return ModelLayout(
        name=name,
        layer_kinds=kinds,
        hidden_size=int(_require(raw, "hidden_size", where)),
        num_q_heads=int(_require(raw, "num_q_heads", where)),
        num_kv_heads=int(_require(raw, "num_kv_heads", where)),
        head_dim=int(_require(raw, "head_dim", where)),
        total_params=float(_require(raw, "total_params", where)),
        active_params=float(_require(raw, "active_params", where)),
        weight_bytes_per_param=float(raw.get("weight_bytes_per_param", 2.0)),
        vocab_size=int(raw.get("vocab_size", 32000)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
        sliding_window=int(raw.get("sliding_window", 0)),
        attention_chunk_size=int(raw.get("attention_chunk_size", 0)),
        mamba=mamba,
        source=str(raw.get("source", "")),
    )


@dataclass(frozen=True)
class Presets:
    gpus: dict[str, GpuPreset]
    layouts: dict[str, ModelLayout]
    engine: EngineOverheads


@lru_cache(maxsize=None)
def load_presets(path: str = str(PRESETS_PATH)) -> Presets:
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    gpus = {
        name: GpuPreset(
            name=name,
            memory_bytes=int(g["memory_bytes"]),
            memory_bandwidth_bytes_per_s=float(g["memory_bandwidth_bytes_per_s"]),
            peak_flops=float(g["peak_flops"]),
            source=str(g.get("source", "")),
        )
        for name, g in raw["gpus"].items()
    }
    layouts = {name: _parse_layout(name, lay) for name, lay in raw["model_layouts"].items()}
    e = raw["engine"]
    engine = EngineOverheads(
        float(e["fixed_step_overhead_s"]), float(e["cpu_step_overhead_s"]), float(e["pp_stage_overhead_s"])
    )
    return Presets(gpus=gpus, layouts=layouts, engine=engine)


def gpu_names() -> list[str]:
    return list(load_presets().gpus)


def layout_names() -> list[str]:
    return list(load_presets().layouts)


def get_gpu(name: str) -> GpuPreset:
    """Look a GPU up by name, case-insensitively; 'A100' means the 80 GB part."""
    gpus = load_presets().gpus
    by_lower = {k.lower(): v for k, v in gpus.items()}
    key = name.lower()
    if key == "a100":
        key = "a100-80gb"
    if key not in by_lower:
        raise ConfigError(f"unknown GPU {name!r}; choose one of {', '.join(gpus)}")
    return by_lower[key]


def get_layout(name: str) -> ModelLayout:
    layouts = load_presets().layouts
    if name not in layouts:
        raise ConfigError(f"unknown model layout {name!r}; choose one of {', '.join(layouts)}")
    return layouts[name]


def layer_specs(
    layout: str | ModelLayout, block_size: int, dtype: str = "bfloat16", num_speculative_blocks: int = 0
) -> dict[str, KVCacheSpec]:
    """Module-level convenience: `get_layout(name).layer_specs(...)`."""
    lay = get_layout(layout) if isinstance(layout, str) else layout
    return lay.layer_specs(block_size, dtype, num_speculative_blocks)


def kv_cache_config(
    layout: str | ModelLayout,
    gpu: str | GpuPreset,
    block_size: int,
    num_blocks: int | None = None,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    **kwargs: Any,
) -> KVCacheConfig:
    """Module-level convenience: `get_layout(layout).kv_cache_config(get_gpu(gpu), ...)`."""
    lay = get_layout(layout) if isinstance(layout, str) else layout
    g = get_gpu(gpu) if isinstance(gpu, str) else gpu
    return lay.kv_cache_config(g, block_size, num_blocks, gpu_memory_utilization, **kwargs)
