"""The CPU KV pool's memory (executor/torch/kv_cache.py _slot_buffers, kv_pages.py): zero-filled,
committed only where written, and on transparent huge pages where first touches cost less on
them (measured once on the pool's first buffers; the measurement's outcome forced here)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hybridserve.executor.torch import kv_pages  # noqa: E402
from hybridserve.executor.torch.kv_cache import _slot_buffers  # noqa: E402
from hybridserve.executor.torch.kv_pages import choose_huge_pages  # noqa: E402
from hybridserve.models.platform.huge_pages import HUGE_PAGE  # noqa: E402

CPU = torch.device("cpu")
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(not THP_ENABLED.exists() or "[never]" in THP_ENABLED.read_text(),
                               reason="no transparent huge pages on this kernel")


def _zeros(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    (buffer,) = _slot_buffers(1, rows, cols, dtype, CPU)
    return buffer


@pytest.fixture
def first_touches(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Sets what the probe measures (seconds for huge pages, for 4 KB pages), unmeasured
    before each test; returns the probe's calls."""
    calls: list[int] = []

    def measure(huge: float, small: float) -> list[int]:
        def timed(buffer: torch.Tensor, start: int) -> float:
            calls.append(start)
            buffer[start : start + HUGE_PAGE : kv_pages.SMALL_PAGE].fill_(0)  # the real probe's writes
            return huge if len(calls) % 2 else small
        monkeypatch.setattr(kv_pages, "_first_touch_seconds", timed)
        return calls

    monkeypatch.setattr(kv_pages, "_decision", None)
    return measure


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
def test_the_pool_is_zero_and_costs_memory_only_where_written(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_pages, "_decision", None)  # the probe runs: 3 x 4 MiB written
    before = _rss_bytes()
    pool = _zeros(4096, 32768, torch.float32)  # 512 MiB
    assert pool.shape == (4096, 32768) and pool.dtype == torch.float32
    assert _rss_bytes() - before < 32 << 20  # allocating commits (almost) nothing
    pool[7] = 1.5  # one 128 KiB row
    assert _rss_bytes() - before < 32 << 20  # nor does writing one row: at most a 2 MiB page
    assert float(pool[7].sum()) == 1.5 * 32768
    assert not pool[:7].any() and not pool[8:512].any()  # its neighbours (and the probe's pages) read as zeros
    bf16 = _zeros(3, 5, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and not bf16.any()


def test_huge_pages_when_their_median_first_touch_is_shorter() -> None:
    assert choose_huge_pages([1.0, 5.0, 2.0], [3.0, 3.0, 3.0])  # median 2 < 3
    assert not choose_huge_pages([1.0, 5.0, 4.0], [3.0, 3.0, 3.0])  # median 4 > 3


@needs_thp
def test_a_pool_measured_faster_on_huge_pages_asks_for_them_everywhere(first_touches) -> None:  # type: ignore[no-untyped-def]
    # THPeligible is the kernel's own word on a mapping: with THP in "madvise" mode it is 1
    # only for memory that asked (MADV_HUGEPAGE)
    calls = first_touches(0.001, 0.004)
    buffers = _slot_buffers(2, 1024, 8192, torch.float32, CPU)  # 32 MiB each
    assert len(calls) == 6  # three samples, each huge then 4 KB, from the buffers' starts
    for buffer in buffers:
        assert _mapping_of(buffer.data_ptr() + (20 << 20)).get("THPeligible") == "1"
        assert not buffer.any()
    assert kv_pages._decision is True


@needs_thp
def test_a_pool_measured_faster_on_4kb_pages_asks_only_for_its_samples(first_touches) -> None:  # type: ignore[no-untyped-def]
    first_touches(0.005, 0.001)
    buffer, = _slot_buffers(1, 1024, 8192, torch.float32, CPU)
    assert _mapping_of(buffer.data_ptr() + (20 << 20)).get("THPeligible") == "0"
    assert kv_pages._decision is False
    again, = _slot_buffers(1, 1024, 8192, torch.float32, CPU)  # measured once per process
    assert _mapping_of(again.data_ptr() + (20 << 20)).get("THPeligible") == "0"


@needs_thp
def test_a_pool_too_small_to_measure_takes_huge_pages_unmeasured(first_touches) -> None:  # type: ignore[no-untyped-def]
    calls = first_touches(0.005, 0.001)
    buffer, = _slot_buffers(1, 64, 8192, torch.float32, CPU)  # 2 MiB: no room for a sample pair
    assert calls == [] and kv_pages._decision is None
    assert _mapping_of(buffer.data_ptr()).get("THPeligible") == "1"
