"""What every multi-process executor shares on the driver side, whatever starts its workers.

The driver never loads weights: it reads the model's config to size the KV cache for
the scheduler (the pool's block ids are global; each worker holds its own layers' and
heads' share of every block) and checks that the model divides over the layout before
any process starts.
"""

from __future__ import annotations

from typing import Any

from hybridserve.core.errors import HybridServeError
from hybridserve.core.kv.spec import DEFAULT_BLOCK_SIZE, KVCacheConfig, KVCacheSpec
from hybridserve.core.sched.output import KVConnectorOutput
from hybridserve.executor.base import Executor
from hybridserve.executor.distributed.layout import ParallelLayout
from hybridserve.models.config import ModelConfig, load_model_config


class ExecutorFailedError(HybridServeError, RuntimeError):
    """A worker of a multi-process executor failed or died; the executor is unusable."""


class DistributedDriver(Executor):
    # Every stage runs the PyTorch runner, which computes in-chunk attention from the batch.
    computes_in_chunk_attention_from_batch = True

    def __init__(self, spec_args: dict[str, Any]) -> None:
        from hybridserve.executor.distributed.shards import check_layout

        layout: ParallelLayout = spec_args["layout"]
        self.layout = layout
        self._model_cfg = load_model_config(spec_args["model_path"])
        check_layout(self._model_cfg, layout)
        self._kv_dtype: str = spec_args.get("kv_dtype") or spec_args.get("dtype", "float32")

    @property
    def model_config(self) -> ModelConfig:
        return self._model_cfg

    @property
    def kv_dtype(self) -> str:
        return self._kv_dtype

    def kv_layer_specs(self, block_size: int) -> dict[str, KVCacheSpec]:
        from hybridserve.models.kv_specs import model_kv_layer_specs

        return model_kv_layer_specs(self._model_cfg, block_size, self._kv_dtype)

    def kv_cache_config(self, block_size: int = DEFAULT_BLOCK_SIZE, *, num_blocks: int | None = None,
                        kv_cache_memory: int | str | None = None) -> KVCacheConfig:
        from hybridserve.executor.torch.executor import build_kv_cache_config

        return build_kv_cache_config(self._model_cfg, block_size, num_blocks=num_blocks,
                                     kv_cache_memory=kv_cache_memory, kv_dtype=self._kv_dtype)

    #: (host blocks, injected load failures) when KV offload is on (enable_kv_offload).
    offload_args: tuple[int, int] | None = None

    def enable_kv_offload(self, num_host_blocks: int, fail_loads: int = 0) -> None:
        """Every worker keeps a host pool of `num_host_blocks` slots for its share of each
        block (its layers, its heads); call before initialize (see attach_host_offload)."""
        self.offload_args = (num_host_blocks, fail_loads)
        self.connector_reports = ConnectorReports(self.layout.world_size)


class ConnectorReports:
    """One KV connector report per step from the workers' reports: a transfer of a request
    is finished once every worker has finished its share; a block any worker failed to
    load is invalid."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.recving: dict[str, int] = {}
        self.sending: dict[str, int] = {}

    def merge(self, reports: list[KVConnectorOutput | None]) -> KVConnectorOutput:
        merged = KVConnectorOutput()
        for report in reports:
            if report is None:
                continue
            merged.invalid_block_ids |= report.invalid_block_ids
            for counts, done in ((self.recving, report.finished_recving), (self.sending, report.finished_sending)):
                for rid in done:
                    counts[rid] = counts.get(rid, 0) + 1
        for counts, out in ((self.recving, merged.finished_recving), (self.sending, merged.finished_sending)):
            for rid in [r for r, n in counts.items() if n == self.num_workers]:
                del counts[rid]
                out.add(rid)
        return merged
