"""Admission: waiting requests become running (prefix hits, connector hits, first chunk).

`Admission.admit` takes waiting requests in queue order while the step has budget and
the batch has room, allocates their slots (after prefix-cache and connector lookups),
and adds each one's first chunk to the step. A request whose connector load is async
gets its blocks and waits (WAITING_FOR_REMOTE_KVS) until `KVTransferState` reports the
load done. It works on the queue, the running list and the batch it is given.

Waiting requests that hold loaded blocks can starve one another (with nothing running,
none fits beside the others' blocks, and no step will free any) or the only running
request (it preempts itself, comes back, and preempts itself again for ever). The
scheduler then calls `release_last_holder`, which gives back the blocks of the last
such holder in queue order (the released one is admitted again later).
"""

from __future__ import annotations

from hybridserve.core.connector.base import KVConnectorBase
from hybridserve.core.kv.cache_manager import KVCacheManager
from hybridserve.core.request import Request, RequestStatus
from hybridserve.core.sched.config import SchedulerConfig
from hybridserve.core.sched.kv_transfer import KVTransferState
from hybridserve.core.sched.output import NewRequestData, ScheduledRequest
from hybridserve.core.sched.planner import StepBatch
from hybridserve.core.sched.queues import WaitingQueue


class Admission:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        connector: KVConnectorBase | None,
        transfer: KVTransferState | None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.connector = connector
        self.transfer = transfer

    def admit(self, batch: StepBatch, waiting: WaitingQueue, running: list[Request]) -> None:
        cfg, kv, connector = self.config, self.kv, self.connector
        skipped: list[Request] = []
        # Full-sequence admission reserves what admitted requests will still grow by.
        reserved = kv.outstanding_blocks(running) if cfg.full_sequence_must_fit and waiting else 0
        # Once a request cannot get blocks, only waiting requests that already hold blocks
        # (a finished or finishing connector load) may still go: waiting behind a request
        # that needs those very blocks would stall the engine for good.
        holders_only = False
        while len(waiting) and batch.budget > 0 and len(running) < cfg.max_num_seqs:
            req = waiting.peek()
            if holders_only and not kv.holds_blocks(req.request_id):
                skipped.append(waiting.pop())
                continue
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                assert self.transfer is not None
                if not self.transfer.load_done(req.request_id):
                    skipped.append(waiting.pop())
                    continue
                self.transfer.finish_remote_load(req)
            if req.num_in_flight_tokens:
                # Steps from before a preemption are still out: resume after they return.
                skipped.append(waiting.pop())
                continue
            hits, num_hit, num_external, load_async = kv.coordinator.empty(), 0, 0, False
            if not kv.holds_blocks(req.request_id):  # not resuming after a (failed) load
                hits, num_hit = kv.get_computed_blocks(req)
                if connector is not None and not self._skips_load(req):
                    num_external, load_async = connector.get_num_new_matched_tokens(req, num_hit)
            num_computed = req.num_computed_tokens + num_hit + num_external
            if load_async:
                n = 0
            else:
                n = min(req.num_tokens - num_computed, batch.budget, cfg.max_model_len - 1 - num_computed)
                if cfg.long_prefill_token_threshold:
                    n = min(n, cfg.long_prefill_token_threshold)
                if n <= 0:
                    break
            new_blocks = kv.allocate_slots(
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
                # Scan on only while some request outside the running list holds blocks.
                if holders_only or kv.num_requests_holding_blocks <= len(running):
                    break
                skipped.append(waiting.pop())
                holders_only = True
                continue
            if cfg.full_sequence_must_fit:
                reserved += kv.outstanding_blocks([req])
            waiting.pop()
            if connector is not None:
                connector.update_state_after_alloc(req, kv.get_block_ids(req.request_id), num_external)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                if cfg.enable_prefix_caching:
                    kv.record_prefix_lookup(req.num_tokens, num_hit)
            if load_async:
                req.num_computed_tokens = num_hit
                req.num_external_computed_tokens = num_external
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                skipped.append(req)
                continue
            req.num_computed_tokens = num_computed
            req.status = RequestStatus.RUNNING
            running.append(req)
            new = NewRequestData(
                req.request_id, req.prompt_token_ids, req.sampling_params, req.all_token_ids, req.eos_token_id
            )
            samples = num_computed + n >= req.num_tokens
            batch.add(ScheduledRequest(
                req.request_id, num_computed, n, 0, kv.get_block_ids(req.request_id),
                kv.get_num_null_blocks(req.request_id), samples, new,
            ), req)
        if skipped:
            waiting.prepend(skipped)

    def _skips_load(self, req: Request) -> bool:
        """Once, after `release_last_holder` released it at the head of the queue; always
        for a request that asks for prompt logprobs (loaded positions would lack logits)."""
        if req.sampling_params.prompt_logprobs is not None:
            return True
        transfer = self.transfer
        if transfer is None or req.request_id not in transfer.skip_load_once:
            return False
        transfer.skip_load_once.discard(req.request_id)
        return True

    def release_last_holder(self, waiting: WaitingQueue, yielding_to: Request | None = None) -> bool:
        """Give back the blocks of the last waiting request in queue order that holds a
        load reported done (the latest comer yields, as a preemption picks the last
        running request); returns whether it released one (the caller allocates again).

        Only a step's output, a store's report or an aborted load's report frees blocks;
        a load reporting done frees none. So when nothing runs, no step is in flight and
        no store or aborted load is pending (yielding_to None; the caller checked the
        first two), the blocks free now are all there will be, and if admission took
        nothing, nothing ever fits. With a load still writing somewhere nothing is
        released then: it could stall the same way once it reports, and releasing now
        would only let holders load again while it runs.

        yielding_to: the only running request, about to preempt itself for blocks. After
        that it would come back, still not fit beside the holders, and preempt itself
        again for ever; a holder that would queue after it yields instead (any under
        FCFS, as a preempted request goes back to the head; one with a later
        (priority, arrival) under the priority policy)."""
        transfer = self.transfer
        if transfer is None:
            return False
        holders = [r for r in waiting if self.kv.holds_blocks(r.request_id)]
        if yielding_to is None:
            if transfer.has_pending() or any(transfer.loading(r) for r in holders):
                return False
        else:
            holders = [r for r in holders if not transfer.loading(r) and self._queues_after(r, yielding_to)]
        if not holders:
            return False
        last = holders[-1]
        transfer.release_load(last, at_head=yielding_to is None and last is waiting.peek())
        return True

    def _queues_after(self, req: Request, other: Request) -> bool:
        """Whether req comes after `other` in the waiting queue once `other` is preempted."""
        if self.config.policy == "priority":
            return (req.priority, req.arrival_time) > (other.priority, other.arrival_time)
        return True
