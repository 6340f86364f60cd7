"""models/heap.py: the C heap's free pages go back to the OS where glibc can do it."""

from __future__ import annotations

import platform
import sys

from hybridserve.models.heap import release_free_heap


def test_release_free_heap_works_on_glibc_and_says_so() -> None:
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert release_free_heap() is glibc
    assert release_free_heap() is glibc  # repeatable: nothing is left to give back, no error
