"""Shadow KV: a race detector that mirrors what every KV slot holds.

Each physical block keeps a list of slot fingerprints (the fingerprint of the prefix that
produced the slot), the id of its last writer, a write stamp bumped by every rewrite
(a write reaching a slot written before), a writer version bumped whenever a different writer (another request, a connector load)
writes it, and a free generation bumped whenever its reference count drops to 0. Each
table entry remembers the block's free generation when the request got it. A step:

    dispatch:   write its slots, then check every slot it reads from the cache holds the
                expected fingerprint (attention reads are checked once the whole batch
                has written, as on a GPU where a batch's KV writes land before its
                attention; Mamba states are checked before any state of the step is
                written, as a Mamba layer reads every request's state before it writes
                any); record (block, version) for each block touched
    in flight:  a free of a touched block            -> freed-while-in-flight
    completion: a writer other than the step's request wrote a touched block since
                dispatch                             -> overwritten-while-read

A touch of a block freed since the request's table got it (its free generation moved:
the reference count reached 0, whether or not the block was handed out again) is
unowned-block, checked before content: a freed block keeps its slots until reused, so
its content alone would look right. Reads of block id 0 (the null block) are
read-of-null-slot; wrong fingerprints are wrong-content. A Mamba state written with new
content into a block another table holds too is shared-state-overwritten (at the write:
that table's read may come much later, or never, while the prefix cache serves it).

Cost grows with blocks touched, never with tokens, and the per-block work is numpy:
a step's touches are a list of segments (a contiguous range of one request's block table
in one group), expanded once per step into flat arrays. Each (group, table row, block
index) remembers the block id, write stamp and highest position it was last verified
at; a read whose block id and stamp still match and whose extent is covered skips the
content compare (one vectorized test per step). The stamp moves on every rewrite, the
request's own included, so a verified slot rewritten by anyone is compared again; a
write only past every slot written so far (the usual append) cannot touch a verified
slot and leaves it (a Python-list compare, not a numpy update, per write). The rest, typically each request's
newest block, whose extent grew, is compared in full (one C-level list compare per
block, so any slot changed since, even by the request itself, is caught). In-flight
references are counted per block with np.add.at / np.subtract.at; a free checks one
counter.

Invariants: stamp[b] changes on every write of b that starts below filled[b] (one past
the highest slot of b ever written), so a verified slot (always below filled[b]) is
never rewritten with the stamp unchanged, and whenever b is freed, so a read cleared as
verified is of a block its request still owns; version[b] changes exactly when a
writer other than writer[b] writes b (so a version moved by one with writer[b] == r
means only r wrote since); free_gen[b] changes exactly when b's reference count drops
to 0; in_flight_refs[b] is the number of (dispatched, not completed) step touches of b;
verified state of a table row is reset whenever the row is handed to a new request.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from hybridserve.core.errors import HybridServeError

NULL = 0
FREED = "freed-while-in-flight"
OVERWRITTEN = "overwritten-while-read"
NULL_READ = "read-of-null-slot"
WRONG = "wrong-content"
UNALLOCATED = "unallocated-slot"
UNOWNED = "unowned-block"
SHARED_WRITE = "shared-state-overwritten"


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
        # Mamba state writes (block, fingerprint, writer, group), applied after every read of the step.
        self.state_writes: list[tuple[int, int, str, int]] = []
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
    """Slot contents, writers, stamps and versions of every block, block tables of live
    requests (one row each), what each row last verified, and the steps in flight."""

    def __init__(self, num_blocks: int, block_size: int, num_groups: int = 1, strict: bool = True) -> None:
        self.block_size = block_size
        self.strict = strict
        self.slots: list[list[int] | None] = [None] * num_blocks
        self.stamp = np.zeros(num_blocks, dtype=np.int64)
        self.filled: list[int] = [0] * num_blocks  # one past the highest slot ever written
        self.version = np.zeros(num_blocks, dtype=np.int64)
        self.writer: list[str | None] = [None] * num_blocks
        self.free_gen = np.zeros(num_blocks, dtype=np.int64)
        self.in_flight_refs = np.zeros(num_blocks, dtype=np.int64)
        self.in_flight: deque[StepTouches] = deque()
        self.violations: list[Violation] = []
        # Steps with at most this many touches are checked entry by entry
        # (`_begin_entrywise`): cheaper than numpy's fixed cost per call (tests and small
        # workloads are made of such steps). Both paths report the same violations.
        self.small_step_entries = 48
        # Per (group, row, block index): block id, the block's free generation when the
        # row got it, and the block id, stamp and highest position last verified.
        self.num_groups = num_groups
        self._free_rows: list[int] = []
        self._num_rows = 0
        self.table = np.zeros((num_groups, 0, 0), dtype=np.int64)
        self.tgen = np.zeros_like(self.table)
        self.vbid = np.zeros_like(self.table)
        self.vstamp = np.zeros_like(self.table)
        self.vpos = np.zeros_like(self.table)
        self._iota = np.arange(1024, dtype=np.int64)
        # Block-pool hook: is block bid held by more than one table (or a table and a fenced
        # free)? Set by the executor that observes the pool; None: not checked.
        self.is_shared: Callable[[int], bool] | None = None
        self._resize(16, 32)

    def report(self, v: Violation) -> None:
        self.violations.append(v)
        if self.strict:
            raise RaceViolation(v)

    # -- block tables, one row per live request ----------------------------------------
    def _resize(self, rows: int, cols: int) -> None:
        g, r, c = self.table.shape
        new = [np.zeros((g, rows, cols), dtype=np.int64) for _ in range(5)]
        new[2].fill(-1)  # verified block id -1: never verified
        for arr, old in zip(new, (self.table, self.tgen, self.vbid, self.vstamp, self.vpos)):
            arr[:, :r, :c] = old
        self.table, self.tgen, self.vbid, self.vstamp, self.vpos = new
        # Flat views (the arrays are C-contiguous), for gathers by flat index.
        self._table_flat, self._tgen_flat = self.table.reshape(-1), self.tgen.reshape(-1)
        self._vbid_flat, self._vstamp_flat = self.vbid.reshape(-1), self.vstamp.reshape(-1)
        self._vpos_flat = self.vpos.reshape(-1)

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
        """The row's table gets block_ids at start..: the request owns them from now on."""
        end = start + len(block_ids)
        cols = self.table.shape[2]
        if end > cols:
            while cols < end:
                cols *= 2
            self._resize(self.table.shape[1], cols)
        self.table[group, row, start:end] = block_ids
        self.tgen[group, row, start:end] = self.free_gen[block_ids]

    def insert_before_last(self, group: int, row: int, last: int, block_ids: list[int]) -> None:
        """A running Mamba state kept in place (InPlaceMambaManager): entry `last` moves,
        with the generation it was got at, behind block_ids, which the row owns from now on."""
        end = last + len(block_ids)
        self.set_blocks(group, row, last + 1, block_ids)  # grows the table to end + 1 entries
        for arr in (self.table, self.tgen, self.vbid, self.vstamp, self.vpos):
            arr[group, row, end] = arr[group, row, last]
        self.set_blocks(group, row, last, block_ids)
        self.vbid[group, row, last:end] = -1

    def set_null(self, group: int, row: int, start: int, end: int) -> None:
        self.table[group, row, start:end] = NULL
        self.tgen[group, row, start:end] = 0  # the null block is never freed

    def owns(self, group: int, row: int, index: int, bid: int) -> bool:
        """Was block bid, at this table entry, not freed since the row got it?"""
        return bool(self.tgen[group, row, index] == self.free_gen[bid])

    # -- writes ----------------------------------------------------------------
    def write(self, bid: int, offset: int, fps: list[int], writer: str) -> None:
        """Write fingerprints into slots offset.. of block bid (null-block writes vanish)."""
        if bid == NULL:
            return
        slots = self.slots[bid]
        if slots is None:
            slots = self.slots[bid] = [0] * self.block_size
        slots[offset : offset + len(fps)] = fps
        self.wrote(bid, offset, offset + len(fps))
        if self.writer[bid] != writer:
            self.writer[bid] = writer
            self.version[bid] += 1

    def wrote(self, bid: int, a: int, z: int) -> None:
        """Slots a..z-1 of block bid were written: a rewrite moves the stamp."""
        filled = self.filled
        f = filled[bid]
        if a < f:
            self.stamp[bid] += 1
        if z > f:
            filled[bid] = z

    def write_state(self, bid: int, fp: int, writer: str, step: int = -1, group: int = -1) -> None:
        """A Mamba state write. A state is one slot with no reader recorded in flight, so a
        block that two tables hold (a checkpoint that another request hit) rewritten with
        other content would be seen only at a later read: reported here, at the write. The
        same content (a step writing back the state it read) is harmless."""
        if self.is_shared is not None:
            slots = self.slots[bid]
            if slots is not None and slots[0] != fp and self.is_shared(bid):
                self.report(Violation(SHARED_WRITE, step, writer, group, bid, -1))
        self.write(bid, 0, [fp], writer)

    # -- a dispatched step ------------------------------------------------------------
    def begin(self, st: StepTouches) -> StepTouches:
        """Check the step's touches and cache reads, then record its touches as in flight.

        Called once the whole step has written its slots. Every touch must be of a block
        the request still owns; a read whose (block id, stamp) matches what this table
        row last verified and whose extent is covered skips the content compare.
        """
        if not st.nums:
            for _, v in st.markers:
                self.report(v)
            self.in_flight.append(st)
            return st
        if sum(st.nums[3::6]) <= self.small_step_entries:
            return self._begin_entrywise(st)
        return self._begin_vectorized(st)

    def _begin_vectorized(self, st: StepTouches) -> StepTouches:
        """The general check: one vectorized test clears every write to an owned block
        and every read verified since the last write or free of its block; the rest go
        to `_check_reads`."""
        bs = self.block_size
        total = sum(st.nums[3::6])
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
        # vbid never holds the null block (a null read is never verified). A read still
        # verified is owned: verification checks ownership, and a free moves the stamp.
        ok = (self._vbid_flat[flat] == bids) & (self._vstamp_flat[flat] == self.stamp[bids])
        ok &= self._vpos_flat[flat] >= z
        is_write = seg_hi < 0
        ok |= is_write
        w = is_write.nonzero()[0]  # writes: only ownership to check
        if len(w):
            ok[w] = self._tgen_flat[flat[w]] == self.free_gen[bids[w]]
        todo = (~ok).nonzero()[0]
        st.lo, st.group = lo.tolist(), group.tolist()
        if len(todo) or st.markers:
            marks = [(int(ends[m - 1]) if m else 0, v) for m, v in st.markers]
            self._check_reads(st, marks, todo, seg[todo], index[todo], bids[todo], z[todo], flat[todo], lo)
        st.bids, st.vers, st.seg, st.index = bids, self.version[bids], seg, index
        np.add.at(self.in_flight_refs, bids, 1)
        self.in_flight.append(st)
        return st

    def _begin_entrywise(self, st: StepTouches) -> StepTouches:
        """The fast path for a step of few touches, entry by entry: the same checks as
        `_begin_vectorized`, reported in the same order.

        Only one entry per (group, row, block index) per step, so updating the verified
        state as we go cannot change a later entry's outcome.
        """
        bs, nums, ctx, stamp, free_gen, slots_of = self.block_size, st.nums, st.ctx, self.stamp, self.free_gen, self.slots
        table, tgen, vbid, vstamp, vpos = self.table, self.tgen, self.vbid, self.vstamp, self.vpos
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
            owned = (tgen[g, row, first:stop] == free_gen[ids]).tolist()
            if hi >= 0:
                known = zip(vbid[g, row, first:stop].tolist(), vstamp[g, row, first:stop].tolist(),
                            vpos[g, row, first:stop].tolist())
                for b, bid, own, (kb, ks, kp) in zip(range(first, stop), ids, owned, known):
                    base = b * bs
                    a = lo if lo > base else base
                    if not own:
                        self.report(Violation(UNOWNED, st.step, ctx[i][0], g, bid, a))
                        continue
                    z = hi if hi < base + bs - 1 else base + bs - 1
                    if kb == bid and ks == stamp[bid] and kp >= z:
                        continue
                    slots = slots_of[bid]  # the null block is never written: None
                    if slots is not None and slots[a - base : z + 1 - base] == ctx[i][1][a : z + 1]:
                        vbid[g, row, b], vstamp[g, row, b], vpos[g, row, b] = bid, stamp[bid], z
                    else:
                        self.report(Violation(NULL_READ if bid == NULL else WRONG, st.step, ctx[i][0], g, bid, a))
            elif not all(owned):
                for b, bid, own in zip(range(first, stop), ids, owned):
                    if not own:
                        self.report(Violation(UNOWNED, st.step, ctx[i][0], g, bid, max(lo, b * bs)))
            bids += ids
            seg += [i] * count
            index += range(first, stop)
        for _, v in markers[mi:]:
            self.report(v)
        st.lo, st.group = nums[4::6], nums[0::6]
        st.bids = np.array(bids, dtype=np.int64)
        st.vers, st.seg, st.index = self.version[st.bids], seg, index
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
        """Check the touches the vectorized test could not clear; report in touch order.

        A touch of a block freed since the row got it is unowned (a write lands here only
        for that reason). A read of slots a..z of an owned block bid must find the
        fingerprints of positions a..z, all of them (one C-level list compare), as a
        fresh read would. Passing reads record (block id, stamp, z) as verified.
        """
        bs, ctx, slots_of = self.block_size, st.ctx, self.slots
        base = index * bs
        first = np.maximum(seg_lo[seg], base)  # a = max(lo, b * bs)
        owned = (self._tgen_flat[flat] == self.free_gen[bids]).tolist()
        # One comprehension over the reads (cheaper per read than a loop with appends).
        passed = np.array([
            own and slots is not None and slots[off_a:off_z] == ctx[s][1][a:zz]  # the null block's slots are None
            for own, slots, s, a, zz, off_a, off_z in zip(
                owned, [slots_of[bid] for bid in bids.tolist()], seg.tolist(), first.tolist(), (z + 1).tolist(),
                (first - base).tolist(), (z + 1 - base).tolist())
        ], dtype=bool)
        done = passed.nonzero()[0]
        failed = (~passed).nonzero()[0].tolist()
        if failed or markers:
            self._report_reads(st, markers, failed, todo, seg, bids, first, owned)
        if len(done):
            f = flat[done]
            done_bids = bids[done]
            self._vbid_flat[f] = done_bids
            self._vstamp_flat[f] = self.stamp[done_bids]
            self._vpos_flat[f] = z[done]

    def _report_reads(self, st: StepTouches, markers: list[tuple[int, Violation]], failed: list[int], todo: Any,
                      seg: Any, bids: Any, first: Any, owned: list[bool]) -> None:
        """Report failed touches (unowned block, null block or wrong content) and
        build-time markers, merged by entry index so they come out in touch order."""
        events = [(int(todo[i]), 1, i) for i in failed] + [(e, 0, k) for k, (e, _) in enumerate(markers)]
        events.sort()
        for _, is_read, i in events:
            if not is_read:
                self.report(markers[i][1])
                continue
            s, bid = int(seg[i]), int(bids[i])
            kind = UNOWNED if not owned[i] else NULL_READ if bid == NULL else WRONG
            self.report(Violation(kind, st.step, st.ctx[s][0], st.group[s], bid, int(first[i])))

    def end(self, st: StepTouches) -> None:
        """The step completed: no writer other than its request may have written a block
        it touched since dispatch.

        The writer version moves once per change of writer, so a version moved by one
        with the request as the last writer means only the request wrote since; moved by
        two or more, some other writer came between (even if the request wrote last).
        """
        if self.in_flight and self.in_flight[0] is st:
            self.in_flight.popleft()
        else:
            self.in_flight.remove(st)
        bids = st.bids
        if not len(bids):
            return
        np.subtract.at(self.in_flight_refs, bids, 1)
        moved_by = self.version[bids] - st.vers
        for e in moved_by.nonzero()[0].tolist():
            bid = int(bids[e])
            rid, group, pos = st.context(e, self.block_size)
            if moved_by[e] > 1 or self.writer[bid] != rid:
                self.report(Violation(OVERWRITTEN, st.step, rid, group, bid, pos))

    def on_free(self, bid: int) -> None:
        """Block-pool hook: block bid's reference count dropped to 0 (back to the free queue).

        The stamp moves too, so no read of the block is cleared as verified any more:
        each is checked for ownership again."""
        self.free_gen[bid] += 1
        self.stamp[bid] += 1
        if self.in_flight_refs[bid]:
            # Report the last touch of the newest in-flight step that touched the block.
            for st in reversed(self.in_flight):
                hits = (st.bids == bid).nonzero()[0]
                if len(hits):
                    rid, group, pos = st.context(int(hits[-1]), self.block_size)
                    self.report(Violation(FREED, st.step, rid, group, bid, pos))
                    return
