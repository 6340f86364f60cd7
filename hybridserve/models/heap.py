"""Giving freed heap memory back to the operating system after load-time temporaries.

glibc's malloc keeps freed memory in its heap for reuse, and returns it only from the top
of the heap. Loading leaves large holes in the middle: the tokenizer's parse of a 262k
vocabulary (~200 MB freed once the Rust tokenizer is built), and the int8 values and
float32 temporaries of each output-head chunk (freed once the chunk is packed). Those pages
stay resident (they count in RSS) until `malloc_trim` hands every free page back, which
costs a few milliseconds for a heap of a gigabyte. Called at the few points where a load
step has just freed much, never per decode step.

Elsewhere (musl, macOS, Windows) this does nothing.
"""

from __future__ import annotations

import ctypes
from functools import cache
from typing import Any


@cache
def _malloc_trim() -> Any:
    """glibc's malloc_trim, or None where the C library has none. Looked up among the
    symbols the process already has (CDLL(None)): no search for libc's file name, which
    fails in containers without ldconfig."""
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except (OSError, TypeError):  # Windows has no CDLL(None)
        return None


def release_free_heap() -> bool:
    """Return the C heap's free pages to the OS (glibc `malloc_trim(0)`); False where
    the C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
