"""One worker process of a pipeline x tensor parallel executor, whatever starts it.

A worker joins the torch.distributed group, loads its share of the model (its stage's
layers, its tensor-parallel slice of each), builds a StageRunner over its share of the
KV cache, then executes every step the driver sends it, in order. The multiprocessing
backend (mp_executor.py) drives it through queues; the Ray backend (ray_executor.py)
through actor calls. Both call the same three methods.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hybridserve.core.errors import one_line
from hybridserve.core.kv.spec import KVCacheConfig
from hybridserve.core.sched.output import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from hybridserve.executor.distributed.layout import ParallelLayout, WorkerPlace
from hybridserve.executor.distributed.peer_link import PeerLink
from hybridserve.executor.distributed.stage_runner import StageRunner
from hybridserve.models.platform.heap import IdleHeapRelease


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its share of the engine (sent once, pickled)."""

    layout: ParallelLayout
    model_path: str
    init_method: str  # torch.distributed rendezvous, e.g. tcp://127.0.0.1:PORT
    dtype: str = "float32"
    kv_dtype: str | None = None  # the KV cache's (None: dtype's); the driver sizes the cache in it
    quantization: str = "none"
    device: str = "cpu"
    seed: int = 0
    num_threads: int = 1  # torch threads per worker
    ngram_sizes: tuple[int, int] = (2, 4)  # the drafter's n-gram lookup range
    drafter: Any = None  # a picklable drafter instead of the n-gram one (tests)
    tokenizer_dir: str | None = None  # structured outputs compile against this tokenizer
    # Record when each step starts and ends on each stage (the overlap test reads it).
    trace: bool = False
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class StepTrace:
    step_id: int
    rank: int
    start: float  # time.monotonic(): one clock for every process of the machine
    end: float


class Worker:
    def __init__(self, spec: WorkerSpec, rank: int) -> None:
        from hybridserve.executor.torch.executor import resolve_device
        from hybridserve.executor.torch.kv_cache import TORCH_DTYPES
        from hybridserve.executor.distributed.shards import load_model_shard

        os.environ.update(spec.env)
        torch.set_num_threads(spec.num_threads)
        self.spec = spec
        self.place: WorkerPlace = spec.layout.place(rank)
        self.device = resolve_device(spec.device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        layout = spec.layout
        dist.init_process_group(backend, init_method=spec.init_method, world_size=layout.world_size, rank=rank)
        # Every rank creates every stage's group, in one order, as new_group requires.
        groups = [dist.new_group(layout.stage_ranks(s)) for s in range(layout.pipeline_parallel_size)]
        self.model, self.layers = load_model_shard(
            spec.model_path, self.place, groups[self.place.stage], self.device, TORCH_DTYPES[spec.dtype],
            spec.quantization,
        )
        self.link = PeerLink(self.device if backend == "nccl" else torch.device("cpu"))
        self.runner: StageRunner | None = None
        self.offload: Any = None  # OffloadWorker of this worker's share, with KV offload
        self.traces: list[StepTrace] = []
        # Step temporaries left in this process's C heap go back once steps pause (models/platform/heap.py).
        self.idle_release = IdleHeapRelease() if self.device.type == "cpu" else None

    def init_cache(self, kv_cache_config: KVCacheConfig, offload: tuple[int, int] | None = None) -> int:
        """Build the runner over this worker's share of the pool, with a host pool for it
        when offload = (host blocks, injected load failures); returns its KV bytes."""
        from hybridserve.executor.torch.spec_decode import NgramDrafter

        grammar = None
        if self.place.is_last_stage and self.spec.tokenizer_dir is not None:
            from hybridserve.text.structured_output import GrammarBackend
            from hybridserve.text.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_dir(self.spec.tokenizer_dir)
            if tokenizer is not None:
                grammar = GrammarBackend(tokenizer.hf, self.model.cfg.vocab_size)
        drafter = self.spec.drafter or NgramDrafter(*self.spec.ngram_sizes)
        self.runner = StageRunner(self.model, kv_cache_config, self.device, self.place, self.link, self.layers,
                                  seed=self.spec.seed, drafter=drafter, grammar=grammar)
        if offload is not None:
            from hybridserve.executor.torch.offload import OffloadWorker

            self.offload = OffloadWorker(self.runner.kv, offload[0], self.device, offload[1])
        return self.runner.kv.num_bytes

    def step(self, so: SchedulerOutput) -> ModelRunnerOutput | KVConnectorOutput | None:
        """Run one step. The output rank returns the step's output; the others their
        share's KV transfer report (with offload) or None."""
        assert self.runner is not None, "init_cache comes first"
        start = time.monotonic()
        offload = self.offload
        if offload is not None:  # this step's copies start first and overlap the model
            offload.submit(so.kv_connector_metadata)
        try:
            out = self.runner.execute(so)
        finally:
            if self.idle_release is not None:
                self.idle_release.stepped()
        report = offload.collect(wait_for_one=so.is_empty()) if offload is not None else None
        if self.spec.trace:
            self.traces.append(StepTrace(so.step_id, self.place.rank, start, time.monotonic()))
        if self.place.rank == self.spec.layout.output_rank:
            out.kv_connector_output = report
            return out
        return report

    def take_traces(self) -> list[StepTrace]:
        traces, self.traces = self.traces, []
        return traces

    def close(self) -> None:
        if self.idle_release is not None:
            self.idle_release.close()
        if self.offload is not None:
            self.offload.shutdown()
        try:
            self.link.flush()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def describe_exit(rank: int, exitcode: Any) -> str:
    if isinstance(exitcode, int) and exitcode < 0:
        return f"worker rank {rank} was killed by signal {-exitcode}"
    return f"worker rank {rank} exited with code {exitcode}"
