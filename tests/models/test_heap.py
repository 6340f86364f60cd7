"""models/platform/heap.py: the C heap's free pages go back to the OS where glibc can do it."""

from __future__ import annotations

import platform
import subprocess
import sys
import threading
import time

import pytest

from hybridserve.models.platform.heap import IdleHeapRelease, release_free_heap
from tests.helpers.hand_clock import HandClock, wait_until


def test_release_free_heap_works_on_glibc_and_says_so() -> None:
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert release_free_heap() is glibc
    assert release_free_heap() is glibc  # repeatable: nothing is left to give back, no error


# The releaser's idle time, in the hand clock's seconds. Its waiter also sleeps that long in
# real time before reading the clock again, so a release the test allows comes within a
# poll or two, and each real pause below (REAL_PAUSE) lets a wrong release happen first.
IDLE = 0.05
REAL_PAUSE = 4 * IDLE


def test_idle_release_waits_for_a_pause_in_steps_and_releases_once_per_pause() -> None:
    clock = HandClock()
    events: list[tuple[str, float]] = []  # ("step" | "release", hand clock), in the order they happened
    idle = IdleHeapRelease(idle_s=IDLE, release=lambda: events.append(("release", clock())), clock=clock)

    def step() -> None:
        events.append(("step", clock()))
        idle.stepped()

    def releases() -> list[int]:
        return [i for i, (kind, _) in enumerate(events) if kind == "release"]

    try:
        clock.advance(10 * IDLE)
        time.sleep(REAL_PAUSE)
        assert events == []  # no step yet: nothing to give back
        for _ in range(30):  # steps IDLE / 10 apart, 3 IDLE in all: never an idle gap
            clock.advance(IDLE / 10)
            step()
            time.sleep(0.005)  # the waiter may run between steps
        time.sleep(REAL_PAUSE)  # the hand clock stands still: no gap has reached IDLE yet
        assert releases() == []
        clock.advance(IDLE)  # the pause
        assert wait_until(lambda: len(releases()) >= 1)
        assert releases() == [30]  # right after the 30 steps, once their gap reached IDLE
        clock.advance(10 * IDLE)
        time.sleep(REAL_PAUSE)
        assert releases() == [30]  # one per pause, not one per IDLE
        step()
        clock.advance(IDLE)
        assert wait_until(lambda: len(releases()) >= 2)  # the next run of steps gets its own
        assert releases() == [30, 32]
    finally:
        idle.close()
    idle.stepped()  # after close: no thread, no release
    clock.advance(10 * IDLE)
    time.sleep(REAL_PAUSE)
    assert releases() == [30, 32]


def test_idle_release_closes_while_waiting() -> None:
    # The clock never reaches the idle time: close() returning at all shows it does not
    # wait that out (the join's timeout only turns a hang into a failure).
    releases: list[int] = []
    idle = IdleHeapRelease(idle_s=60.0, release=lambda: releases.append(1), clock=HandClock())
    idle.stepped()
    closer = threading.Thread(target=idle.close)
    closer.start()
    closer.join(timeout=60)
    assert not closer.is_alive() and releases == []


_ROUNDS = """
import ctypes, resource, sys
from hybridserve.models.platform import heap
if sys.argv[1] == "keep":
    assert heap.keep_step_temporaries()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
size = 24 << 20  # a prefill temporary's size: below the mmap threshold glibc may raise to
faults = []
for _ in range(3):  # two temporaries of a step, freed together at its end, three steps
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(size) for _ in range(2)]
    for b in blocks:
        ctypes.memset(b, 1, size)
    for b in blocks:
        libc.free(ctypes.c_void_p(b))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(faults[1], faults[2])
"""


@pytest.mark.skipif(not (sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"),
                    reason="glibc's malloc thresholds")
def test_kept_step_temporaries_are_not_faulted_in_again() -> None:
    pages = (2 * (24 << 20)) // 4096

    def faults(mode: str) -> list[int]:
        out = subprocess.run([sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True, check=True)
        return [int(v) for v in out.stdout.split()]

    # glibc's own thresholds: later steps fault their temporaries in again (the first
    # step's were mapped and unmapped, then the heap's top is trimmed after each step).
    assert faults("default")[1] > pages // 2
    # Kept: the second and third steps reuse the first's pages.
    assert max(faults("keep")) < pages // 10
