"""models/platform/heap.py: the C heap's free pages go back to the OS where glibc can do it."""

from __future__ import annotations

import platform
import sys
import threading
import time

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
