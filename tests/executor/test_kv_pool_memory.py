"""The CPU KV pool's memory (executor/torch/kv_cache.py _zeros): zero-filled, committed only
where written, and on transparent huge pages where the kernel offers them on request."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hybridserve.executor.torch.kv_cache import _zeros  # noqa: E402

CPU = torch.device("cpu")
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address`."""
    fields: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            if fields is not None:
                return fields
            start, end = (int(v, 16) for v in head.groups())
            fields = {} if start <= address < end else None
        elif fields is not None and ":" in line:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    assert fields is not None, f"no mapping holds {address:#x}"
    return fields


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_pool_is_zero_and_costs_memory_only_where_written() -> None:
    before = _rss_bytes()
    pool = _zeros(4096, 32768, torch.float32, CPU)  # 512 MiB
    assert pool.shape == (4096, 32768) and pool.dtype == torch.float32
    assert _rss_bytes() - before < 32 << 20  # allocating commits (almost) nothing
    pool[7] = 1.5  # one 128 KiB row
    assert _rss_bytes() - before < 32 << 20  # nor does writing one row: at most a 2 MiB page
    assert float(pool[7].sum()) == 1.5 * 32768
    assert not pool[:7].any() and not pool[8:64].any()  # its neighbours read as zeros
    bf16 = _zeros(3, 5, torch.bfloat16, CPU)
    assert bf16.dtype == torch.bfloat16 and not bf16.any()


@pytest.mark.skipif(not THP_ENABLED.exists() or "[never]" in THP_ENABLED.read_text(),
                    reason="no transparent huge pages on this kernel")
def test_the_pool_asks_for_huge_pages() -> None:
    # THPeligible is the kernel's own word on the mapping: with THP in "madvise" mode it is 1
    # only for a mapping that asked (MADV_HUGEPAGE), as the pool does, and 0 for plain calloc.
    pool = _zeros(1024, 8192, torch.float32, CPU)  # 32 MiB
    assert _mapping_of(pool.data_ptr()).get("THPeligible") == "1"
