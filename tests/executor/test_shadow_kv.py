"""The shadow KV's checks, driven directly: ownership, rewrites by the same writer, the
end-of-step overwrite check, and the two ways `begin` checks a step (entry by entry for
small steps, vectorized for large ones), which must report the same violations."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from hybridserve.executor.sim.shadow_kv import (
    FREED, OVERWRITTEN, SHARED_WRITE, UNOWNED, WRONG, ShadowKV, StepTouches, Violation,
)

BS = 4
# Fingerprints of a request's positions 0..15 (4 blocks of 4): any distinct ints do.
FPS = {"A": [100 + p for p in range(16)], "B": [200 + p for p in range(16)]}

ENTRYWISE = 10**9  # small_step_entries: every step takes the entry-by-entry path
VECTORIZED = -1  # every step takes the vectorized path


def shadow(path: int) -> ShadowKV:
    kv = ShadowKV(num_blocks=8, block_size=BS, num_groups=1, strict=False)
    kv.small_step_entries = path
    return kv


def read_step(step: int, row: int, rid: str, first: int, count: int, lo: int, hi: int) -> StepTouches:
    t = StepTouches(step)
    t.add(0, row, first, count, lo, hi, rid, FPS[rid])
    return t


def fill(kv: ShadowKV, bid: int, rid: str, block_index: int) -> None:
    """rid writes its positions of block_index into block bid."""
    kv.write(bid, 0, FPS[rid][block_index * BS : block_index * BS + BS], rid)


def row_of(kv: ShadowKV, rid: str, bids: list[int]) -> int:
    """A table row holding bids, each filled with rid's content of its position."""
    row = kv.alloc_row()
    kv.set_blocks(0, row, 0, bids)
    for index, bid in enumerate(bids):
        fill(kv, bid, rid, index)
    return row


def both_paths(test):
    """Run a scenario on each path; each must see exactly the expected violations."""
    def run():
        for path in (ENTRYWISE, VECTORIZED):
            test(shadow(path))
    run.__name__ = test.__name__
    return run


@both_paths
def test_read_of_a_block_freed_but_not_reused_is_unowned(kv):
    row = row_of(kv, "A", [3, 5])
    kv.end(kv.begin(read_step(1, row, "A", 0, 2, 0, 6)))
    assert kv.violations == []
    kv.on_free(3)  # reference count 0; slots untouched, so the content still matches
    kv.end(kv.begin(read_step(2, row, "A", 0, 2, 0, 7)))
    assert kv.violations == [Violation(UNOWNED, 2, "A", 0, 3, 0)]


@both_paths
def test_read_of_a_block_freed_and_handed_to_another_request_is_unowned(kv):
    row_a, row_b = kv.alloc_row(), kv.alloc_row()
    kv.set_blocks(0, row_a, 0, [3])
    fill(kv, 3, "A", 0)
    kv.on_free(3)
    kv.set_blocks(0, row_b, 0, [3])  # B gets block 3 (a prefix hit: same content)
    kv.end(kv.begin(read_step(1, row_b, "B", 0, 1, 0, 3)))  # B owns it: B's read is checked on content
    assert kv.violations == [Violation(WRONG, 1, "B", 0, 3, 0)]
    kv.violations.clear()
    kv.end(kv.begin(read_step(2, row_a, "A", 0, 1, 0, 3)))
    assert kv.violations == [Violation(UNOWNED, 2, "A", 0, 3, 0)]


@both_paths
def test_write_to_an_unowned_block_is_reported(kv):
    row = kv.alloc_row()
    kv.set_blocks(0, row, 0, [2, 6])
    kv.on_free(6)
    t = StepTouches(1)
    t.add(0, row, 1, 1, 5, -1, "A", [])  # a write of position 5 (block index 1)
    kv.end(kv.begin(t))
    assert kv.violations == [Violation(UNOWNED, 1, "A", 0, 6, 5)]


@both_paths
def test_a_block_given_again_after_a_free_is_owned(kv):
    row = kv.alloc_row()
    kv.set_blocks(0, row, 0, [3])
    kv.on_free(3)
    kv.set_blocks(0, row, 0, [3])  # the table gets it anew (new reference)
    fill(kv, 3, "A", 0)
    kv.end(kv.begin(read_step(1, row, "A", 0, 1, 0, 3)))
    assert kv.violations == []


@both_paths
def test_a_verified_slot_rewritten_by_the_same_writer_is_compared_again(kv):
    row = kv.alloc_row()
    kv.set_blocks(0, row, 0, [4])
    fill(kv, 4, "A", 0)
    kv.end(kv.begin(read_step(1, row, "A", 0, 1, 0, 3)))  # verified up to position 3
    kv.write(4, 1, [-1], "A")  # A itself puts garbage in position 1
    kv.end(kv.begin(read_step(2, row, "A", 0, 1, 0, 3)))
    assert kv.violations == [Violation(WRONG, 2, "A", 0, 4, 0)]


@both_paths
def test_end_reports_another_writer_even_when_the_request_wrote_last(kv):
    row = kv.alloc_row()
    kv.set_blocks(0, row, 0, [5])
    fill(kv, 5, "A", 0)
    rec = kv.begin(read_step(1, row, "A", 0, 1, 0, 3))
    kv.write(5, 0, [7], "load:X")  # another writer while step 1 is in flight ...
    fill(kv, 5, "A", 0)  # ... then the request again: the last writer is A
    kv.end(rec)
    assert kv.violations == [Violation(OVERWRITTEN, 1, "A", 0, 5, 0)]


