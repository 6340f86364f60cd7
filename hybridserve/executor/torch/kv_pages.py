"""The CPU KV pool's memory: zero-filled anonymous mappings the kernel commits page by page
as K/V are first written, on transparent huge pages where first touches cost less on them
here than on 4 KB pages.

Why the page size is measured: the block pool hands out blocks never used before until
every one has been (its free queue keeps freed blocks findable for the prefix cache), so
a new server's K/V writes land on untouched pages and each step pays their first touch.
What that costs depends on the machine, not the CPU: on bare metal, and on VMs whose host
has backed their memory, zeroing a 2 MB page costs less than 512 faults of 4 KB (on one
AMD VM a 4 KB fault cost ~19 us, and 2 MB pages made 64-row decode 5% faster); where the
host backs a guest's memory on first use, a huge page the guest has not used lately cost
2.5 ms/MB against 0.4 for 4 KB pages, and the served 64 x 64 burst's TTFT p99 was 1.24-1.27 s
on 2 MB pages against 1.03-1.08 s on 4 KB ones
(benchmarks/results/kv_pool_huge_pages.md, serving_peers.md).

How: the pool's first buffers lend PROBE_SAMPLES pairs of huge-page-sized ranges from
their starts (the blocks the first requests take, so no memory is touched that they would
not touch), one of each pair advised for huge pages, each timed as it is first written
(with zeros: the buffers' contents do not change); the whole of every buffer is advised
for huge pages iff the huge samples' median time is the lower. Measured once per process,
when the engine makes its pool, after the model's load (which is also when a probe of
fresh memory sees what the pool will: memory the guest has not used lately).
"""

from __future__ import annotations

import logging
import mmap
import statistics
import time

import numpy as np
import torch

from hybridserve.models.platform.huge_pages import HUGE_PAGE

log = logging.getLogger(__name__)
PROBE_SAMPLES = 3
SMALL_PAGE = mmap.PAGESIZE

_decision: bool | None = None  # measured once per process (prefers_huge_pages)


def zero_buffers(count: int, nbytes: int) -> list[torch.Tensor]:
    """`count` zero-filled uint8 buffers of `nbytes`, committed only where written: mappings
    advised for huge pages where prefers_huge_pages says so (calloc where Linux offers no
    advice: fresh zero pages too)."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or nbytes == 0:
        return [torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)) for _ in range(count)]
    regions = [mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) for _ in range(count)]
    buffers = [torch.frombuffer(region, dtype=torch.uint8) for region in regions]  # each keeps its mapping
    if regions and prefers_huge_pages(regions, buffers):
        for region in regions:
            _advise(region, 0, nbytes)
    return buffers


def prefers_huge_pages(regions: list[mmap.mmap], buffers: list[torch.Tensor]) -> bool:
    """Whether first touches cost less on huge pages here (module docstring), measured on
    these fresh buffers the first time they are large enough; until then (a small pool,
    whose page size matters little) huge pages, as where nothing was measured."""
    global _decision
    if _decision is not None:
        return _decision
    spots = []
    for i in range(PROBE_SAMPLES):
        region, buffer = regions[i % len(regions)], buffers[i % len(regions)]
        start = -buffer.data_ptr() % HUGE_PAGE + (i // len(regions)) * 2 * HUGE_PAGE
        if start + 2 * HUGE_PAGE > buffer.numel():
            return True
        spots.append((region, buffer, start))
    huge, small = [], []
    for region, buffer, start in spots:
        if not _advise(region, start, HUGE_PAGE):
            _decision = False
            return False
        huge.append(_first_touch_seconds(buffer, start))
        small.append(_first_touch_seconds(buffer, start + HUGE_PAGE))
    _decision = choose_huge_pages(huge, small)
    log.info("KV pool on %s pages: first touches of 2 MB took %s ms on huge pages, %s ms on 4 KB pages",
             "huge" if _decision else "4 KB", [round(s * 1e3, 2) for s in huge], [round(s * 1e3, 2) for s in small])
    return _decision


def choose_huge_pages(huge_seconds: list[float], small_seconds: list[float]) -> bool:
    """Huge pages iff their samples' median first touch is shorter than 4 KB pages'."""
    return statistics.median(huge_seconds) < statistics.median(small_seconds)


def _first_touch_seconds(buffer: torch.Tensor, start: int) -> float:
    """Seconds to write a zero into each 4 KB page of buffer[start : start + HUGE_PAGE]."""
    pages = buffer[start : start + HUGE_PAGE : SMALL_PAGE]
    began = time.perf_counter()
    pages.fill_(0)
    return time.perf_counter() - began


def _advise(region: mmap.mmap, start: int, length: int) -> bool:
    """MADV_HUGEPAGE over region[start : start + length]; False where Linux refuses it."""
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, length)
    except OSError:  # THP compiled out or disabled: 4 KB pages, as without the hint
        return False
    return True
