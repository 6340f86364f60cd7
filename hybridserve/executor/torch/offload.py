"""The executor side of host-memory KV offload: a host tensor pool and a copy thread.

The scheduler side (core/connector/offload.py) decides which device block goes to or
comes from which host slot; this side copies, in one background thread, while steps run:

    step M (runner thread)   submit(meta of M) -> run the model -> collect()
    copy thread              store: device blocks -> host slots
                             load:  host slots -> the request's fresh device blocks

Why the copies never race a step:
- a store reads a finished request's blocks below its processed count; steps still in
  flight write only above it, and the scheduler frees the blocks only after the store is
  reported (collect() reports a job only once its copies are complete);
- a load writes blocks fresh from the pool: every step that read them before their last
  free has been processed (fenced frees), and the loading request is scheduled only after
  collect() reported the load.

Host memory mirrors the device layout: one tensor per slot buffer, [num_host_blocks,
page_elems]; a slot holds all layers of one group's block. On CUDA the copies run on a
side stream, through pinned staging tensors with non_blocking copies; on CPU "device"
and "host" are both CPU memory and the copies are plain index_select/index_copy_.
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import nullcontext
from typing import Any

import torch

from hybridserve.core.connector.offload import HostOffloadConnector, OffloadMeta, TransferJob
from hybridserve.core.errors import ConfigError
from hybridserve.core.kv.spec import KVCacheConfig, bytes_per_block
from hybridserve.core.sched.output import KVConnectorOutput
from hybridserve.executor.torch.kv_cache import PagedKVCache

logger = logging.getLogger("hybridserve")

# How long an empty step (nothing but polling) waits for a copy to finish, in seconds:
# long enough that the engine does not spin, short enough not to delay new requests.
POLL_WAIT_S = 0.05
# What a failed (injected) load leaves in its blocks: finite garbage that changes outputs,
# so a request that read it instead of recomputing would be caught by the token check.
FAILED_BLOCK_FILL = 7.0


def num_host_blocks_for_memory(kv_cache_config: KVCacheConfig, num_bytes: int) -> int:
    """Host slots that fit in `num_bytes` (a slot costs what a device block costs)."""
    per_block = bytes_per_block(kv_cache_config.groups)
    n = num_bytes // per_block
    if n < 1:
        raise ConfigError(f"kv_offload_memory={num_bytes} holds no KV block ({per_block} bytes each); "
                          f"the smallest value that works is {per_block}")
    return n


class OffloadWorker:
    """Host pool + copy thread. `submit` and `collect` are called from the runner thread only.

    fail_loads: the first `fail_loads` load jobs fail on purpose (for tests): the second
    half of their blocks is not loaded, filled with garbage and reported invalid.
    """

    def __init__(self, kv: PagedKVCache, num_host_blocks: int, device: torch.device, fail_loads: int = 0) -> None:
        self.kv = kv
        self.device = device
        self.cuda = device.type == "cuda"
        self.layers_per_group = [len(g.layer_names) for g in kv.config.groups]
        self.host = [torch.empty(num_host_blocks, buf.shape[1], dtype=buf.dtype, pin_memory=self.cuda)
                     for buf in kv.buffers]
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.fail_loads = fail_loads
        self._thread: ThreadPoolExecutor | None = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-offload")
        self._running: list[tuple[str, TransferJob, Future]] = []  # (kind, job, copy), in submit order
        self.num_stored_blocks = 0
        self.num_loaded_blocks = 0
        self.num_failed_blocks = 0

    # -- runner thread ------------------------------------------------------------------
    def submit(self, meta: OffloadMeta | None) -> None:
        if meta is None:
            return
        assert self._thread is not None, "OffloadWorker used after shutdown"
        ready = None
        if self.cuda:
            # Order the copies after everything already queued on the compute stream.
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        for job in meta.stores:
            self._running.append(("store", job, self._thread.submit(self._store, job, ready)))
        for job in meta.loads:
            fail = self.fail_loads > 0
            self.fail_loads -= fail
            self._running.append(("load", job, self._thread.submit(self._load, job, ready, fail)))

    def collect(self, wait_for_one: bool = False) -> KVConnectorOutput | None:
        """Report every finished job once. wait_for_one: block (up to POLL_WAIT_S) until
        one finishes, for steps that have nothing else to do."""
        if not self._running:
            return None
        if wait_for_one and not any(f.done() for _, _, f in self._running):
            wait([f for _, _, f in self._running], timeout=POLL_WAIT_S, return_when=FIRST_COMPLETED)
        out = KVConnectorOutput()
        still = []
        for kind, job, fut in self._running:
            if not fut.done():
                still.append((kind, job, fut))
            elif kind == "store":
                fut.result()  # a failed store is a real error: its blocks may not be indexed
                out.finished_sending.add(job.request_id)
            else:
                exc = fut.exception()
                if exc is not None:  # the request recomputes: exactly what a failed load means
                    logger.warning("KV offload load for %s failed: %r", job.request_id, exc)
                    invalid = set(job.block_ids)
                    self.num_failed_blocks += len(invalid)
                else:
                    invalid = fut.result()
                out.finished_recving.add(job.request_id)
                out.invalid_block_ids |= invalid
        self._running = still
        return out

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None

    # -- copy thread ----------------------------------------------------------------------
    def _by_buffer(self, job: TransferJob, keep: int) -> list[tuple[int, list[int], list[int]]]:
        """(slot buffer j, device block ids, host slots) for the first `keep` blocks: group
        g's layer j lives in buffer j, so buffer j carries blocks of groups with > j layers."""
        out = []
        for j in range(len(self.host)):
            idx = [i for i in range(keep) if self.layers_per_group[job.groups[i]] > j]
            if idx:
                out.append((j, [job.block_ids[i] for i in idx], [job.host_slots[i] for i in idx]))
        return out

    def _ctx(self, ready: Any) -> Any:
        if self.stream is None:
            return nullcontext()
        self.stream.wait_event(ready)
        return torch.cuda.stream(self.stream)

    def _dev_index(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def _staging(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)

    @torch.inference_mode()
    def _store(self, job: TransferJob, ready: Any) -> None:
        staged = []
        with self._ctx(ready):
            for j, bids, slots in self._by_buffer(job, len(job.block_ids)):
                rows = self.kv.buffers[j].index_select(0, self._dev_index(bids))
                if self.cuda:
                    pinned = self._staging(rows)
                    pinned.copy_(rows, non_blocking=True)
                    rows = pinned
                staged.append((j, torch.tensor(slots, dtype=torch.long), rows))
            if self.stream is not None:
                self.stream.synchronize()
        for j, slots_t, rows in staged:
            self.host[j].index_copy_(0, slots_t, rows)
        self.num_stored_blocks += len(job.block_ids)

    @torch.inference_mode()
    def _load(self, job: TransferJob, ready: Any, fail: bool) -> set[int]:
        n = len(job.block_ids)
        keep = n // 2 if fail else n
        keepalive = []  # pinned sources must outlive their non_blocking copies
        with self._ctx(ready):
            for j, bids, slots in self._by_buffer(job, keep):
                slots_t = torch.tensor(slots, dtype=torch.long)
                if self.cuda:
                    pinned = torch.empty((len(slots), self.host[j].shape[1]), dtype=self.host[j].dtype,
                                         pin_memory=True)
                    torch.index_select(self.host[j], 0, slots_t, out=pinned)
                    keepalive.append(pinned)
                    rows = pinned.to(self.device, non_blocking=True)
                else:
                    rows = self.host[j].index_select(0, slots_t)
                self.kv.buffers[j].index_copy_(0, self._dev_index(bids), rows)
            if keep < n:
                for j in range(len(self.host)):
                    bad = [job.block_ids[i] for i in range(keep, n) if self.layers_per_group[job.groups[i]] > j]
                    if bad:
                        self.kv.buffers[j].index_fill_(0, self._dev_index(bad), FAILED_BLOCK_FILL)
            if self.stream is not None:
                self.stream.synchronize()
        self.num_loaded_blocks += keep
        self.num_failed_blocks += n - keep
        return set(job.block_ids[keep:])


def attach_host_offload(executor: Any, kv_cache_config: KVCacheConfig, num_host_blocks: int,
                        fail_loads: int = 0) -> HostOffloadConnector:
    """Enable offload on a (not yet initialized) TorchExecutor; returns the scheduler side
    to pass to build_engine. Both sides agree on `num_host_blocks` slots."""
    connector = HostOffloadConnector(kv_cache_config, num_host_blocks)
    executor.enable_kv_offload(num_host_blocks, fail_loads=fail_loads)
    return connector
