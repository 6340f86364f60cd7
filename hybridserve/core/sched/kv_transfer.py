"""The scheduler's side of KV transfer: async loads, failed loads, stores at finish.

`KVTransferState` owns what the scheduler must remember about a connector's jobs:
which loads have reported done, which finished requests keep their blocks until a
store reports, and which aborted requests keep theirs until their load reports. It
works on the KV cache manager, the connector and the stats it is given, and on the
waiting queue passed to `update`; it never reads the scheduler.
"""

from __future__ import annotations

from typing import Any, Iterable

from hybridserve.core.connector.base import KVConnectorBase
from hybridserve.core.kv.cache_manager import KVCacheManager
from hybridserve.core.kv.single_type_managers import FullAttentionManager
from hybridserve.core.request import Request, RequestStatus
from hybridserve.core.sched.stats import SchedulerStats


class KVTransferState:
    def __init__(self, kv: KVCacheManager, connector: KVConnectorBase, stats: SchedulerStats) -> None:
        self.kv = kv
        self.connector = connector
        self.stats = stats
        self.finished_recving: set[str] = set()  # loads reported done, request not yet resumed
        self.awaiting_store: dict[str, Request] = {}  # finished; blocks freed once the store reports
        self.aborted_loading: dict[str, Request] = {}  # aborted; blocks freed once the load reports
        # Released while at the head of the queue: no earlier request needed the blocks, so
        # its own load was what could not fit; its next admission skips the connector.
        self.skip_load_once: set[str] = set()

    def has_pending(self) -> bool:
        """Finished requests whose blocks still wait on a store or a load."""
        return bool(self.awaiting_store or self.aborted_loading)

    def load_done(self, request_id: str) -> bool:
        return request_id in self.finished_recving

    def finish_remote_load(self, req: Request) -> None:
        """A request whose load reported done becomes WAITING with the loaded tokens computed."""
        self.finished_recving.discard(req.request_id)
        req.num_computed_tokens += req.num_external_computed_tokens
        req.num_external_computed_tokens = 0
        req.status = RequestStatus.WAITING
        # A windowed group got real blocks for the whole loaded span, but a connector loads
        # only the ones inside the window (chunk) of the first computed token; prune the
        # rest before caching so no unloaded block is published under its hash. The request
        # has no step in flight here, so this count is the processed basis.
        self.kv.remove_skipped_blocks(req.request_id, req.num_processed_tokens)
        self.kv.cache_blocks(req, req.num_computed_tokens)

    def loading(self, req: Request) -> bool:
        """A load still writes into the request's blocks (not yet reported done)."""
        return req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and req.request_id not in self.finished_recving

    def release_load(self, req: Request, at_head: bool) -> None:
        """Give back the blocks a waiting request holds from a load reported done, and undo
        what the load set up, so it is admitted again from scratch (prefix and connector
        lookups included; the loaded blocks were cached, so its own device hits may still
        serve it). The connector has nothing to undo: a reported load already unpinned its
        slots, and its hit was counted once, when planned (loading it again is a new load,
        counted again). No step of the request is in flight (none was scheduled since its
        load, and admission starts no load while old steps are out), so the fence has
        passed and its blocks go back at once; a block another request hit in the prefix
        cache keeps that reference. at_head: nothing waits ahead of it (skip_load_once)."""
        rid = req.request_id
        self.finished_recving.discard(rid)
        self.kv.free(req, fence_step=req.last_scheduled_step)
        req.num_computed_tokens = req.num_external_computed_tokens = 0
        req.status = RequestStatus.WAITING
        if at_head:
            self.skip_load_once.add(rid)
        self.stats.num_released_loads += 1

    def abort(self, req: Request) -> bool:
        """Note an abort. True: a load still writes into its blocks, which are then freed
        when the load reports (the caller must not free them now)."""
        rid = req.request_id
        self.skip_load_once.discard(rid)
        if self.loading(req):
            self.aborted_loading[rid] = req
            return True
        self.finished_recving.discard(rid)
        return False

    def request_finished(self, req: Request) -> bool:
        """Hand the connector the request's table pruned on the processed basis (never the
        optimistic one). True: a store reads the blocks; they are freed when it reports."""
        basis = req.num_computed_tokens if self.kv.unsafe_optimistic_free else req.num_processed_tokens
        self.kv.remove_skipped_blocks(req.request_id, basis)
        delay, _ = self.connector.request_finished(req, self.kv.get_block_ids(req.request_id))
        if delay:
            self.awaiting_store[req.request_id] = req
        return delay

    def update(self, kco: Any, waiting: Iterable[Request]) -> None:
        """A step's connector report: done loads and stores, and failed load blocks."""
        self.connector.update_connector_output(kco)
        self.finished_recving |= kco.finished_recving
        for rid in kco.finished_recving & self.aborted_loading.keys():
            self.finished_recving.discard(rid)
            self.kv.free(self.aborted_loading.pop(rid))
        for rid in kco.finished_sending:
            req = self.awaiting_store.pop(rid, None)
            if req is not None:
                self.kv.free(req, fence_step=req.last_scheduled_step)
        if kco.invalid_block_ids:
            self._handle_failed_loads(kco.invalid_block_ids, waiting)

    def _handle_failed_loads(self, invalid: set[int], waiting: Iterable[Request]) -> None:
        """Rewind requests whose loaded blocks failed to the last prefix every group can serve.

        Full attention can resume at the first failed block. A windowed group holds real
        blocks only where the load's end reads (the rest of the span went back at
        allocation), so with such a group the request starts over: it frees its blocks
        and is admitted again, prefix lookups included.
        """
        bs = self.kv.block_size
        windowed = any(not isinstance(m, FullAttentionManager) for m in self.kv.coordinator.managers)
        for req in list(waiting):
            if req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            loaded_end = req.num_computed_tokens + req.num_external_computed_tokens
            valid = loaded_end
            for table in self.kv.get_block_ids(req.request_id):
                for pos, bid in enumerate(table):
                    if bid in invalid:
                        valid = min(valid, pos * bs)
                        break
            if valid >= loaded_end:
                continue
            self.stats.num_failed_loads += 1
            if windowed:
                self.kv.free(req)  # nothing in flight: the load is reported done
                self.finished_recving.discard(req.request_id)
                req.num_computed_tokens = req.num_external_computed_tokens = 0
                req.status = RequestStatus.WAITING
                continue
            req.num_external_computed_tokens = max(0, valid - req.num_computed_tokens)
            req.num_computed_tokens = min(req.num_computed_tokens, valid)
