"""What every route of the server shares: the engine handle, the served model's name,
the limits and metrics, and the server's lifecycle (admission, open requests, drain).

Invariants:
- `num_admitted` counts the engine requests (choices) admitted and not yet answered. It
  changes synchronously, at admission and at release, so concurrent arrivals cannot
  overshoot the queue; each release counts once, however often it is called.
- `live_request_ids` holds the engine requests of every open response, from the moment
  their generators exist until the response is done: those are what a drain waits for
  and, at its deadline, aborts.
- `draining` (after SIGTERM): new requests get 503. `stopping` (past the shutdown
  deadline): the open requests were aborted, so an aborted choice is the shutdown's doing
  and is reported as such, never as a result.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from hybridserve.engine.async_llm import AsyncLLM
from hybridserve.engine.outputs import CompletionOutput
from hybridserve.entrypoints.openai.errors import RETRY_AFTER_S
from hybridserve.entrypoints.openai.limits import ServerLimits
from hybridserve.entrypoints.openai.metrics import ServerMetrics
from hybridserve.entrypoints.openai.protocol import ApiError
from hybridserve.text.harmony import HarmonyTokens

logger = logging.getLogger("hybridserve.server")


class ServerContext:
    def __init__(self, engine: AsyncLLM, model_name: str, metrics: ServerMetrics,
                 limits: ServerLimits | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.limits = limits or ServerLimits()
        # The harmony control tokens of a gpt-oss-style model (its replies are read from them).
        self.harmony = HarmonyTokens.of(engine.tokenizer)
        self.created = int(time.time())
        self.num_admitted = 0
        self.live_request_ids: set[str] = set()
        self.draining = False
        self.stopping = False

    # -- checks every API route makes first ----------------------------------------------
    def check_ready(self, model: str | None) -> None:
        if self.draining:
            raise ApiError("the server is shutting down", status=503, type_="service_unavailable",
                           code="shutting_down")
        if self.engine.dead_error is not None:
            raise ApiError("the engine has stopped after repeated failures", status=503, type_="engine_dead")
        if self.engine.restarting:
            raise ApiError("the engine is restarting after a failure; retry shortly", status=503,
                           type_="engine_restarting", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.check_model(model)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(f"the model `{model}` does not exist; this server serves `{self.model_name}`",
                           status=404, param="model", code="model_not_found")

    # -- admission and open requests ------------------------------------------------------
    def admit(self, num_choices: int) -> Callable[[], None]:
        """Reserve queue room for a request's engine requests; returns the release."""
        cap = self.limits.max_choices_per_request
        if num_choices > cap:
            raise ApiError(f"n x the number of prompts is {num_choices}; this server allows at most {cap} "
                           "per request", param="n")
        slots = self.engine.config.max_num_seqs * self.engine.config.data_parallel_size
        limit = self.limits.waiting_limit(slots)
        waiting_after = self.num_admitted + num_choices - slots
        # An idle server always takes one request, so no request is refused for its size alone.
        if self.num_admitted and waiting_after > limit:
            raise ApiError(f"the server is at capacity ({self.num_admitted} requests in progress, at most {limit} "
                           "waiting); retry later", status=429, type_="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self.num_admitted += num_choices
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.num_admitted -= num_choices

        return release

    def track(self, request_ids: list[str], release: Callable[[], None]) -> Callable[[], None]:
        """Register engine request ids as live (aborted at the shutdown deadline); returns the cleanup."""
        self.live_request_ids.update(request_ids)

        def done() -> None:
            self.live_request_ids.difference_update(request_ids)
            release()

        return done

    # -- the drain ------------------------------------------------------------------------
    async def begin_drain(self, timeout: float) -> None:
        """Refuse new requests; after `timeout` s abort what is still open (its streams then
        end with an error event, see errors.shutdown_error)."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.live_request_ids and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.live_request_ids:
            self.stopping = True
            logger.warning("shutdown timeout: ending %d open requests", len(self.live_request_ids))
            await self.engine.abort(list(self.live_request_ids))

    def ended_by_shutdown(self, out: CompletionOutput) -> bool:
        """Whether the shutdown deadline, not the client or the engine, ended this choice."""
        return self.stopping and out.finish_reason == "abort"
