"""A decode step's attention plan made in one native call (decode_plan.c says what and
why), built by models/platform/native_build.py; StepAttention._plan_decode uses it, and
where it cannot be built the general path plans every step."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import numpy as np

from hybridserve.executor.torch.requests import BlockTables
from hybridserve.models.platform.native_build import build, checked

SOURCE = Path(__file__).with_name("decode_plan.c")


class DecodeStepPlan:
    """The plan of a decode step of n tokens over G groups in one int64 array `words`
    (decode_plan.c's layout); `plan_of[g]` is group g's plan (its window / chunk),
    `num_blocks[p]` the blocks plan p gathers per request."""

    def __init__(self, words: np.ndarray, address: int, n: int, plan_of: tuple[int, ...],
                 num_blocks: tuple[int, ...]) -> None:
        self.words, self.n, self.plan_of, self.num_blocks = words, n, plan_of, num_blocks
        at = (len(plan_of) + 3 * len(num_blocks)) * n
        self._ids_at = []  # where each group's block ids start, in words
        for p in plan_of:
            self._ids_at.append(at)
            at += n * num_blocks[p]
        self._address = address  # words' first element

    def slots(self, g: int) -> np.ndarray:
        return self.words[g * self.n : (g + 1) * self.n]

    def run(self, p: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(first key, key count, first gathered block column) of plan p, each [n]."""
        at, n = (len(self.plan_of) + 3 * p) * self.n, self.n
        return self.words[at : at + n], self.words[at + n : at + 2 * n], self.words[at + 2 * n : at + 3 * n]

    def ids(self, g: int) -> np.ndarray:
        """Group g's block ids [n, num_blocks] of each request's gathered blocks."""
        at, nb = self._ids_at[g], self.num_blocks[self.plan_of[g]]
        return self.words[at : at + self.n * nb].reshape(self.n, nb)

    def addresses(self, g: int) -> tuple[int, int, int, int, int]:
        """(slots, block ids, first key, key count addresses, blocks per request) of group g,
        as the decode stack reads them: plain address arithmetic, no array made."""
        base, n, p = self._address, self.n, self.plan_of[g]
        run = base + 8 * (len(self.plan_of) + 3 * p) * n
        return base + 8 * g * n, base + 8 * self._ids_at[g], run, run + 8 * n, self.num_blocks[p]


class NativeDecodePlan:
    """(tables, rows, starts, block size, windows, chunks) -> DecodeStepPlan, 0 (the general
    path plans the step) or RuntimeError (a token without a block). Each plan has an array
    of its own (steps in flight may hold theirs at once), sized as the last plan's was and
    made anew only where it is too small."""

    def __init__(self) -> None:
        fn = build("decode_plan", SOURCE).decode_plan
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, i64, i64, ptr, ptr, ptr, i64, ctypes.c_int32,
                       ptr, i64, ptr]
        fn.restype = i64
        self._fn = fn
        self._size = 1024
        self._rules: dict[tuple[tuple[int | None, ...], tuple[int | None, ...]], tuple] = {}
        self._held: list[tuple[np.ndarray, ...]] = []

    def _rule(self, windows: tuple[int | None, ...], chunks: tuple[int | None, ...]) -> tuple:
        """(plan_of, the addresses of plan_of's, the windows' and the chunks' int64 arrays,
        plan count) for the groups' windows and chunks:
        groups of one (window, chunk) share a plan, numbered in first-seen order."""
        key = (windows, chunks)
        if key not in self._rules:
            kinds: list[tuple[int | None, int | None]] = []
            plan_of = []
            for kind in zip(windows, chunks):
                if kind not in kinds:
                    kinds.append(kind)
                plan_of.append(kinds.index(kind))
            arrays = (np.array(plan_of, dtype=np.int64), np.array([w or 0 for w, _ in kinds], dtype=np.int64),
                      np.array([c or 0 for _, c in kinds], dtype=np.int64))
            self._held.append(arrays)  # the addresses below stay valid
            self._rules[key] = (tuple(plan_of), *(a.ctypes.data for a in arrays), len(kinds))
        return self._rules[key]

    def __call__(self, tables: BlockTables, rows: np.ndarray, starts: np.ndarray, bs: int,
                 windows: tuple[int | None, ...], chunks: tuple[int | None, ...], per_token: bool
                 ) -> DecodeStepPlan | None:
        """rows / starts: int64, contiguous, one token a request."""
        plan_of, plan_at, window_at, chunk_at, plans = self._rule(windows, chunks)
        table, lengths = tables.table, tables.lengths
        num_blocks = (ctypes.c_int64 * plans)()
        while True:
            out = np.empty(self._size, dtype=np.int64)
            address = out.ctypes.data
            words = self._fn(table.ctypes.data, table.strides[0] // 8, table.strides[1] // 8, table.shape[2],
                             lengths.ctypes.data, lengths.strides[0] // 8, rows.ctypes.data, starts.ctypes.data,
                             len(rows), bs, len(plan_of), plan_at, window_at, chunk_at, plans, int(per_token),
                             address, len(out), num_blocks)
            if words <= len(out):
                break
            self._size = 2 * words
        if words < 0:
            raise RuntimeError("a scheduled token has no block in its table (scheduler and runner out of sync)")
        if words == 0:
            return None
        return DecodeStepPlan(out, address, len(rows), plan_of, tuple(num_blocks))


@cache
def native_decode_plan() -> NativeDecodePlan | None:
    """The planner, built and checked on first use; None where it cannot be built (the
    general path then plans every step, and a warning says why)."""
    return checked(NativeDecodePlan, _mismatch, "decode steps are planned by the general path")


def _mismatch(planner: NativeDecodePlan) -> str:
    """What is wrong with a small plan worked out by hand ('' when nothing is): blocks of 4,
    one full group and one of window 3, request row 1 at position 5 (its blocks 5 and 7):
    slot 7 * 4 + 1; full: keys 0..5 from block column 0 (ids 5, 7); window 3: keys 3..5,
    from column 0 too (first key 3, count 3)."""
    tables = BlockTables(2)
    for g in range(2):
        tables.append(g, 1, [5, 7])
    plan = planner(tables, np.array([1], dtype=np.int64), np.array([5], dtype=np.int64), 4, (None, 3),
                   (None, None), False)
    if plan is None:
        return "plans nothing for a plain decode step"
    got = [plan.slots(0).tolist(), plan.slots(1).tolist(), [a.tolist() for a in plan.run(0)],
           [a.tolist() for a in plan.run(1)], plan.ids(0).tolist(), plan.ids(1).tolist()]
    want = [[29], [29], [[0], [6], [0]], [[3], [3], [0]], [[5, 7]], [[5, 7]]]
    return "" if got == want else f"plans {got}, not {want}"
