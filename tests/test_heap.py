"""models/heap.py: the C heap's free pages go back to the OS where glibc can do it."""

from __future__ import annotations

import platform
import sys
import time

from hybridserve.models.heap import IdleHeapRelease, release_free_heap


def test_release_free_heap_works_on_glibc_and_says_so() -> None:
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert release_free_heap() is glibc
    assert release_free_heap() is glibc  # repeatable: nothing is left to give back, no error


def _wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_idle_release_waits_for_a_pause_in_steps_and_releases_once_per_pause() -> None:
    releases: list[float] = []
    idle = IdleHeapRelease(idle_s=0.5, release=lambda: releases.append(time.monotonic()))
    try:
        time.sleep(0.7)
        assert releases == []  # no step yet: nothing to give back
        burst_end = time.monotonic() + 0.6
        while time.monotonic() < burst_end:  # steps 20 ms apart: never a 0.5 s pause
            idle.stepped()
            time.sleep(0.02)
        last_step = time.monotonic()
        assert releases == []  # none during the burst
        assert _wait_until(lambda: len(releases) == 1)
        assert releases[0] - last_step >= 0.45  # only after the pause
        time.sleep(0.7)
        assert len(releases) == 1  # one per pause, not one per idle_s
        idle.stepped()
        assert _wait_until(lambda: len(releases) == 2)  # the next run of steps gets its own
    finally:
        idle.close()
    idle.stepped()  # after close: no thread, no release
    time.sleep(0.7)
    assert len(releases) == 2


def test_idle_release_closes_while_waiting() -> None:
    releases: list[int] = []
    idle = IdleHeapRelease(idle_s=60.0, release=lambda: releases.append(1))
    idle.stepped()
    start = time.monotonic()
    idle.close()  # does not wait out the 60 s
    assert time.monotonic() - start < 5 and releases == []
