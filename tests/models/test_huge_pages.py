"""models/platform/huge_pages.py: a weight copied onto memory advised for transparent huge
pages holds the same values, aligned to a huge page; small tensors, and systems without the
advice, keep their own memory."""

from __future__ import annotations

import mmap

import pytest

torch = pytest.importorskip("torch")

from hybridserve.models.platform import huge_pages  # noqa: E402
from hybridserve.models.platform.huge_pages import HUGE_PAGE, on_huge_pages  # noqa: E402

needs_madvise = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this system")


@needs_madvise
def test_a_large_tensor_is_copied_to_an_aligned_mapping_with_its_values() -> None:
    t = torch.arange(3 * HUGE_PAGE // 4, dtype=torch.int32).view(-1, 1024)  # 3 huge pages of int32
    placed = on_huge_pages(t.t().t())
    assert placed.data_ptr() % HUGE_PAGE == 0 and placed.data_ptr() != t.data_ptr()
    assert placed.dtype == torch.int32 and placed.is_contiguous() and torch.equal(placed, t)
    del t
    assert int(placed[-1, -1]) == 3 * HUGE_PAGE // 4 - 1  # the copy outlives its source


def test_a_tensor_under_one_huge_page_keeps_its_memory() -> None:
    t = torch.ones(1000, dtype=torch.int8)
    assert on_huge_pages(t) is t


def test_without_the_advice_the_tensor_is_only_made_contiguous(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(huge_pages.mmap, "MADV_HUGEPAGE", raising=False)
    t = torch.zeros(HUGE_PAGE, dtype=torch.int8).view(2, -1).t()
    placed = on_huge_pages(t)
    assert placed.is_contiguous() and torch.equal(placed, t)


@needs_madvise
def test_a_refused_advice_keeps_the_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    class Refusing(mmap.mmap):
        def madvise(self, *args: int) -> None:
            raise OSError("THP disabled")

    monkeypatch.setattr(huge_pages.mmap, "mmap", Refusing)
    t = torch.ones(HUGE_PAGE, dtype=torch.int8)
    assert on_huge_pages(t) is t


@needs_madvise
def test_only_the_weights_whole_huge_pages_are_advised(monkeypatch: pytest.MonkeyPatch) -> None:
    # 3.5 huge pages: the advice covers 3 from the aligned start; the last half page stays
    # on 4 KB pages (advised, it would be resident past the weight's end)
    advised: list[tuple[int, ...]] = []

    class Recording(mmap.mmap):
        def madvise(self, *args: int) -> None:
            advised.append(args)
            super().madvise(*args)

    monkeypatch.setattr(huge_pages.mmap, "mmap", Recording)
    placed = on_huge_pages(torch.ones(7 * HUGE_PAGE // 2, dtype=torch.int8))
    (option, start, length), = advised
    assert option == mmap.MADV_HUGEPAGE and start % mmap.PAGESIZE == 0 and start < HUGE_PAGE
    assert length == 3 * HUGE_PAGE and placed.data_ptr() % HUGE_PAGE == 0 and bool(placed.eq(1).all())
