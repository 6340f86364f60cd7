"""Shadow KV: a race detector that mirrors what every KV slot holds.

Each physical block keeps a list of slot fingerprints (the fingerprint of the prefix that
produced the slot), the id of its last writer, and a write version bumped whenever a
different writer (another request, a connector load) writes it. A step:

    dispatch:   write its slots, then check every slot it reads from the cache holds the
                expected fingerprint (attention reads are checked once the whole batch
                has written, as on a GPU where a batch's KV writes land before its
                attention; Mamba states are checked before any state of the step is
                written, as a Mamba layer reads every request's state before it writes
                any); record (block, version) for each block touched
    in flight:  a free of a touched block            -> freed-while-in-flight
    completion: a touched block's version has moved  -> overwritten-while-read

Reads of block id 0 (the null block) are read-of-null-slot; wrong fingerprints are
wrong-content.

Cost grows with blocks touched, never with tokens, and the per-block work is numpy:
a step's touches are a list of segments (a contiguous range of one request's block table
in one group), expanded once per step into flat arrays. Each (group, table row, block
index) remembers the block id, block version and highest position it was last verified
at; a read whose block id and version still match and whose extent is covered skips the
content compare (one vectorized test per step). The rest, typically each request's
newest block, whose extent grew, is compared in full (one C-level list compare per
block, so any slot changed since, even by the request itself, is caught). In-flight
references are counted per block with np.add.at / np.subtract.at; a free checks one
counter.

Invariants: version[b] changes exactly when a writer other than writer[b] writes b;
in_flight_refs[b] is the number of (dispatched, not completed) step touches of b;
verified state of a table row is reset whenever the row is handed to a new request.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridserve.core.errors import HybridServeError

NULL = 0
FREED = "freed-while-in-flight"
OVERWRITTEN = "overwritten-while-read"
NULL_READ = "read-of-null-slot"
WRONG = "wrong-content"
UNALLOCATED = "unallocated-slot"


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


class StepTouches:
    """One step's touches, built at dispatch in the order the step makes them.

    A segment is six ints in `nums`: (group, row, first block index, count, lo, hi), the
    blocks first..first+count-1 (count >= 0) of the row's table in that group. lo is the
    lowest position the segment covers (an entry's reported position is
    max(lo, index * block_size)); hi >= 0 marks a read of positions up to hi, hi == -1 a
    write. `ctx[i]` is (request id, fingerprints) of segment i. `markers` are violations
    found while building, keyed by the number of segments before them, so reports come out
    in the order the step made its touches. Null-block touches are kept: the null block is
    never freed and never written, so they can never report.
    """

    __slots__ = ("step", "nums", "ctx", "markers", "bids", "vers", "seg", "index", "lo", "group", "state_writes")

    def __init__(self, step: int) -> None:
        self.step = step
        self.nums: list[int] = []
        self.ctx: list[tuple[str, list[int]]] = []
        self.markers: list[tuple[int, Violation]] = []
        # Mamba state writes (block, fingerprint, writer), applied after every read of the step.
        self.state_writes: list[tuple[int, int, str]] = []
        # Filled by ShadowKV.begin: every touched block id, its version after dispatch, its
        # segment and block index; lo and group per segment (for reports).
        self.bids: Any = _EMPTY
        self.vers: Any = _EMPTY
        self.seg: Any = _EMPTY
        self.index: Any = _EMPTY
        self.lo: list[int] = []
        self.group: list[int] = []

    def add(self, group: int, row: int, first: int, count: int, lo: int, hi: int, rid: str, fps: list[int]) -> None:
        self.nums += (group, row, first, count if count > 0 else 0, lo, hi)
        self.ctx.append((rid, fps))

    def mark(self, v: Violation) -> None:
        self.markers.append((len(self.ctx), v))

    def context(self, e: int, block_size: int) -> tuple[str, int, int]:
        """(request, group, position) of entry e (after begin)."""
        s = int(self.seg[e])
        return self.ctx[s][0], self.group[s], max(self.lo[s], int(self.index[e]) * block_size)


_EMPTY = np.zeros(0, dtype=np.int64)


class ShadowKV:
    """Slot contents, writers and versions of every block, block tables of live requests
    (one row each), what each row last verified, and the steps in flight."""

    def __init__(self, num_blocks: int, block_size: int, num_groups: int = 1, strict: bool = True) -> None:
        self.block_size = block_size
        self.strict = strict
        self.slots: list[list[int] | None] = [None] * num_blocks
        self.version = np.zeros(num_blocks, dtype=np.int64)
        self.writer: list[str | None] = [None] * num_blocks
        self.in_flight_refs = np.zeros(num_blocks, dtype=np.int64)
        self.in_flight: deque[StepTouches] = deque()
        self.violations: list[Violation] = []
        # Steps with at most this many touches are checked entry by entry: cheaper than
        # numpy's fixed cost per call (tests and small workloads are made of such steps).
        self.small_step_entries = 48
        # Per (group, row, block index): block id, version and highest position verified.
        self.num_groups = num_groups
        self._free_rows: list[int] = []
        self._num_rows = 0
        self.table = np.zeros((num_groups, 0, 0), dtype=np.int64)
        self.vbid = np.zeros_like(self.table)
        self.vver = np.zeros_like(self.table)
        self.vpos = np.zeros_like(self.table)
        self._iota = np.arange(1024, dtype=np.int64)
        self._resize(16, 32)

    def report(self, v: Violation) -> None:
        self.violations.append(v)
        if self.strict:
            raise RaceViolation(v)

    # -- block tables, one row per live request ----------------------------------------
    def _resize(self, rows: int, cols: int) -> None:
        g, r, c = self.table.shape
        new = [np.zeros((g, rows, cols), dtype=np.int64) for _ in range(4)]
        new[1].fill(-1)  # verified block id -1: never verified
        for arr, old in zip(new, (self.table, self.vbid, self.vver, self.vpos)):
            arr[:, :r, :c] = old
        self.table, self.vbid, self.vver, self.vpos = new
        # Flat views (the arrays are C-contiguous), for gathers by flat index.
        self._table_flat, self._vbid_flat = self.table.reshape(-1), self.vbid.reshape(-1)
        self._vver_flat, self._vpos_flat = self.vver.reshape(-1), self.vpos.reshape(-1)

    def alloc_row(self) -> int:
        if not self._free_rows:
            n = self._num_rows
            if n == self.table.shape[1]:
                self._resize(2 * n, self.table.shape[2])
            self._num_rows = n + 1
            return n
        row = self._free_rows.pop()
        self.vbid[:, row, :] = -1
        return row

    def release_row(self, row: int) -> None:
        self._free_rows.append(row)

    def set_blocks(self, group: int, row: int, start: int, block_ids: list[int]) -> None:
        end = start + len(block_ids)
        cols = self.table.shape[2]
        if end > cols:
            while cols < end:
                cols *= 2
            self._resize(self.table.shape[1], cols)
        self.table[group, row, start:end] = block_ids

    def set_null(self, group: int, row: int, start: int, end: int) -> None:
        self.table[group, row, start:end] = NULL

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

    # -- a dispatched step ------------------------------------------------------------
    def begin(self, st: StepTouches) -> StepTouches:
        """Check the step's cache reads, then record its touches as in flight.

        Called once the whole step has written its slots. One vectorized test clears
        every read whose (block id, version) matches what this table row last verified
        and whose extent is covered; the rest are content-checked in `_check_reads`.
        """
        bs = self.block_size
        if not st.nums:
            for _, v in st.markers:
                self.report(v)
            self.in_flight.append(st)
            return st
        total = sum(st.nums[3::6])
        if total <= self.small_step_entries:
            return self._begin_small(st)
        # numpy methods and operators only: on steps of a few requests the Python-level
        # wrappers (np.repeat, np.flatnonzero, ...) would cost more than the work.
        nums = np.array(st.nums, dtype=np.int64).reshape(-1, 6)
        group, row, first, count, lo, hi = nums.T
        ends = count.cumsum()
        seg = self._arange(len(count)).repeat(count)
        index = self._arange(total) - (ends - count - first).repeat(count)
        _, rows, cols = self.table.shape
        flat = ((group * rows + row) * cols).repeat(count) + index
        bids = self._table_flat[flat]
        seg_hi = hi.repeat(count)
        z = np.minimum(seg_hi, index * bs + (bs - 1))
        # vbid never holds the null block (a null read is never verified).
        ok = (self._vbid_flat[flat] == bids) & (self._vver_flat[flat] == self.version[bids])
        ok &= self._vpos_flat[flat] >= z
        ok |= seg_hi < 0
        todo = (~ok).nonzero()[0]
        st.lo, st.group = lo.tolist(), group.tolist()
        if len(todo) or st.markers:
            marks = [(int(ends[m - 1]) if m else 0, v) for m, v in st.markers]
            self._check_reads(st, marks, todo, seg[todo], index[todo], bids[todo], z[todo], flat[todo], lo)
        st.bids, st.vers, st.seg, st.index = bids, self.version[bids], seg, index
        np.add.at(self.in_flight_refs, bids, 1)
        self.in_flight.append(st)
        return st

    def _begin_small(self, st: StepTouches) -> StepTouches:
        """`begin` for a step of few touches, entry by entry: same checks, same order.

        Only one entry per (group, row, block index) per step, so updating the verified
        state as we go cannot change a later entry's outcome.
        """
        bs, nums, ctx, version, slots_of = self.block_size, st.nums, st.ctx, self.version, self.slots
        table, vbid, vver, vpos = self.table, self.vbid, self.vver, self.vpos
        markers, mi = st.markers, 0
        bids: list[int] = []
        seg: list[int] = []
        index: list[int] = []
        for i in range(len(ctx)):
            g, row, first, count, lo, hi = nums[6 * i : 6 * i + 6]
            while mi < len(markers) and markers[mi][0] <= i:
                self.report(markers[mi][1])
                mi += 1
            if not count:
                continue
            stop = first + count
            ids = table[g, row, first:stop].tolist()
            if hi >= 0:
                known = zip(vbid[g, row, first:stop].tolist(), vver[g, row, first:stop].tolist(),
                            vpos[g, row, first:stop].tolist())
                for b, bid, (kb, kv, kp) in zip(range(first, stop), ids, known):
                    base = b * bs
                    z = hi if hi < base + bs - 1 else base + bs - 1
                    if kb == bid and kv == version[bid] and kp >= z:
                        continue
                    a = lo if lo > base else base
                    slots = slots_of[bid]  # the null block is never written: None
                    if slots is not None and slots[a - base : z + 1 - base] == ctx[i][1][a : z + 1]:
                        vbid[g, row, b], vver[g, row, b], vpos[g, row, b] = bid, version[bid], z
                    else:
                        self.report(Violation(NULL_READ if bid == NULL else WRONG, st.step, ctx[i][0], g, bid, a))
            bids += ids
            seg += [i] * count
            index += range(first, stop)
        for _, v in markers[mi:]:
            self.report(v)
        st.lo, st.group = nums[4::6], nums[0::6]
        st.bids = np.array(bids, dtype=np.int64)
        st.vers, st.seg, st.index = version[st.bids], seg, index
        np.add.at(self.in_flight_refs, st.bids, 1)
        self.in_flight.append(st)
        return st

    def _arange(self, n: int) -> Any:
        """0..n-1 as a view of a cached array (grown by doubling)."""
        if n > len(self._iota):
            self._iota = np.arange(max(n, 2 * len(self._iota)), dtype=np.int64)
        return self._iota[:n]

    def _check_reads(self, st: StepTouches, markers: list[tuple[int, Violation]], todo: Any, seg: Any, index: Any,
                     bids: Any, z: Any, flat: Any, seg_lo: Any) -> None:
        """Content-check the reads the version test could not clear; report in touch order.

        A read of slots a..z of block bid must find the fingerprints of positions a..z,
        all of them (one C-level list compare), as a fresh read would. Passing reads
        record (block id, version, z) as verified.
        """
        bs, ctx, slots_of = self.block_size, st.ctx, self.slots
        base = index * bs
        first = np.maximum(seg_lo[seg], base)  # a = max(lo, b * bs)
        # One comprehension over the reads (cheaper per read than a loop with appends).
        passed = np.array([
            slots is not None and slots[off_a:off_z] == ctx[s][1][a:zz]  # the null block's slots are None
            for slots, s, a, zz, off_a, off_z in zip(
                [slots_of[bid] for bid in bids.tolist()], seg.tolist(), first.tolist(), (z + 1).tolist(),
                (first - base).tolist(), (z + 1 - base).tolist())
        ], dtype=bool)
        done = passed.nonzero()[0]
        failed = (~passed).nonzero()[0].tolist()
        if failed or markers:
            self._report_reads(st, markers, failed, todo, seg, bids, first)
        if len(done):
            f = flat[done]
            done_bids = bids[done]
            self._vbid_flat[f] = done_bids
            self._vver_flat[f] = self.version[done_bids]
            self._vpos_flat[f] = z[done]

    def _report_reads(self, st: StepTouches, markers: list[tuple[int, Violation]], failed: list[int], todo: Any,
                      seg: Any, bids: Any, first: Any) -> None:
        """Report failed reads (null block or wrong content) and build-time markers, merged
        by entry index so they come out in touch order."""
        events = [(int(todo[i]), 1, i) for i in failed] + [(e, 0, k) for k, (e, _) in enumerate(markers)]
        events.sort()
        for _, is_read, i in events:
            if not is_read:
                self.report(markers[i][1])
                continue
            s, bid = int(seg[i]), int(bids[i])
            kind = NULL_READ if bid == NULL else WRONG
            self.report(Violation(kind, st.step, st.ctx[s][0], st.group[s], bid, int(first[i])))

    def end(self, st: StepTouches) -> None:
        """The step completed: every touched block must be unchanged by others since dispatch."""
        if self.in_flight and self.in_flight[0] is st:
            self.in_flight.popleft()
        else:
            self.in_flight.remove(st)
        bids = st.bids
        if not len(bids):
            return
        np.subtract.at(self.in_flight_refs, bids, 1)
        moved = (self.version[bids] != st.vers).nonzero()[0]
        for e in moved.tolist():
            bid = int(bids[e])
            rid, group, pos = st.context(e, self.block_size)
            if self.writer[bid] != rid:
                self.report(Violation(OVERWRITTEN, st.step, rid, group, bid, pos))

    def on_free(self, bid: int) -> None:
        """Block-pool hook: a block went back to the free queue."""
        if self.in_flight_refs[bid]:
            # Report the last touch of the newest in-flight step that touched the block.
            for st in reversed(self.in_flight):
                hits = (st.bids == bid).nonzero()[0]
                if len(hits):
                    rid, group, pos = st.context(int(hits[-1]), self.block_size)
                    self.report(Violation(FREED, st.step, rid, group, bid, pos))
                    return
