"""The model's side of a worker: which share of the model a place in the layout loads.

Thin on purpose: the splitting rules (layer ranges, head and column shards, what a
model allows) live with the models (models/parallel.py); this maps a WorkerPlace onto
them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybridserve.executor.distributed.layout import ParallelLayout, WorkerPlace
from hybridserve.models.config import ModelConfig
from hybridserve.models.parallel import PipelineStage, TPGroup, check_tp, stage_layer_ranges

if TYPE_CHECKING:
    import torch


def check_layout(cfg: ModelConfig, layout: ParallelLayout) -> None:
    """ConfigError naming the sizes that work unless the model divides over the layout."""
    stage_layer_ranges(cfg.num_layers, layout.pipeline_parallel_size)
    check_tp(cfg, layout.tensor_parallel_size)


def load_model_shard(path: str, place: WorkerPlace, tp_group: Any, device: torch.device, dtype: torch.dtype,
                     quantization: str) -> tuple[Any, range]:
    """(this place's model share, the global indices of the layers it computes)."""
    from hybridserve.models.loaders.loader import load_model

    layout = place.layout
    stage = PipelineStage(place.stage, layout.pipeline_parallel_size)
    tp = TPGroup(place.tp_rank, layout.tensor_parallel_size, tp_group)
    model = load_model(path, device, dtype, quantization, stage=stage, tp=tp)
    return model, stage.layers(model.cfg.num_layers)
