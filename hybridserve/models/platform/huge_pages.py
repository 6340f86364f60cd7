"""Weights that a decode step streams whole, placed on transparent huge pages where Linux
offers them on request (MADV_HUGEPAGE).

Why: a decode step reads every weight once, at the memory's full speed, and with 4 KB
pages it also walks a page table entry every 4 KB: the output head of Gemma 3 270M (168 MB
of int8) took 9.5 ms a step on 4 KB pages and 6.7 ms on 2 MB pages, one row, the same
kernel (benchmarks/results/int8_kernels.md). The kernel's own weight layouts (int8_amx.py's
tiles, int8_groups.py's) are copied here once, at load.

Memory: the weight starts on a huge page boundary and only its whole huge pages are advised;
its last partial one stays on 4 KB pages and the mapping's pages past its end are never
written, so nothing past the weight is resident.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20  # bytes in an x86-64 transparent huge page


def on_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU `tensor` in memory advised for transparent huge pages,
    aligned to one; `tensor` itself (made contiguous) where that is not offered (not
    Linux, THP disabled) or not worth it (under one huge page, not on the CPU). A strided
    view (a layout's permutation) is copied into the mapping directly: no contiguous copy
    of it is made first (one weight less at the load's peak)."""
    if tensor.device.type != "cpu":
        return tensor.contiguous()
    placed = _huge_page_zeros(tensor.shape, tensor.dtype)
    if placed is None:
        return tensor.contiguous()
    placed.copy_(tensor)
    return placed


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor in memory advised for transparent huge pages as on_huge_pages
    places a copy (a weight filled in parts, each written once: no whole copy beside it);
    torch.zeros where that is not offered or worth it. Its pages are committed as written."""
    placed = _huge_page_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype) if placed is None else placed


def _huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """A fresh zero mapping of `shape` advised for huge pages from a huge page boundary
    (whole huge pages only), or None (not offered, or under one huge page)."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # the tensor keeps the mapping alive
    start = -raw.data_ptr() % HUGE_PAGE
    try:  # whole huge pages only: a last partial one would be resident past the weight's end
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # THP compiled out or disabled
        del raw
        region.close()
        return None
    return raw[start : start + nbytes].view(dtype).view(shape)
