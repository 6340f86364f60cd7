"""Giving freed heap memory back to the operating system after load-time temporaries.

glibc's malloc keeps freed memory in its heap for reuse, and returns it only from the top
of the heap. Loading leaves large holes in the middle: the tokenizer's parse of a 262k
vocabulary (~200 MB freed once the Rust tokenizer is built), and the int8 values and
float32 temporaries of each output-head chunk (freed once the chunk is packed). Those pages
stay resident (they count in RSS) until `malloc_trim` hands every free page back, which
costs a few milliseconds for a heap of a gigabyte. Called at the few points where a load
step has just freed much, never per decode step.

Serving leaves such holes too. After glibc has freed one large block it raises its mmap
threshold (up to 32 MB), so later large step temporaries (KV gathers, MLP activations)
come from the heap and stay resident after the last step (`benchmarks/pool_rss.py`;
benchmarks/results/cpu_memory.md). IdleHeapRelease gives them back once steps have
stopped for IDLE_RELEASE_S; doing it per step would make every step fault its
temporaries in again, after an idle gap only the next burst's first step pays.

glibc would also trim the top of its heap on its own whenever more than twice that
threshold lies free there, which a prefill's freed temporaries do several times a step:
each trim made the next temporaries fault their pages in again (hundreds of thousands of
faults per 4096-token step, a large share of its time). keep_step_temporaries fixes both
thresholds for a process that runs steps, so the heap keeps what steps free until the
idle release.

Elsewhere (musl, macOS, Windows) this does nothing.
"""

from __future__ import annotations

import ctypes
import threading
import time
from functools import cache
from typing import Any, Callable

# Seconds without a step after which the heap's free pages go back to the OS.
IDLE_RELEASE_S = 2.0
# glibc's mallopt parameters, and the values keep_step_temporaries sets: allocations from
# 32 MiB (glibc's largest mmap threshold on 64-bit) are mapped as ever; free memory at the
# heap's top is left to the idle release below 1 GiB.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 1 << 30


@cache
def _malloc_trim() -> Any:
    """glibc's malloc_trim, or None where the C library has none. Looked up among the
    symbols the process already has (CDLL(None)): no search for libc's file name, which
    fails in containers without ldconfig."""
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except (OSError, TypeError):  # Windows has no CDLL(None)
        return None


@cache
def keep_step_temporaries() -> bool:
    """Make glibc keep freed memory in the heap (no automatic trim below
    TRIM_THRESHOLD_BYTES, a fixed mmap threshold) for the process's life; False where the
    C library has no mallopt."""
    try:
        mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    except (OSError, TypeError):  # Windows has no CDLL(None)
        return False
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def release_free_heap() -> bool:
    """Return the C heap's free pages to the OS (glibc `malloc_trim(0)`); False where
    the C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class IdleHeapRelease:
    """Calls `release` (default release_free_heap) once after each run of steps, when
    `idle_s` seconds have passed since the last `stepped()`. Invariants: never while steps
    keep coming closer than idle_s apart; at most once per idle gap; never after close().
    The wait runs on a daemon thread started by the first step. Time is read from `clock`
    (seconds; a test's own clock makes the invariants independent of thread timing): the
    waiter sleeps for what the clock says is left, then reads the clock again."""

    def __init__(self, idle_s: float = IDLE_RELEASE_S, release: Callable[[], Any] = release_free_heap,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if release is release_free_heap:  # the heap keeps step temporaries until it
            keep_step_temporaries()
        self._idle_s = idle_s
        self._release = release
        self._clock = clock
        self._cond = threading.Condition()
        self._last_step = 0.0
        self._pending = False  # a step ran since the last release
        self._closed = False
        self._thread: threading.Thread | None = None

    def stepped(self) -> None:
        """Record that a step just ended (called by the thread that runs steps)."""
        with self._cond:
            self._last_step = self._clock()
            if self._pending:
                return  # the waiter re-reads the time at its deadline: no wake-up per step
            self._pending = True
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._wait_for_idle, name="idle-heap-release", daemon=True)
                self._thread.start()
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()

    def _wait_for_idle(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    if not self._pending:
                        self._cond.wait()
                        continue
                    remaining = self._last_step + self._idle_s - self._clock()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
                if self._closed:
                    return
                self._pending = False
            self._release()  # outside the lock: a step that starts meanwhile is not held up
