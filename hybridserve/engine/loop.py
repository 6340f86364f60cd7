"""The engine loop: keep up to `max_concurrent_batches` steps in flight, for any executor.

    schedule N+1 -> execute N+1 -> wait N -> update_from_output N -> schedule N+2 ...

Sync scheduling is the same loop with one step in flight, and so is async scheduling on an
executor that runs each step inline (Executor.runs_steps_inline: a CPU's model threads):
nothing runs while the scheduler plans, so step N+1 planned before N's outputs are read
would overlap nothing and deliver N's tokens a step later (a lone request's first token
one decode step late). The scheduler keeps its async settings (admission still reserves
for two steps in flight).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from hybridserve.core.connector.base import KVConnectorBase
from hybridserve.core.errors import ConfigError, HybridServeError
from hybridserve.core.kv.spec import KVCacheConfig
from hybridserve.core.sched.config import SchedulerConfig
from hybridserve.core.request import Request
from hybridserve.core.sched.output import RequestOutput, SchedulerOutput
from hybridserve.core.sched.scheduler import Scheduler
from hybridserve.executor.base import Executor


logger = logging.getLogger("hybridserve")


class EngineStuckError(HybridServeError, RuntimeError):
    """Requests remain but none can make progress."""


def build_engine(
    config: SchedulerConfig,
    kv_cache_config: KVCacheConfig,
    executor: Executor,
    connector: KVConnectorBase | None = None,
    unsafe_optimistic_free: bool = False,
) -> EngineCore:
    """Scheduler + executor, with window-tail allocation resolved from the executor."""
    try:
        tail = config.resolve_window_tail(executor.computes_in_chunk_attention_from_batch)
    except ConfigError as exc:
        raise ConfigError(f"{exc}; {type(executor).__name__} does not") from None
    scheduler = Scheduler(config, kv_cache_config, connector, unsafe_optimistic_free, window_tail=tail)
    return EngineCore(scheduler, executor)


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor, initialize: bool = True) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.max_concurrent_batches = scheduler.config.num_concurrent_batches
        self.queue: deque[tuple[SchedulerOutput, Any]] = deque()
        if initialize:
            executor.initialize(scheduler.kv.config)
        executor.observe_block_pool(scheduler.kv.pool)

    def add_request(self, request: Request) -> RequestOutput | None:
        """Queue a request; a request that can never run comes back finished at once."""
        return self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.queue)

    def step(self) -> tuple[SchedulerOutput | None, list[RequestOutput]]:
        """Dispatch until the queue is full (or nothing more is schedulable), then
        process the oldest step. Returns that step and its per-request outputs."""
        while len(self.queue) < self.max_concurrent_batches and self.scheduler.has_unfinished_requests():
            out = self.scheduler.schedule()
            # An empty step still goes out: it carries finished ids and polls connector loads.
            self.queue.append((out, self.executor.execute(out)))
            if out.is_empty() or self.executor.runs_steps_inline:
                break
        if not self.queue:
            return None, []
        out, handle = self.queue.popleft()
        runner_output = self.executor.wait(handle)
        outputs = self.scheduler.update_from_output(out, runner_output)
        if runner_output.failed_req_ids:
            outputs = self._fail_requests(outputs, runner_output.failed_req_ids)
        return out, outputs

    def _fail_requests(self, outputs: list[RequestOutput], failed: dict[str, str]) -> list[RequestOutput]:
        """Finish requests whose own sampling failed with reason "error", as an abort frees
        them (fenced behind their in-flight steps); their stand-in tokens are not reported."""
        for rid, reason in failed.items():
            logger.error("request %s failed in the executor: %s", rid, reason)
        self.scheduler.abort_requests(list(failed))
        kept = [o for o in outputs if o.request_id not in failed]
        return kept + [RequestOutput(rid, [], True, "error") for rid in failed]

    def run(self) -> dict[str, list[int]]:
        """Run every queued request to completion; return output token ids per request."""
        tokens: dict[str, list[int]] = {}
        idle = 0
        while self.has_unfinished_requests():
            out, outputs = self.step()
            idle = idle + 1 if out is None or out.is_empty() else 0
            if idle > 100_000:
                raise EngineStuckError("no request could be scheduled for 100000 steps")
            for o in outputs:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        return tokens

    def shutdown(self) -> None:
        while self.queue:
            out, handle = self.queue.popleft()
            self.executor.wait(handle)
        self.executor.shutdown()
