"""The scheduler's side of KV transfer: async loads, failed loads, stores at finish.

A mixin of Scheduler (kept apart to keep the scheduling loop readable). It reads and
writes the scheduler's state: `kv`, `waiting`, `connector`, `stats`, `finished_recving`,
`awaiting_store`, `aborted_loading`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybridserve.core.kv.managers import FullAttentionManager
from hybridserve.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from hybridserve.core.sched.scheduler import Scheduler


class KVTransferMixin:
    def _finish_remote_load(self: Scheduler, req: Request) -> None:
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

    def _update_connector(self: Scheduler, kco: Any) -> None:
        assert self.connector is not None
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
            self._handle_failed_loads(kco.invalid_block_ids)

    def _handle_failed_loads(self: Scheduler, invalid: set[int]) -> None:
        """Rewind requests whose loaded blocks failed to the last prefix every group can serve.

        Full attention can resume at the first failed block. A windowed group holds real
        blocks only where the load's end reads (the rest of the span went back at
        allocation), so with such a group the request starts over: it frees its blocks
        and is admitted again, prefix lookups included.
        """
        bs = self.kv.block_size
        windowed = any(not isinstance(m, FullAttentionManager) for m in self.kv.coordinator.managers)
        for req in list(self.waiting):
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

    def _connector_finished(self: Scheduler, req: Request) -> tuple[bool, Any]:
        """Hand the connector the table pruned on the processed basis, never the optimistic one."""
        basis = req.num_computed_tokens if self.kv.unsafe_optimistic_free else req.num_processed_tokens
        self.kv.remove_skipped_blocks(req.request_id, basis)
        assert self.connector is not None
        return self.connector.request_finished(req, self.kv.get_block_ids(req.request_id))
