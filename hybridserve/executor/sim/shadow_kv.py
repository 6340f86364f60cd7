"""Shadow KV: a race detector that mirrors what every KV slot holds.

Each physical block keeps a list of slot fingerprints (the fingerprint of the prefix that
produced the slot), the id of its last writer, and a write version bumped whenever a
different writer (another request, a connector load) writes it. A step:

    dispatch:   write its own slots, then check every slot it reads from the cache holds
                the expected fingerprint; record (block, version) for each block touched
    in flight:  a free of a touched block            -> freed-while-in-flight
    completion: a touched block's version has moved  -> overwritten-while-read

Reads of block id 0 (the null block) are read-of-null-slot; wrong fingerprints are
wrong-content. Bookkeeping is per block (C-level slice compares inside a block), and a
request re-checks a block's content only when the block's version or extent changed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hybridserve.core.errors import HybridServeError

NULL = 0
FREED = "freed-while-in-flight"
OVERWRITTEN = "overwritten-while-read"
NULL_READ = "read-of-null-slot"
WRONG = "wrong-content"


@dataclass(frozen=True)
class Violation:
    kind: str
    step: int
    request_id: str
    group: int
    block: int
    position: int

    def __str__(self) -> str:
        return (
            f"{self.kind}: step {self.step}, request {self.request_id}, group {self.group}, "
            f"block {self.block}, position {self.position}"
        )


class RaceViolation(HybridServeError, AssertionError):
    """The shadow KV saw a step read a slot it must not (strict mode)."""

    def __init__(self, violation: Violation) -> None:
        super().__init__(str(violation))
        self.violation = violation


@dataclass
class StepTouches:
    """What one in-flight step touched: (block, version after dispatch, request, group, pos)."""

    step: int
    touched: list[tuple[int, int, str, int, int]]


class ShadowKV:
    def __init__(self, num_blocks: int, block_size: int, strict: bool = True) -> None:
        self.block_size = block_size
        self.strict = strict
        self.slots: list[list[int] | None] = [None] * num_blocks
        self.version = [0] * num_blocks
        self.writer: list[str | None] = [None] * num_blocks
        self.in_flight_refs: Counter[int] = Counter()
        # block -> (step, request, group, position) of one in-flight toucher, for reports
        self.touched_by: dict[int, tuple[int, str, int, int]] = {}
        self.violations: list[Violation] = []

    def report(self, v: Violation) -> None:
        self.violations.append(v)
        if self.strict:
            raise RaceViolation(v)

    # -- writes ----------------------------------------------------------------
    def write(self, bid: int, offset: int, fps: list[int], writer: str) -> None:
        """Write fingerprints into slots offset.. of block bid (null-block writes vanish)."""
        if bid == NULL:
            return
        slots = self.slots[bid]
        if slots is None:
            slots = self.slots[bid] = [0] * self.block_size
        slots[offset : offset + len(fps)] = fps
        if self.writer[bid] != writer:
            self.writer[bid] = writer
            self.version[bid] += 1

    def write_state(self, bid: int, fp: int, writer: str) -> None:
        self.write(bid, 0, [fp], writer)

    # -- reads -----------------------------------------------------------------
    def check_read(self, bid: int, offset: int, expected: list[int], ctx: tuple[int, str, int, int]) -> bool:
        """True if slots offset.. of bid hold `expected`; reports a violation otherwise."""
        step, rid, group, pos = ctx
        if bid == NULL:
            self.report(Violation(NULL_READ, step, rid, group, bid, pos))
            return False
        slots = self.slots[bid]
        if slots is None or slots[offset : offset + len(expected)] != expected:
            self.report(Violation(WRONG, step, rid, group, bid, pos))
            return False
        return True

    # -- in-flight tracking ------------------------------------------------------
    def begin(self, step: int, touched: list[tuple[int, str, int, int]]) -> StepTouches:
        """Record blocks a dispatched step touches, with their versions now."""
        recs = []
        for bid, rid, group, pos in touched:
            if bid == NULL:
                continue
            self.in_flight_refs[bid] += 1
            self.touched_by[bid] = (step, rid, group, pos)
            recs.append((bid, self.version[bid], rid, group, pos))
        return StepTouches(step, recs)

    def end(self, st: StepTouches) -> None:
        """The step completed: every touched block must be unchanged by others since dispatch."""
        refs = self.in_flight_refs
        for bid, ver, rid, group, pos in st.touched:
            n = refs[bid] - 1
            if n:
                refs[bid] = n
            else:
                del refs[bid]
                self.touched_by.pop(bid, None)
            if self.version[bid] != ver and self.writer[bid] != rid:
                self.report(Violation(OVERWRITTEN, st.step, rid, group, bid, pos))

    def on_free(self, bid: int) -> None:
        """Block-pool hook: a block went back to the free queue."""
        if self.in_flight_refs.get(bid):
            step, rid, group, pos = self.touched_by[bid]
            self.report(Violation(FREED, step, rid, group, bid, pos))
