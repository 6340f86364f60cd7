"""The executor interface every backend implements: simulated, PyTorch, anything else.

The engine loop keeps up to `max_concurrent_batches` steps in flight: it calls
`execute` for step N+1 before `wait` returns step N. Handles are opaque.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from hybridserve.core.kv.spec import KVCacheConfig
from hybridserve.core.sched.output import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    """Runs scheduled steps.

    Invariants an executor keeps:
    - steps complete in the order they were dispatched (`wait` is called in that order);
    - a decode token scheduled as a placeholder is filled from the executor's own last
      sampled token for that request (async scheduling);
    - the positions a request computes start at the executor's own count of computed
      tokens, which trails the scheduler's optimistic count after rejected drafts.
    """

    #: True when in-chunk attention is computed from the batch's own keys (window-tail
    #: allocation may then hand null blocks to slots no later step reads).
    computes_in_chunk_attention_from_batch: bool = False

    @property
    def runs_steps_inline(self) -> bool:
        """Whether `execute` runs the step to its end before it returns (no step ever runs
        while the engine schedules): the loop then waits for each step before planning
        the next, as a step planned ahead would overlap nothing and only hold back the
        previous step's tokens by a step."""
        return False

    @abstractmethod
    def initialize(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate the KV cache for this config (called once, before the first step)."""

    @abstractmethod
    def execute(self, scheduler_output: SchedulerOutput) -> Any:
        """Start a step; return a handle for `wait`."""

    @abstractmethod
    def wait(self, handle: Any) -> ModelRunnerOutput:
        """Block until the step behind `handle` is done and return its output."""

    def observe_block_pool(self, pool: Any) -> None:
        """Debug hook: executors that check the pool (the simulator's detector) watch it."""

    def prepare_large_steps(self) -> None:
        """Build now what the first large or sampled steps would build on first use
        (compiled kernels): a server's start-up pays it instead of its first burst."""

    def shutdown(self) -> None:
        """Release threads and memory."""
