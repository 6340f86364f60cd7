"""Where each worker sits in a pipeline x tensor parallel grid, and who it talks to.

World rank r = stage * T + tp_rank, for P pipeline stages of T tensor-parallel ranks:

    stage 0:  ranks 0 .. T-1       (embedding + the first layers)
    stage 1:  ranks T .. 2T-1
    ...
    stage P-1 (last): samples; its tp rank 0 reports the step to the driver

Point-to-point traffic stays within one tp rank: rank (s, t) sends a step's plan and
hidden state to (s+1, t), and the last stage's (P-1, t) sends each step's sampled tokens
back to every (s, t), s < P-1. Collectives (all-reduce) stay within one stage's T ranks.
Pure Python: the driver uses it before any process exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridserve.core.errors import ConfigError


@dataclass(frozen=True)
class ParallelLayout:
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("pipeline_parallel_size", "tensor_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel_size * self.tensor_parallel_size

    @property
    def is_single_process(self) -> bool:
        return self.world_size == 1

    def place(self, rank: int) -> WorkerPlace:
        t = self.tensor_parallel_size
        return WorkerPlace(self, rank // t, rank % t)

    def stage_ranks(self, stage: int) -> list[int]:
        t = self.tensor_parallel_size
        return list(range(stage * t, (stage + 1) * t))

    @property
    def output_rank(self) -> int:
        """The rank that hands each step's output to the driver: tp rank 0 of the last stage."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size


@dataclass(frozen=True)
class WorkerPlace:
    layout: ParallelLayout
    stage: int
    tp_rank: int

    @property
    def rank(self) -> int:
        return self.stage * self.layout.tensor_parallel_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.layout.pipeline_parallel_size - 1

    @property
    def next_rank(self) -> int | None:
        return None if self.is_last_stage else self.rank + self.layout.tensor_parallel_size

    @property
    def prev_rank(self) -> int | None:
        return None if self.is_first_stage else self.rank - self.layout.tensor_parallel_size

    @property
    def last_stage_rank(self) -> int:
        """The last stage's rank with this tp rank: where sampled tokens come from."""
        return self.layout.output_rank + self.tp_rank

    @property
    def earlier_stage_ranks(self) -> list[int]:
        """Ranks with this tp rank in the stages before the last (they receive results)."""
        t = self.layout.tensor_parallel_size
        return [s * t + self.tp_rank for s in range(self.layout.pipeline_parallel_size - 1)]
