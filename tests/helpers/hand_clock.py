"""A clock the test moves by hand, and a bounded poll: for tests of code that waits for time
to pass on another thread, so that they assert the order of events, not how fast threads
run (a loaded machine can only make them slower)."""

from __future__ import annotations

import time
from typing import Callable


class HandClock:
    """Seconds that pass only when the test says so (`advance`); pass it as the clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def wait_until(predicate: Callable[[], bool], timeout: float = 60.0) -> bool:
    """Poll until `predicate` holds; `timeout` only keeps a broken waiter from hanging the
    suite, far past any wait the tests mean."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()
