"""Waiting queues: FCFS (arrival order) and priority (lower value first, then arrival)."""

from __future__ import annotations

import bisect
from collections import deque
from typing import Iterator

from hybridserve.core.request import Request


class FCFSQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def prepend(self, requests: list[Request]) -> None:
        """Put requests back at the head, keeping their order (preempted, skipped)."""
        self._q.extendleft(reversed(requests))

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """Sorted by (priority, arrival_time); preempted requests keep their place by key."""

    def __init__(self) -> None:
        self._keys: list[tuple[int, float, int]] = []
        self._reqs: list[Request] = []
        self._seq = 0

    def add(self, request: Request) -> None:
        self._seq += 1
        key = (request.priority, request.arrival_time, self._seq)
        i = bisect.bisect(self._keys, key)
        self._keys.insert(i, key)
        self._reqs.insert(i, request)

    def prepend(self, requests: list[Request]) -> None:
        for r in requests:
            self.add(r)

    def peek(self) -> Request:
        return self._reqs[0]

    def pop(self) -> Request:
        self._keys.pop(0)
        return self._reqs.pop(0)

    def remove(self, request: Request) -> None:
        i = self._reqs.index(request)
        del self._keys[i]
        del self._reqs[i]

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._reqs)


WaitingQueue = FCFSQueue | PriorityQueue


def make_queue(policy: str) -> WaitingQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()
