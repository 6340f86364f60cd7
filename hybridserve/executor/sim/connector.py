"""A simulated CPU-offload connector: the load write-after-read path, in miniature.

Scheduler side: finished requests' full blocks are stored (keyed by block hash, per
group) into a bounded LRU host pool; a later request whose prefix is there gets those
tokens as external hits, loaded asynchronously into its freshly allocated blocks.
Executor side: loads and stores finish a random number of steps after they start, while
other steps run; a load may fail (its blocks reported invalid). With the shadow KV on,
loads write fingerprints into the blocks (as writer "load:<request>"), so a load into a
block that an in-flight step still reads is caught.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from hybridserve.core.connector.base import KVConnectorBase
from hybridserve.core.kv.spec import ChunkedLocalAttentionSpec, KVCacheConfig, MambaSpec, SlidingWindowSpec
from hybridserve.core.request import Request
from hybridserve.core.sched.output import KVConnectorOutput
from hybridserve.executor.sim.shadow_kv import NULL, Violation


@dataclass
class _Job:
    request_id: str
    # (block hash, group, block id, block index) per block
    blocks: list[tuple[int, int, int, int]]
    # loads: the host content to write, taken when the load was planned (LRU may evict later)
    contents: list[list[int] | None] = field(default_factory=list)
    done_step: int = 0
    stamps: list[int] = field(default_factory=list)


@dataclass
class SimConnectorMeta:
    loads: list[_Job]
    stores: list[_Job]


class SimOffloadConnector(KVConnectorBase):
    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        capacity_blocks: int = 4096,
        max_delay_steps: int = 3,
        failure_rate: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.block_size = kv_cache_config.block_size
        self.bind_kv_cache_config(kv_cache_config)
        self.capacity = capacity_blocks
        self.max_delay = max_delay_steps
        self.failure_rate = failure_rate
        self.rng = random.Random(seed)
        # (hash, group) -> slot fingerprints (None when the detector is off)
        self.host: OrderedDict[tuple[int, int], list[int] | None] = OrderedDict()
        self._matched: dict[str, tuple[int, int]] = {}
        self._loads: list[_Job] = []
        self._stores: list[_Job] = []
        self._running: list[tuple[str, _Job]] = []
        self.executor: Any = None
        self.num_loaded_blocks = 0
        self.num_failed_blocks = 0

    def bind_kv_cache_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.specs = [g.spec for g in kv_cache_config.groups]
        # A Mamba group without block checkpoints (no prefix caching) has no state to store.
        self.supported = not any(isinstance(s, MambaSpec) and not s.block_checkpoints for s in self.specs)

    # -- scheduler side -----------------------------------------------------------
    def _needed(self, g: int, b: int, end: int) -> bool:
        """Is block b of group g read by a token at position `end`?"""
        s, bs = self.specs[g], self.block_size
        if isinstance(s, SlidingWindowSpec):
            return (b + 1) * bs > end - s.sliding_window + 1
        if isinstance(s, ChunkedLocalAttentionSpec):
            return (b + 1) * bs > (end // s.attention_chunk_size) * s.attention_chunk_size
        if isinstance(s, MambaSpec):
            return (b + 1) * bs == end  # the state after `end` tokens: its checkpoint
        return True

    def get_num_new_matched_tokens(self, request: Request, num_local_computed_tokens: int) -> tuple[int, bool]:
        if not self.supported:
            return 0, False
        bs = self.block_size
        first = num_local_computed_tokens // bs
        last = min(len(request.block_hashes), (request.num_tokens - 1) // bs)
        for end_block in range(last, first, -1):
            end = end_block * bs
            if all(
                (request.block_hashes[b], g) in self.host
                for b in range(first, end_block)
                for g in range(len(self.specs))
                if self._needed(g, b, end)
            ):
                self._matched[request.request_id] = (first, end_block)
                return (end_block - first) * bs, True
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: tuple[list[int], ...], num_external_tokens: int) -> None:
        span = self._matched.pop(request.request_id, None)
        if not num_external_tokens or span is None:
            return
        first, end_block = span
        end = end_block * self.block_size
        blocks = [
            (request.block_hashes[b], g, block_ids[g][b], b)
            for b in range(first, end_block)
            for g in range(len(self.specs))
            if self._needed(g, b, end) and block_ids[g][b] != NULL
        ]
        self._loads.append(_Job(request.request_id, blocks, [self.host.get((h, g)) for h, g, _, _ in blocks]))

    def build_connector_meta(self, scheduler_output: Any) -> SimConnectorMeta:
        meta = SimConnectorMeta(self._loads, self._stores)
        self._loads, self._stores = [], []
        return meta

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, Any]:
        if not self.supported:
            return False, None
        n = min(len(request.block_hashes), request.num_processed_tokens // self.block_size)
        blocks = [
            (request.block_hashes[b], g, table[b], b)
            for g, table in enumerate(block_ids)
            for b in range(min(n, len(table)))
            if table[b] != NULL
        ]
        if not blocks:
            return False, None
        self._stores.append(_Job(request.request_id, blocks))
        return True, None

    # -- executor side ------------------------------------------------------------
    def attach_executor(self, executor: Any) -> None:
        self.executor = executor

    def run_step(self, step: int, meta: SimConnectorMeta | None) -> KVConnectorOutput:
        """Start this step's jobs, finish the ones whose time has come."""
        shadow = self.executor.shadow if self.executor is not None else None
        if meta is not None:
            for job in meta.loads + meta.stores:
                job.done_step = step + self.rng.randint(0, self.max_delay)
                if shadow is not None:
                    job.stamps = [shadow.stamp[bid] for _, _, bid, _ in job.blocks]
            self._running += [("load", j) for j in meta.loads] + [("store", j) for j in meta.stores]
        out = KVConnectorOutput()
        still = []
        for kind, job in self._running:
            if job.done_step > step:
                still.append((kind, job))
            elif kind == "load":
                self._finish_load(job, shadow, out)
            else:
                self._finish_store(job, shadow, step, out)
        self._running = still
        return out

    def _finish_load(self, job: _Job, shadow: Any, out: KVConnectorOutput) -> None:
        out.finished_recving.add(job.request_id)
        for (h, g, bid, _), content in zip(job.blocks, job.contents):
            if self.failure_rate and self.rng.random() < self.failure_rate:
                out.invalid_block_ids.add(bid)
                self.num_failed_blocks += 1
                if shadow is not None:
                    shadow.write(bid, 0, [~hash(h)] * self.block_size, "load:" + job.request_id)
                continue
            self.num_loaded_blocks += 1
            if shadow is not None and content is not None:
                shadow.write(bid, 0, content, "load:" + job.request_id)

    def _finish_store(self, job: _Job, shadow: Any, step: int, out: KVConnectorOutput) -> None:
        out.finished_sending.add(job.request_id)
        for (h, g, bid, b), stamp in zip(job.blocks, job.stamps or [None] * len(job.blocks)):
            content = None
            if shadow is not None:
                if stamp is not None and shadow.stamp[bid] != stamp:  # any write since the store began
                    shadow.report(Violation("overwritten-while-read", step, job.request_id, g, bid, b * self.block_size))
                    continue
                content = list(shadow.slots[bid] or [])
            self.host[(h, g)] = content
            self.host.move_to_end((h, g))
        while len(self.host) > self.capacity:
            self.host.popitem(last=False)
