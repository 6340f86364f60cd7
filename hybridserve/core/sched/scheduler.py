"""Continuous-batching scheduler that stays correct while steps are in flight.

Per step: running requests first (chunked prefills, decodes with draft slots; the
planner), then waiting ones (prefix hits, connector hits; admission), one token budget.
`schedule()` advances counts optimistically; `update_from_output()` settles them
(output processing). Connector jobs are tracked by `KVTransferState`. Counters per
request::

    schedule():            num_computed_tokens += n   num_in_flight_tokens += n
                           (sampling step) num_output_placeholders += 1 + drafts
    update_from_output():  num_in_flight_tokens -= n  (always, first)
                           num_computed_tokens -= rejected drafts
                           num_output_placeholders -= 1 + drafts
"""

from __future__ import annotations

from hybridserve.core.connector.base import KVConnectorBase
from hybridserve.core.errors import RequestError
from hybridserve.core.kv.cache_manager import KVCacheManager
from hybridserve.core.kv.coordinator import BlocksPerGroup
from hybridserve.core.kv.spec import KVCacheConfig
from hybridserve.core.request import Request, RequestStatus
from hybridserve.core.sched.admission import Admission
from hybridserve.core.sched.config import SchedulerConfig
from hybridserve.core.sched.kv_transfer import KVTransferState
from hybridserve.core.sched.output import (
    ModelRunnerOutput,
    PromptLogprobChunk,
    RequestOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from hybridserve.core.sched.output_processing import (
    FINISHED,
    append_tokens,
    receive_prompt_logprobs,
    settle_plain_decodes,
    take_prompt_logprobs,
)
from hybridserve.core.sched.planner import StepBatch, plan_running, plan_steady_decodes
from hybridserve.core.sched.queues import make_queue
from hybridserve.core.sched.stats import SchedulerStats

# _allocate_preempting's answer for a request that waits a step for fenced frees.
WAITS_FOR_FENCED: BlocksPerGroup = []

EMPTY: list[int] = []


class Scheduler:
    # The steady-decode fast path (`plan_steady_decodes`) and the plain-decode one of
    # output processing (`settle_plain_decodes`); tests turn them off to compare with
    # the general paths.
    steady_decode_fast_path = True
    plain_decode_fast_path = True

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_config: KVCacheConfig,
        connector: KVConnectorBase | None = None,
        unsafe_optimistic_free: bool = False,
        window_tail: bool | None = None,
    ) -> None:
        """window_tail: whether window-tail allocation is on, as the builder resolved it
        for its executor (engine.build_engine). None: resolve the config for an executor
        that declares nothing (off unless forced, and forcing it on then fails)."""
        self.config = config
        use_tail = config.resolve_window_tail(False) if window_tail is None else window_tail
        self.kv = KVCacheManager(
            kv_cache_config,
            max_model_len=config.max_model_len,
            max_in_flight_tokens=config.max_in_flight_tokens,
            enable_caching=config.enable_prefix_caching,
            unsafe_optimistic_free=unsafe_optimistic_free,
            window_tail=config.window_tail if use_tail else None,
            in_flight=config.window_tail,
            keep_last_checkpoint=connector is not None,
            prefix_cache_retention=config.prefix_cache_retention,
        )
        self.stats = SchedulerStats()
        self.connector = connector
        self.transfer: KVTransferState | None = None
        if connector is not None:
            connector.bind_kv_cache_config(self.kv.config)
            self.transfer = KVTransferState(self.kv, connector, self.stats)
        self.admission = Admission(config, self.kv, connector, self.transfer)
        self.requests: dict[str, Request] = {}
        self.waiting = make_queue(config.policy)
        self.running: list[Request] = []
        self.next_step_id = 0
        # step id -> (its requests, each one's num_preemptions when scheduled)
        self.in_flight: dict[int, tuple[list[Request], list[int]]] = {}
        self.finished_req_ids: set[str] = set()
        self.preempted_req_ids: set[str] = set()
        self.no_block_ids: tuple[list[int], ...] = tuple([] for _ in kv_cache_config.groups)

    # -- requests --------------------------------------------------------------
    def add_request(self, request: Request) -> RequestOutput | None:
        """Queue a request. Returns a finished output at once if it can never run."""
        if request.request_id in self.requests:
            raise RequestError(f"duplicate request id {request.request_id!r}")
        limit = self.config.max_model_len
        if request.num_prompt_tokens >= limit:
            status = RequestStatus.FINISHED_ERROR if request.num_prompt_tokens > limit else RequestStatus.FINISHED_LENGTH_CAPPED
            request.status = status
            return RequestOutput(request.request_id, [], True, status.finish_reason)
        self.kv.init_request(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)
        return None

    def abort_requests(self, request_ids: str | list[str]) -> None:
        """Abort known requests; unknown (or already finished) ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        aborted = False
        for rid in ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                aborted = True
            else:
                self.waiting.remove(req)
            loading = self.transfer is not None and self.transfer.abort(req)
            req.status = RequestStatus.FINISHED_ABORTED
            if loading:
                # A load is still writing into its blocks: they are freed when it reports done.
                del self.requests[rid]
                self.finished_req_ids.add(rid)
            else:
                self._free_request(req)
        if aborted:
            self.running = [r for r in self.running if not r.is_finished]

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or finished ones whose blocks wait on a connector store/load."""
        return bool(self.requests) or (self.transfer is not None and self.transfer.has_pending())

    # -- schedule ------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan the next step: running requests, then (if none was preempted) admissions."""
        cfg = self.config
        batch = StepBatch(cfg.max_num_batched_tokens)
        preempted = self._schedule_running(batch)
        if not preempted:
            self.admission.admit(batch, self.waiting, self.running)
            # When no step will free blocks, waiting requests that hold loaded blocks
            # would starve each other for ever (Admission.release_last_holder).
            while self._no_step_frees_blocks() and self.admission.release_last_holder(self.waiting):
                self.admission.admit(batch, self.waiting, self.running)
        out = SchedulerOutput(
            step_id=self.next_step_id,
            requests=batch.scheduled,
            total_num_scheduled_tokens=cfg.max_num_batched_tokens - batch.budget,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=self.preempted_req_ids,
        )
        self.finished_req_ids, self.preempted_req_ids = set(), set()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        self._commit(out, batch.reqs)
        return out

    def _no_step_frees_blocks(self) -> bool:
        """Nothing runs, no fenced free waits, and every step in flight is empty (with
        async scheduling one usually is: it polls the connector), so no step's output
        will free blocks; connector reports are release_last_holder's to check."""
        return not self.running and not self.kv.fenced and not any(reqs for reqs, _ in self.in_flight.values())

    def _schedule_running(self, batch: StepBatch) -> bool:
        """Schedule running requests in order, preempting when blocks run out; returns
        whether any request was preempted."""
        cfg = self.config
        running, kv, no_block_ids = self.running, self.kv, self.no_block_ids
        # Steady decodes take the fast path (without drafts; a request with a step in
        # flight only under async scheduling, as plan_running requires).
        fast = self.steady_decode_fast_path and not cfg.num_speculative_tokens
        unblocked = cfg.async_scheduling
        last_position = cfg.max_model_len - 1
        preempted = False
        i = 0
        while i < len(running) and batch.budget > 0:
            if fast:
                i = plan_steady_decodes(kv, running, i, batch, last_position, no_block_ids, unblocked)
                if i == len(running) or batch.budget <= 0:
                    break
            req = running[i]
            sr = plan_running(cfg, req, batch.budget)
            if sr is None:
                i += 1
                continue
            new_blocks, num_preempted, num_before = self._allocate_preempting(req, sr.num_scheduled_tokens, batch, i)
            if num_preempted:
                preempted = True
                i -= num_before  # req's place in the shrunk running list
            if new_blocks is None:
                continue  # preempted itself: running shrank, i points at the next one
            if new_blocks is WAITS_FOR_FENCED:
                i += 1
                continue
            sr.new_block_ids = no_block_ids if new_blocks is kv.no_new_blocks else tuple(
                [b.block_id for b in g] for g in new_blocks)
            sr.num_null_blocks = kv.get_num_null_blocks(req.request_id)
            batch.add(sr, req)
            i += 1
        return preempted

    def _allocate_preempting(
        self, req: Request, num_tokens: int, batch: StepBatch, index: int
    ) -> tuple[BlocksPerGroup | None, int, int]:
        """Allocate slots for req (at running[index]), preempting victims until they fit.

        Returns the new blocks (None: req was preempted itself; WAITS_FOR_FENCED: it is
        not scheduled this step), how many requests were preempted, and how many of them
        stood before req in the running list."""
        new_blocks = self.kv.allocate_slots(req, num_tokens)
        num_preempted = num_before = 0
        while new_blocks is None:
            victim = self._pick_victim(req)
            if victim is req and len(self.running) == 1 and self.admission.release_last_holder(self.waiting, req):
                # Waiting requests' loaded blocks kept it from fitting (Admission.release_last_holder).
                new_blocks = self.kv.allocate_slots(req, num_tokens)
                continue
            if victim is req and self.kv.fenced:
                # Blocks freed behind steps in flight (a victim's, say) come back as those
                # steps return: req waits for them instead of preempting itself, which
                # threw its progress away; two requests that took turns at that, each
                # readmitted beside the other, never finished.
                return WAITS_FOR_FENCED, num_preempted, num_before
            num_preempted += 1
            if victim is req:
                self._preempt(req)
                return None, num_preempted, num_before
            if self.running.index(victim) < index - num_before:
                num_before += 1
            self._preempt(victim)
            batch.drop(victim)
            new_blocks = self.kv.allocate_slots(req, num_tokens)
        return new_blocks, num_preempted, num_before

    def _commit(self, out: SchedulerOutput, reqs: list[Request]) -> None:
        """Advance the scheduled requests' counts optimistically; the step is in flight."""
        step = out.step_id
        for sr, req in zip(out.requests, reqs):
            n = sr.num_scheduled_tokens
            req.num_computed_tokens += n
            req.num_in_flight_tokens += n
            if sr.samples:
                req.num_output_placeholders += 1 + sr.num_draft_tokens
            req.last_scheduled_step = step
        self.in_flight[step] = (reqs, [r.num_preemptions for r in reqs])
        self.next_step_id += 1
        self.stats.num_steps += 1

    def _pick_victim(self, req: Request) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, req: Request) -> None:
        """Recompute later. num_in_flight_tokens is kept: it drains as old steps return."""
        self.running.remove(req)
        self.kv.free(req, fence_step=req.last_scheduled_step)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.preempted_req_ids.add(req.request_id)
        self.waiting.prepend([req])

    # -- update ----------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        """Settle a processed step: return its tokens from the in-flight counts, roll back
        rejected drafts, append tokens, finish stopped requests, then apply the
        connector's report and release frees fenced behind this step."""
        step = scheduler_output.step_id
        entries = self.in_flight.get(step)
        if entries is None:
            raise RequestError(f"output for step {step}, which is not in flight")
        reqs, epochs = entries
        sampled_rows = self._rows_in_scheduled_order(step, reqs, runner_output)
        del self.in_flight[step]
        if runner_output.prompt_logprobs:
            self._receive_prompt_logprobs(reqs, runner_output.prompt_logprobs)
        outputs: list[RequestOutput] = []
        any_finished = False
        max_model_len = self.config.max_model_len
        block_size = self.kv.block_size
        logprobs_of = runner_output.logprobs
        proposed_of = runner_output.num_draft_tokens
        num_generated = 0
        scheduled = scheduler_output.requests
        fast = self.plain_decode_fast_path
        i, num_rows = 0, len(reqs)
        while i < num_rows:
            if fast:
                start = i
                i = settle_plain_decodes(scheduled, reqs, epochs, sampled_rows, i, max_model_len, block_size,
                                         logprobs_of, outputs)
                num_generated += i - start  # one token each
                if i == num_rows:
                    break
            sr, req, epoch, sampled = scheduled[i], reqs[i], epochs[i], sampled_rows[i]
            i += 1
            req.num_in_flight_tokens -= sr.num_scheduled_tokens  # first, whatever happened since
            if req.status >= FINISHED:
                continue
            if sr.samples and epoch == req.num_preemptions:  # not from before a preemption
                drafts = sr.num_draft_tokens
                if drafts:
                    self._roll_back_rejected_drafts(sr, req, sampled, proposed_of)
                req.num_output_placeholders -= 1 + drafts
            if not sampled:
                continue
            new_tokens, status = append_tokens(req, sampled, max_model_len, block_size)
            num_generated += len(new_tokens)
            if status is not None:
                any_finished = True
                self._finish(req, status)
            cached = req.num_cached_tokens
            outputs.append(
                RequestOutput(
                    sr.request_id, new_tokens, status is not None, status.finish_reason if status else None,
                    req.stop_reason, logprobs_of.get(sr.request_id) if logprobs_of else None,
                    cached if cached > 0 else 0, take_prompt_logprobs(req),
                )
            )
        self.stats.num_generated_tokens += num_generated
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        if runner_output.kv_connector_output is not None and self.transfer is not None:
            self.transfer.update(runner_output.kv_connector_output, self.waiting)
        self.kv.step_processed(step)
        return outputs

    @staticmethod
    def _receive_prompt_logprobs(reqs: list[Request], chunks: dict[str, PromptLogprobChunk]) -> None:
        for req in reqs:
            chunk = chunks.get(req.request_id)
            if chunk is not None and req.status < FINISHED:
                receive_prompt_logprobs(req, chunk)

    @staticmethod
    def _rows_in_scheduled_order(step: int, reqs: list[Request], runner_output: ModelRunnerOutput) -> list[list[int]]:
        """The runner's sampled rows in the step's request order (usually already so)."""
        scheduled_ids = [req.request_id for req in reqs]
        rows = runner_output.sampled_token_ids
        if runner_output.req_ids == scheduled_ids:
            return rows
        index = {rid: k for k, rid in enumerate(runner_output.req_ids)}
        unknown = index.keys() - set(scheduled_ids)
        if unknown:
            raise RequestError(f"output of step {step} names requests it did not schedule: {sorted(unknown)[:5]}")
        return [rows[index[rid]] if rid in index else EMPTY for rid in scheduled_ids]

    def _roll_back_rejected_drafts(
        self, sr: ScheduledRequest, req: Request, sampled: list[int], proposed_of: dict[str, int] | None
    ) -> None:
        """Give back the computed slots of the step's rejected drafts; count acceptance."""
        drafts = sr.num_draft_tokens
        accepted = len(sampled) - 1 if sampled else 0
        req.num_computed_tokens -= drafts - accepted if sampled else 0
        # Drafts the executor really proposed (fewer than the slots when its drafter found
        # nothing): acceptance stats count those; rollback uses the scheduled slots.
        self.stats.record_spec(proposed_of.get(sr.request_id, drafts) if proposed_of else drafts, accepted)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status != RequestStatus.RUNNING:
            self.waiting.remove(req)  # finished by a step from before its preemption
        elif self.config.enable_prefix_caching:
            # Publish what the last steps filled: with drafts a step fills a block
            # before its tokens are known, and no allocation follows a finish.
            self.kv.cache_blocks(req, min(req.num_processed_tokens, req.num_tokens), final=True)
        req.status = status
        self._free_request(req)

    def _free_request(self, req: Request) -> None:
        del self.requests[req.request_id]
        self.finished_req_ids.add(req.request_id)
        self.kv.done_growing(req.request_id)
        if self.transfer is not None and self.transfer.request_finished(req):
            return  # a store reads its blocks: freed when it reports
        self.kv.free(req, fence_step=req.last_scheduled_step)

    def make_stats(self) -> SchedulerStats:
        self.stats.num_running = len(self.running)
        self.stats.num_waiting = len(self.waiting)
        self.stats.kv_usage = self.kv.usage
        self.stats.prefix_cache_hit_rate = self.kv.prefix_cache_stats.hit_rate
        if self.connector is not None:
            self.connector.record_stats(self.stats)
        return self.stats
