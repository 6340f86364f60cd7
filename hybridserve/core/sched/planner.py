"""The per-step planner of running requests: how many tokens (and draft slots) each gets.

`StepBatch` is what a step is being built into: the scheduled requests in order and the
token budget left. `plan_running` is the general rule for a running request (chunked
prefill, decode with drafts). `plan_steady_decodes` is its fast path for decodes of one
token that need no block allocated, freed or cached (most requests of most steps); it
takes a run of such requests in one call. The two agree wherever the fast path answers
(tests/core/test_scheduler_short_path.py).
"""

from __future__ import annotations

from hybridserve.core.kv.cache_manager import KVCacheManager
from hybridserve.core.request import Request
from hybridserve.core.sched.config import SchedulerConfig
from hybridserve.core.sched.output import ScheduledRequest


class StepBatch:
    """The requests one step schedules, in order, and the token budget left."""

    __slots__ = ("scheduled", "reqs", "budget")

    def __init__(self, budget: int) -> None:
        self.scheduled: list[ScheduledRequest] = []
        self.reqs: list[Request] = []
        self.budget = budget

    def add(self, sr: ScheduledRequest, req: Request) -> None:
        self.scheduled.append(sr)
        self.reqs.append(req)
        self.budget -= sr.num_scheduled_tokens

    def drop(self, req: Request) -> None:
        """Take a request out again (preempted after it was scheduled), budget included."""
        if req in self.reqs:
            j = self.reqs.index(req)
            self.budget += self.scheduled[j].num_scheduled_tokens
            del self.scheduled[j], self.reqs[j]


def plan_running(cfg: SchedulerConfig, req: Request, budget: int) -> ScheduledRequest | None:
    """How many tokens (and drafts) a running request gets, or None to skip it. Block ids
    are filled in once its slots are allocated."""
    if req.num_in_flight_tokens and not cfg.async_scheduling:
        return None  # pipeline-parallel without async: wait for its outputs
    num_outputs = len(req.output_token_ids)
    placeholders = req.num_output_placeholders
    computed = req.num_computed_tokens
    known = len(req.prompt_token_ids) + num_outputs + placeholders
    n = known - computed
    if n > budget:
        n = budget
    if n > cfg.max_model_len - 1 - computed:
        n = cfg.max_model_len - 1 - computed
    if cfg.long_prefill_token_threshold and n > cfg.long_prefill_token_threshold:
        n = cfg.long_prefill_token_threshold
    if n <= 0:
        return None
    samples = computed + n >= known
    drafts = 0
    if samples:
        allowed = req.sampling_params.max_tokens - num_outputs - placeholders
        if allowed <= 0:
            return None  # enough outputs already in flight
        if n == 1 and cfg.num_speculative_tokens:
            drafts = max(
                0,
                min(cfg.num_speculative_tokens, allowed - 1, budget - 1, cfg.max_model_len - 2 - computed),
            )
    return ScheduledRequest(req.request_id, computed, n + drafts, drafts, (), (), samples)


def plan_steady_decodes(
    kv: KVCacheManager,
    running: list[Request],
    start: int,
    batch: StepBatch,
    last_position: int,
    no_block_ids: tuple[list[int], ...],
    may_have_step_in_flight: bool,
) -> int:
    """The fast path of `plan_running` + `allocate_slots`: add running[start],
    running[start+1], ... to the batch for as long as each is a steady decode, one token
    each within the budget; returns the index of the first request not added (the
    general path takes it).

    A steady decode has exactly one known token past the computed ones, is below
    max_model_len and max_tokens, and its KV cache has nothing to allocate, free or
    cache (`KVCacheManager.append_decode_slot`). Only for configs without drafts; a
    request with a step in flight only when may_have_step_in_flight (async scheduling).
    One call covers a run of requests: most requests of most steps are steady decodes.
    """
    add_scheduled, add_req = batch.scheduled.append, batch.reqs.append
    append_decode_slot = kv.append_decode_slot
    stop = min(len(running), start + batch.budget)
    i = start
    while i < stop:
        req = running[i]
        if req.num_in_flight_tokens and not may_have_step_in_flight:
            break
        computed = req.num_computed_tokens
        num_outputs = len(req.output_token_ids) + req.num_output_placeholders
        if (len(req.prompt_token_ids) + num_outputs != computed + 1 or computed >= last_position
                or req.sampling_params.max_tokens <= num_outputs):
            break
        nulls = append_decode_slot(req)
        if nulls is None:
            break
        add_scheduled(ScheduledRequest(req.request_id, computed, 1, 0, no_block_ids, nulls, True))
        add_req(req)
        i += 1
    batch.budget -= i - start
    return i
