"""Continuous-batching scheduler that stays correct while steps are in flight.

Per step: running requests first (chunked prefills, decodes with draft slots), then
waiting ones (prefix hits, connector hits), one token budget. `schedule()` advances
counts optimistically; `update_from_output()` settles them. Counters per request::

    schedule():            num_computed_tokens += n   num_in_flight_tokens += n
                           (sampling step) num_output_placeholders += 1 + drafts
    update_from_output():  num_in_flight_tokens -= n  (always, first)
                           num_computed_tokens -= rejected drafts
                           num_output_placeholders -= 1 + drafts
"""

from __future__ import annotations

from hybridserve.core.connector.base import KVConnectorBase
from hybridserve.core.errors import RequestError
from hybridserve.core.kv.manager import KVCacheManager
from hybridserve.core.kv.spec import KVCacheConfig
from hybridserve.core.request import Request, RequestStatus
from hybridserve.core.sched.config import SchedulerConfig
from hybridserve.core.sched.output import (
    ModelRunnerOutput,
    NewRequestData,
    RequestOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from hybridserve.core.sched.kv_transfer import KVTransferMixin
from hybridserve.core.sched.queues import make_queue
from hybridserve.core.sched.stats import SchedulerStats, check_stop

FINISHED = RequestStatus.FINISHED_STOPPED  # statuses >= this are finished
EMPTY: list[int] = []


class Scheduler(KVTransferMixin):
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_config: KVCacheConfig,
        connector: KVConnectorBase | None = None,
        unsafe_optimistic_free: bool = False,
        window_tail: bool | None = None,
    ) -> None:
        """window_tail: override config.window_tail_allocation (None: use the config;
        builders resolve the config's None from the executor, see engine.build_engine)."""
        self.config = config
        use_tail = config.window_tail_allocation if window_tail is None else window_tail
        self.kv = KVCacheManager(
            kv_cache_config,
            max_model_len=config.max_model_len,
            max_in_flight_tokens=config.max_in_flight_tokens,
            enable_caching=config.enable_prefix_caching,
            unsafe_optimistic_free=unsafe_optimistic_free,
            window_tail=config.window_tail if use_tail else None,
        )
        self.connector = connector
        if connector is not None:
            connector.bind_kv_cache_config(self.kv.config)
        self.requests: dict[str, Request] = {}
        self.waiting = make_queue(config.policy)
        self.running: list[Request] = []
        self.next_step_id = 0
        # step id -> (its requests, each one's num_preemptions when scheduled)
        self.in_flight: dict[int, tuple[list[Request], list[int]]] = {}
        self.finished_req_ids: set[str] = set()
        self.preempted_req_ids: set[str] = set()
        self.finished_recving: set[str] = set()
        self.awaiting_store: dict[str, Request] = {}
        self.aborted_loading: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self.no_block_ids: tuple[list[int], ...] = tuple([] for _ in kv_cache_config.groups)

    @property
    def kv_cache_manager(self) -> KVCacheManager:
        return self.kv

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
            loading = req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and rid not in self.finished_recving
            req.status = RequestStatus.FINISHED_ABORTED
            if loading:
                # A load is still writing into its blocks: free them when it reports done.
                del self.requests[rid]
                self.finished_req_ids.add(rid)
                self.aborted_loading[rid] = req
            else:
                self.finished_recving.discard(rid)
                self._free_request(req)
        if aborted:
            self.running = [r for r in self.running if not r.is_finished]

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or finished ones whose blocks wait on a connector store/load."""
        return bool(self.requests or self.awaiting_store or self.aborted_loading)

    @property
    def num_in_flight_steps(self) -> int:
        return len(self.in_flight)

    # -- schedule ------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        scheduled_reqs: list[Request] = []
        preempted_now = False
        i = 0
        running, kv, no_block_ids = self.running, self.kv, self.no_block_ids
        # Steady decodes (one token, no drafts, no block to allocate, free or cache) take a
        # short path: most requests of most steps are exactly that.
        short_path = not cfg.num_speculative_tokens
        unblocked = cfg.async_scheduling
        last_position = cfg.max_model_len - 1
        while i < len(running) and budget > 0:
            req = running[i]
            if short_path and (unblocked or not req.num_in_flight_tokens):
                computed = req.num_computed_tokens
                num_outputs = len(req.output_token_ids) + req.num_output_placeholders
                if (len(req.prompt_token_ids) + num_outputs == computed + 1 and computed < last_position
                        and req.sampling_params.max_tokens > num_outputs):
                    nulls = kv.append_decode_slot(req)
                    if nulls is not None:
                        scheduled.append(ScheduledRequest(req.request_id, computed, 1, 0, no_block_ids, nulls, True))
                        scheduled_reqs.append(req)
                        budget -= 1
                        i += 1
                        continue
            sr = self._plan_running(req, budget)
            if sr is None:
                i += 1
                continue
            n = sr.num_scheduled_tokens
            while True:
                new_blocks = self.kv.allocate_slots(req, n)
                if new_blocks is not None:
                    break
                victim = self._pick_victim(req)
                preempted_now = True
                vi = self.running.index(victim)
                self._preempt(victim)
                if victim is req:
                    break
                if victim in scheduled_reqs:
                    j = scheduled_reqs.index(victim)
                    budget += scheduled[j].num_scheduled_tokens
                    del scheduled[j], scheduled_reqs[j]
                if vi < i:
                    i -= 1
            if req.status != RequestStatus.RUNNING:
                continue  # preempted itself; running shrank, i now points at the next one
            if new_blocks is self.kv.no_new_blocks:
                sr.new_block_ids = self.no_block_ids
            else:
                sr.new_block_ids = tuple([b.block_id for b in g] for g in new_blocks)
            sr.num_null_blocks = self.kv.get_num_null_blocks(req.request_id)
            scheduled.append(sr)
            scheduled_reqs.append(req)
            budget -= n
            i += 1

        if not preempted_now:
            budget = self._schedule_waiting(budget, scheduled, scheduled_reqs)

        out = SchedulerOutput(
            step_id=self.next_step_id,
            requests=scheduled,
            total_num_scheduled_tokens=cfg.max_num_batched_tokens - budget,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=self.preempted_req_ids,
        )
        self.finished_req_ids, self.preempted_req_ids = set(), set()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        self._update_after_schedule(out, scheduled_reqs)
        return out

    def _plan_running(self, req: Request, budget: int) -> ScheduledRequest | None:
        """How many tokens (and drafts) a running request gets, or None to skip it."""
        cfg = self.config
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

    def _schedule_waiting(
        self, budget: int, scheduled: list[ScheduledRequest], scheduled_reqs: list[Request]
    ) -> int:
        cfg = self.config
        skipped: list[Request] = []
        # Full-sequence admission reserves what admitted requests will still grow by.
        reserved = self.kv.outstanding_blocks(self.running) if cfg.full_sequence_must_fit and self.waiting else 0
        while len(self.waiting) and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting.peek()
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if req.request_id not in self.finished_recving:
                    skipped.append(self.waiting.pop())
                    continue
                self._finish_remote_load(req)
            if req.num_in_flight_tokens:
                # Steps from before a preemption are still out: resume after they return.
                skipped.append(self.waiting.pop())
                continue
            hits, num_hit, num_external, load_async = self.kv.coordinator.empty(), 0, 0, False
            if not self.kv.holds_blocks(req.request_id):  # not resuming after a (failed) load
                hits, num_hit = self.kv.get_computed_blocks(req)
                if self.connector is not None:
                    num_external, load_async = self.connector.get_num_new_matched_tokens(req, num_hit)
            num_computed = req.num_computed_tokens + num_hit + num_external
            if load_async:
                n = 0
            else:
                n = min(req.num_tokens - num_computed, budget, cfg.max_model_len - 1 - num_computed)
                if cfg.long_prefill_token_threshold:
                    n = min(n, cfg.long_prefill_token_threshold)
                if n <= 0:
                    break
            new_blocks = self.kv.allocate_slots(
                req,
                n,
                num_new_computed_tokens=num_hit,
                new_computed_blocks=hits,
                num_external_computed_tokens=num_external,
                delay_cache_blocks=load_async,
                full_sequence_must_fit=cfg.full_sequence_must_fit,
                num_reserved_blocks=reserved,
            )
            if new_blocks is None:
                break
            if cfg.full_sequence_must_fit:
                reserved += self.kv.outstanding_blocks([req])
            self.waiting.pop()
            if self.connector is not None:
                self.connector.update_state_after_alloc(req, self.kv.get_block_ids(req.request_id), num_external)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                if self.config.enable_prefix_caching:
                    self.kv.record_prefix_lookup(req.num_tokens, num_hit)
            if load_async:
                req.num_computed_tokens = num_hit
                req.num_external_computed_tokens = num_external
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                skipped.append(req)
                continue
            req.num_computed_tokens = num_computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            block_ids = self.kv.get_block_ids(req.request_id)
            new = NewRequestData(
                req.request_id, req.prompt_token_ids, req.sampling_params, req.all_token_ids, req.eos_token_id
            )
            samples = num_computed + n >= req.num_tokens
            sr = ScheduledRequest(
                req.request_id, num_computed, n, 0, block_ids, self.kv.get_num_null_blocks(req.request_id), samples, new
            )
            scheduled.append(sr)
            scheduled_reqs.append(req)
            budget -= n
        if skipped:
            self.waiting.prepend(skipped)
        return budget

    def _update_after_schedule(self, out: SchedulerOutput, reqs: list[Request]) -> None:
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
        step = scheduler_output.step_id
        entries = self.in_flight.get(step)
        if entries is None:
            raise RequestError(f"output for step {step}, which is not in flight")
        reqs, epochs = entries
        scheduled_ids = [req.request_id for req in reqs]
        sampled_rows = runner_output.sampled_token_ids  # the usual case: in scheduled order
        if runner_output.req_ids != scheduled_ids:
            index = {rid: k for k, rid in enumerate(runner_output.req_ids)}
            unknown = index.keys() - set(scheduled_ids)
            if unknown:
                raise RequestError(f"output of step {step} names requests it did not schedule: {sorted(unknown)[:5]}")
            sampled_rows = [sampled_rows[index[rid]] if rid in index else EMPTY for rid in scheduled_ids]
        del self.in_flight[step]
        outputs: list[RequestOutput] = []
        any_finished = False
        max_model_len = self.config.max_model_len
        block_size = self.kv.block_size
        logprobs_of = runner_output.logprobs
        num_generated = 0
        # Drafts the executor really proposed (fewer than the slots when its drafter found
        # nothing): acceptance stats count those; rollback still uses the scheduled slots.
        proposed_of = runner_output.num_draft_tokens
        for sr, req, epoch, sampled in zip(scheduler_output.requests, reqs, epochs, sampled_rows):
            req.num_in_flight_tokens -= sr.num_scheduled_tokens  # first, whatever happened since
            if req.status >= FINISHED:
                continue
            if sr.samples and epoch == req.num_preemptions:
                drafts = sr.num_draft_tokens
                if drafts:
                    accepted = len(sampled) - 1 if sampled else 0
                    req.num_computed_tokens -= drafts - accepted if sampled else 0
                    self.stats.record_spec(proposed_of.get(sr.request_id, drafts) if proposed_of else drafts, accepted)
                req.num_output_placeholders -= 1 + drafts
            if not sampled:
                continue
            status = None
            if len(sampled) == 1:
                t = sampled[0]
                outs = req.output_token_ids
                outs.append(t)
                new_tokens = sampled
                sp = req.sampling_params
                num_outputs = len(outs)
                num_tokens = len(req.prompt_token_ids) + num_outputs
                # No stop ids, not EOS, below both length limits: nothing can stop it.
                if (sp.stop_token_ids or (t == req.eos_token_id and not sp.ignore_eos)
                        or num_outputs >= sp.max_tokens or num_tokens >= max_model_len):
                    status = check_stop(req, t, max_model_len)
            else:
                new_tokens = []
                for t in sampled:
                    req.output_token_ids.append(t)
                    new_tokens.append(t)
                    status = check_stop(req, t, max_model_len)
                    if status is not None:
                        break
                num_tokens = len(req.prompt_token_ids) + len(req.output_token_ids)
            if req._block_hasher is not None and num_tokens >= (len(req.block_hashes) + 1) * block_size:
                req.update_block_hashes()  # a block just filled up
            num_generated += len(new_tokens)
            if status is not None:
                any_finished = True
                if req.status != RequestStatus.RUNNING:
                    self.waiting.remove(req)  # finished by a step from before its preemption
                elif self.config.enable_prefix_caching:
                    # Publish what the last steps filled: with drafts a step fills a block
                    # before its tokens are known, and no allocation follows a finish.
                    self.kv.cache_blocks(req, min(req.num_processed_tokens, req.num_tokens))
                req.status = status
                self._free_request(req)
            cached = req.num_cached_tokens
            outputs.append(
                RequestOutput(
                    sr.request_id, new_tokens, status is not None, status.finish_reason if status else None,
                    req.stop_reason, logprobs_of.get(sr.request_id) if logprobs_of else None,
                    cached if cached > 0 else 0,
                )
            )
        self.stats.num_generated_tokens += num_generated
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        if runner_output.kv_connector_output is not None:
            self._update_connector(runner_output.kv_connector_output)
        self.kv.step_processed(step)
        return outputs

    def _free_request(self, req: Request) -> None:
        del self.requests[req.request_id]
        self.finished_req_ids.add(req.request_id)
        if self.connector is not None:
            delay, _ = self._connector_finished(req)
            if delay:
                self.awaiting_store[req.request_id] = req
                return
        self.kv.free(req, fence_step=req.last_scheduled_step)

    def make_stats(self) -> SchedulerStats:
        self.stats.num_running = len(self.running)
        self.stats.num_waiting = len(self.waiting)
        self.stats.kv_usage = self.kv.usage
        self.stats.prefix_cache_hit_rate = self.kv.prefix_cache_stats.hit_rate
        if self.connector is not None:
            self.connector.record_stats(self.stats)
        return self.stats
