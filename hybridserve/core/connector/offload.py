"""The scheduler side of host-memory KV offload: which block hashes the host pool holds.

The host pool has `num_host_blocks` slots; a slot holds one block of one KV cache group
(all the group's layers). This side decides everything about slots; the executor side
(e.g. executor/torch/offload.py) only copies what the metadata says::

    request finishes  -> request_finished: store its full blocks (processed basis) into
                         free or LRU-evicted slots; the scheduler delays the device free
    store reported    -> update_connector_output: the slots become hits (index entries)
    request admitted  -> get_num_new_matched_tokens: the longest run of host hits after
                         the device prefix hit; update_state_after_alloc: load them into
                         the request's fresh blocks; the slots stay pinned
    load reported     -> update_connector_output: unpin

Invariants:
- a slot is in exactly one of: free, pending (a store is writing it), indexed;
- an indexed slot with a pin count > 0 (a load still reads it) is never evicted, so a
  load always reads what was indexed when it was planned;
- an entry enters the index only after the executor reports its store done, so a load
  never reads a half-written slot.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Hashable

from hybridserve.core.connector.base import KVConnectorBase
from hybridserve.core.errors import ConfigError
from hybridserve.core.kv.spec import ChunkedLocalAttentionSpec, KVCacheConfig, MambaSpec, SlidingWindowSpec
from hybridserve.core.request import Request

NULL_BLOCK = 0
HostKey = tuple[Hashable, int]  # (block hash, group index)


@dataclass
class TransferJob:
    """One request's copies: block i moves between device block `block_ids[i]` of group
    `groups[i]` and host slot `host_slots[i]` (device -> host for a store, back for a load)."""

    request_id: str
    block_ids: list[int] = field(default_factory=list)
    host_slots: list[int] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)

    def add(self, block_id: int, slot: int, group: int) -> None:
        self.block_ids.append(block_id)
        self.host_slots.append(slot)
        self.groups.append(group)


@dataclass
class OffloadMeta:
    """One step's new jobs for the executor side, attached to its SchedulerOutput."""

    loads: list[TransferJob] = field(default_factory=list)
    stores: list[TransferJob] = field(default_factory=list)


@dataclass
class OffloadStats:
    num_stored_blocks: int = 0  # blocks copied device -> host (reported done)
    num_loaded_blocks: int = 0  # blocks planned host -> device
    num_hit_tokens: int = 0  # prompt tokens served from host memory (planned loads)
    num_evicted_blocks: int = 0  # index entries dropped by the LRU bound


