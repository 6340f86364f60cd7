"""A stream's inbox: the outputs a replica thread hands one AsyncLLM stream, in order.

The replica thread puts a whole step's outputs with one `call_soon_threadsafe` per event
loop (replica.py), so `put` runs on the stream's loop; the stream's one consumer takes
them there. This is what an asyncio.Queue would do, without its per-item bookkeeping and
without a coroutine of its own between the consumer and the wakeup: the consumer awaits
the future `wait` returns directly (one less frame to resume for every token streamed).

Invariants: items come out in the order they were put; at most one consumer waits at a
time; a put wakes that consumer exactly once, and a consumer that stopped waiting
(cancelled) is never woken.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any


class Inbox:
    __slots__ = ("items", "_loop", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.items: deque[Any] = deque()
        self._loop = loop
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: Any) -> None:
        """Add an item (on the inbox's event loop) and wake the consumer if it waits."""
        self.items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def wait(self) -> asyncio.Future[None]:
        """A future resolved by the next put; await it only while `items` is empty."""
        waiter = self._waiter = self._loop.create_future()
        return waiter