@both_paths
def test_end_accepts_writes_by_the_request_alone(kv):
    row = kv.alloc_row()
    kv.set_blocks(0, row, 0, [5])
    kv.write(5, 0, [1], "load:X")  # last writer at dispatch: someone else
    fill(kv, 5, "A", 0)
    rec = kv.begin(read_step(1, row, "A", 0, 1, 0, 2))
    fill(kv, 5, "A", 0)  # only A writes while the step is in flight
    fill(kv, 5, "A", 0)
    kv.end(rec)
    assert kv.violations == []


@both_paths
def test_a_free_while_in_flight_is_reported_once_and_later_reads_are_unowned(kv):
    row = row_of(kv, "A", [1, 2])
    rec = kv.begin(read_step(1, row, "A", 0, 2, 0, 5))
    kv.on_free(2)
    assert kv.violations == [Violation(FREED, 1, "A", 0, 2, 4)]
    kv.end(rec)
    kv.end(kv.begin(read_step(2, row, "A", 1, 1, 4, 5)))
    assert kv.violations[1:] == [Violation(UNOWNED, 2, "A", 0, 2, 4)]


# -- the two paths agree on any sequence of operations -------------------------------
ROWS, COLS = 2, 2
_bid = st.integers(1, 7)
_op = st.one_of(
    st.tuples(st.just("write"), st.integers(0, ROWS - 1), st.integers(0, COLS - 1), st.integers(0, BS - 1),
              st.sampled_from(["A", "B", "load"]), st.booleans()),
    st.tuples(st.just("fill"), st.integers(0, ROWS - 1), st.integers(0, COLS - 1)),
    st.tuples(st.just("free"), _bid),
    st.tuples(st.just("set"), st.integers(0, ROWS - 1), st.integers(0, COLS - 1), st.integers(0, 7)),
    st.tuples(st.just("step"), st.lists(st.tuples(st.integers(0, COLS), st.integers(0, COLS), st.integers(0, BS - 1)),
                                        min_size=ROWS, max_size=ROWS)),
    st.tuples(st.just("end"),),
)


def _play(ops: list, path: int) -> list[Violation]:
    kv = shadow(path)
    rows = [kv.alloc_row() for _ in range(ROWS)]
    rids = ["A", "B"]
    for r in rows:
        kv.set_blocks(0, r, 0, [1 + r, 3 + r])
    in_flight: list[StepTouches] = []
    for n, op in enumerate(ops):
        if op[0] == "write":
            _, r, index, offset, writer, right = op  # one slot of a block in a row's table
            value = FPS[rids[r]][index * BS + offset] if right else -n
            kv.write(int(kv.table[0, rows[r], index]), offset, [value], writer)
        elif op[0] == "fill":  # a row's request writes the right content into one of its blocks
            _, r, index = op
            bid = int(kv.table[0, rows[r], index])
            if bid:
                fill(kv, bid, rids[r], index)
        elif op[0] == "free":
            kv.on_free(op[1])
        elif op[0] == "set":
            _, r, index, bid = op
            if bid:
                kv.set_blocks(0, rows[r], index, [bid])
            else:
                kv.set_null(0, rows[r], index, index + 1)
        elif op[0] == "step":
            t = StepTouches(n)
            for r, (a, b, off) in enumerate(op[1]):
                split, stop = min(a, b), max(a, b)  # reads of blocks 0..split-1, writes split..stop-1
                if split:
                    lo = off if split > 1 else min(off, BS - 1)
                    t.add(0, rows[r], 0, split, lo, split * BS - 1 - (off if split > 1 else 0), rids[r], FPS[rids[r]])
                if stop > split:
                    t.add(0, rows[r], split, stop - split, split * BS, -1, rids[r], [])
            in_flight.append(kv.begin(t))
        elif in_flight:
            kv.end(in_flight.pop(0))
    for t in in_flight:
        kv.end(t)
    return kv.violations


@settings(max_examples=500, deadline=None)
@given(st.lists(_op, max_size=40))
# A verified read, the request's own garbage in it, the read again (the stamp must move).
@example([("fill", 0, 0), ("step", [(1, 1, 0), (0, 0, 0)]), ("write", 0, 0, 0, "A", False),
          ("step", [(1, 1, 0), (0, 0, 0)])])
def test_entrywise_and_vectorized_checks_report_the_same(ops):
    assert _play(ops, ENTRYWISE) == _play(ops, VECTORIZED)


def test_a_state_rewritten_with_new_content_while_another_table_holds_it_is_reported() -> None:
    kv = ShadowKV(num_blocks=8, block_size=BS, num_groups=1, strict=False)
    shared = {3}
    kv.is_shared = lambda bid: bid in shared
    kv.write_state(3, 11, "A", step=0, group=0)  # fresh block: nothing to compare
    kv.write_state(3, 11, "B", step=1, group=0)  # the same state written back: harmless
    kv.write_state(5, 12, "A", step=1, group=0)
    kv.write_state(5, 13, "A", step=2, group=0)  # not shared: the owner moves its state on
    assert kv.violations == []
    kv.write_state(3, 14, "A", step=3, group=0)
    assert kv.violations == [Violation(SHARED_WRITE, 3, "A", 0, 3, -1)]