class HostOffloadConnector(KVConnectorBase):
    """LRU index of host slots keyed by (block hash, group); plans loads and stores."""

    def __init__(self, kv_cache_config: KVCacheConfig, num_host_blocks: int) -> None:
        if num_host_blocks < 1:
            raise ConfigError(f"the KV offload pool must hold at least one block, got {num_host_blocks}")
        self.specs = [g.spec for g in kv_cache_config.groups]
        self.block_size = kv_cache_config.block_size
        self.num_host_blocks = num_host_blocks
        self.index: OrderedDict[HostKey, int] = OrderedDict()  # LRU order: oldest first
        self.free_slots: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self.pins: dict[int, int] = {}  # slot -> loads still reading it
        self.pending_keys: set[HostKey] = set()  # stores in flight (not yet indexed)
        self.pending_stores: dict[str, list[tuple[HostKey, int]]] = {}
        self.pending_loads: dict[str, list[int]] = {}
        self._matched: dict[str, tuple[int, int]] = {}  # request -> (first, end) block span
        self._meta = OffloadMeta()
        self.stats = OffloadStats()

    def bind_kv_cache_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.specs = [g.spec for g in kv_cache_config.groups]
        if any(isinstance(s, MambaSpec) and not s.block_checkpoints for s in self.specs):
            raise ConfigError("KV offload of a Mamba model needs prefix caching (only then are its states kept "
                              "per block); enable prefix caching or set kv_offload_memory to 0")

    # -- hit search -----------------------------------------------------------------
    def _first_needed(self, g: int, end: int) -> int:
        """First block of group g that the token at position `end` (the first computed) reads:
        (b + 1) * bs > end - W + 1 for a sliding window W, > the chunk start for chunked
        local attention, the checkpoint at `end` (block end/bs - 1) for a Mamba group,
        every block for full attention."""
        s, bs = self.specs[g], self.block_size
        if isinstance(s, SlidingWindowSpec):
            return max(0, (end - s.sliding_window + 1) // bs)
        if isinstance(s, ChunkedLocalAttentionSpec):
            return (end // s.attention_chunk_size) * s.attention_chunk_size // bs
        if isinstance(s, MambaSpec):
            return max(0, end // bs - 1)
        return 0

    def get_num_new_matched_tokens(self, request: Request, num_local_computed_tokens: int) -> tuple[int, bool]:
        """Longest end (a block boundary before the last token) whose needed blocks past the
        device hit are all in host memory::

            tokens  [ device hit | host hit ........ | computed ]
                    0          first*bs        end*bs       num_tokens

        Full-attention groups need every block, so they bound the end by their contiguous
        run (one pass); windowed groups are then checked only over their window per end.
        """
        bs = self.block_size
        hashes = request.block_hashes
        index = self.index
        first = num_local_computed_tokens // bs
        limit = min(len(hashes), (request.num_tokens - 1) // bs)
        windowed = []
        for g, spec in enumerate(self.specs):
            if isinstance(spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec, MambaSpec)):
                windowed.append(g)
                continue
            b = first
            while b < limit and (hashes[b], g) in index:
                b += 1
            limit = b
        for end_block in range(limit, first, -1):
            end = end_block * bs
            if all((hashes[b], g) in index for g in windowed
                   for b in range(max(first, self._first_needed(g, end)), end_block)):
                self._matched[request.request_id] = (first, end_block)
                return (end_block - first) * bs, True
        self._matched.pop(request.request_id, None)
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:
        span = self._matched.pop(request.request_id, None)
        if not num_external_tokens or span is None:
            return
        first, end_block = span
        end = end_block * self.block_size
        job = TransferJob(request.request_id)
        starts = [self._first_needed(g, end) for g in range(len(block_ids))]
        for b in range(first, end_block):
            for g, table in enumerate(block_ids):
                if b < starts[g] or table[b] == NULL_BLOCK:
                    continue  # never read by this request (the scheduler prunes it before caching)
                key = (request.block_hashes[b], g)
                slot = self.index[key]  # present: matched in this same schedule() call
                self.index.move_to_end(key)
                self.pins[slot] = self.pins.get(slot, 0) + 1
                job.add(table[b], slot, g)
        self.pending_loads[request.request_id] = job.host_slots
        self.stats.num_loaded_blocks += len(job.block_ids)
        self.stats.num_hit_tokens += num_external_tokens
        self._meta.loads.append(job)

    # -- stores -----------------------------------------------------------------------
    def _take_slot(self) -> int | None:
        """A free slot, else the least recently used unpinned entry's; None if all are pinned."""
        if self.free_slots:
            return self.free_slots.pop()
        for key, slot in self.index.items():
            if not self.pins.get(slot):
                del self.index[key]
                self.stats.num_evicted_blocks += 1
                return slot
        return None

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, Any]:
        """Store the full blocks below the processed count (the table arrives pruned on that
        basis). Steps still in flight write only at positions >= num_processed_tokens, so
        these blocks are settled; the scheduler holds them until the store is reported."""
        if request.request_id in self.pending_stores:
            return False, None  # a reused id while its earlier store runs: skip, stay consistent
        n = min(len(request.block_hashes), request.num_processed_tokens // self.block_size)
        job = TransferJob(request.request_id)
        planned: list[tuple[HostKey, int]] = []
        for g, table in enumerate(block_ids):
            for b in range(min(n, len(table))):
                if table[b] == NULL_BLOCK:
                    continue
                key = (request.block_hashes[b], g)
                if key in self.index:
                    self.index.move_to_end(key)  # already held: refresh, copy nothing
                    continue
                if key in self.pending_keys:
                    continue
                slot = self._take_slot()
                if slot is None:
                    break  # every slot is pinned by a running load: store nothing more
                self.pending_keys.add(key)
                planned.append((key, slot))
                job.add(table[b], slot, g)
        if not planned:
            return False, None
        self.pending_stores[request.request_id] = planned
        self._meta.stores.append(job)
        return True, None

    # -- step plumbing ------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> OffloadMeta | None:
        meta, self._meta = self._meta, OffloadMeta()
        return meta if meta.loads or meta.stores else None

    def update_connector_output(self, kco: Any) -> None:
        """Finished stores become hits; finished loads unpin their slots (failed ones too:
        the host copy itself is intact)."""
        for rid in kco.finished_sending:
            for key, slot in self.pending_stores.pop(rid, ()):
                self.pending_keys.discard(key)
                self.index[key] = slot
                self.stats.num_stored_blocks += 1
        for rid in kco.finished_recving:
            for slot in self.pending_loads.pop(rid, ()):
                left = self.pins[slot] - 1
                if left:
                    self.pins[slot] = left
                else:
                    del self.pins[slot]

    def record_stats(self, stats: Any) -> None:
        stats.num_offloaded_blocks = self.stats.num_stored_blocks
        stats.num_offload_loaded_blocks = self.stats.num_loaded_blocks
        stats.num_offload_hit_tokens = self.stats.num_hit_tokens

    @property
    def num_used_slots(self) -> int:
        return self.num_host_blocks - len(self.free_slots)
