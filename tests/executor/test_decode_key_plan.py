"""A decode step's key plans (executor/torch/attention.py): each request's run of keys
(first key in its gathered blocks, key count) and, where SDPA reads them, the mask over the
gathered blocks, for full, sliding-window and chunked-local groups; the numbers are worked
out by hand below. The decode steps' own planner (StepAttention._plan_decode) makes the
general path's plans on any tables, windows and positions."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from hybridserve.executor.torch.attention import StepAttention  # noqa: E402
from hybridserve.executor.torch.requests import BlockTables  # noqa: E402
from tests.helpers.block_tables import consecutive_tables  # noqa: E402

BS = 4
WINDOWS, CHUNKS = [None, 6, None], [None, None, 8]  # full, sliding window 6, chunked local 8
STARTS = np.array([0, 5, 11])  # one query each, at these positions

# Per group: (first block column, blocks gathered, first key within them, key count, the
# allowed key positions of each request). A query at s reads lo..s:
#   full:        lo = 0;                s = 0, 5, 11 -> blocks 0.., 3 gathered (s = 11 needs 0-2)
#   sliding 6:   lo = max(0, s - 5) = 0, 0, 6 -> first blocks 0, 0, 1; 2 gathered (11 // 4 - 1 + 1)
#   chunked 8:   lo = s // 8 * 8 = 0, 0, 8 -> first blocks 0, 0, 2; 2 gathered (5 needs blocks 0-1)
EXPECTED = [
    ([0, 0, 0], 3, [0, 0, 0], [1, 6, 12], [range(0, 1), range(0, 6), range(0, 12)]),
    ([0, 0, 1], 2, [0, 0, 2], [1, 6, 6], [range(0, 1), range(0, 6), range(6, 12)]),
    ([0, 0, 2], 2, [0, 0, 0], [1, 6, 4], [range(0, 1), range(0, 6), range(8, 12)]),
]


def _step(in_place: bool, dtype: torch.dtype = torch.float32) -> StepAttention:
    n = len(STARTS)
    cache = torch.zeros(len(WINDOWS), 1 + len(WINDOWS) * n * 4, BS, 2, 1, 8, dtype=dtype)
    return StepAttention([(g, cache[g]) for g in range(len(WINDOWS))], WINDOWS, consecutive_tables(len(WINDOWS), n, 4),
                         BS, np.arange(n), STARTS, np.ones(n, dtype=np.int64), 8 ** -0.5, None, torch.device("cpu"),
                         dtype, chunks=CHUNKS, in_place_decode=in_place)


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_requests_run_of_keys_and_its_mask(in_place: bool, dtype: torch.dtype) -> None:
    step = _step(in_place, dtype)
    for g, (first_blk, blocks, first_key, count, allowed) in enumerate(EXPECTED):
        plan = step.groups[g].plans[0]
        assert plan.first_blk.tolist() == first_blk and plan.num_blocks == blocks and not plan.from_batch
        assert plan.first_key.tolist() == first_key and plan.key_count.tolist() == count
        mask = plan.mask
        assert mask.shape == (len(STARTS), 1, 1, blocks * BS) and mask.dtype == dtype
        for r, keys in enumerate(allowed):
            positions = first_blk[r] * BS + np.arange(blocks * BS)
            want = np.where(np.isin(positions, list(keys)), 0.0, -np.inf)
            assert mask[r, 0, 0].float().numpy().tolist() == want.tolist(), (g, r)


def test_the_decode_plan_hands_the_kernel_the_same_runs() -> None:
    """decode_plan (what the decode stack reads): slots, each request's gathered block ids,
    and the runs above, per group."""
    step = _step(True)
    if step.decode_kernel is None:
        pytest.skip("no C compiler: the in-place kernel is not built")
    n = len(STARTS)
    for g, (first_blk, blocks, first_key, count, _) in enumerate(EXPECTED):
        slots, ids, first, key_count = step.decode_plan(g)
        own = 1 + g * n * 4 + np.arange(n) * 4  # consecutive_tables: request r's first block
        assert slots.tolist() == [int(own[r] + STARTS[r] // BS) * BS + int(STARTS[r] % BS) for r in range(n)]
        assert ids.tolist() == [[int(own[r]) + first_blk[r] + j for j in range(blocks)] for r in range(n)]
        assert first.tolist() == first_key and key_count.tolist() == count


def _read(address: int, count: int) -> list[int]:
    return list((ctypes.c_int64 * count).from_address(address))


def _plans(step: StepAttention) -> list:
    """Everything a step's attention reads, per group, as plain values; and what decode_plan
    hands the decode stack, which reads it as contiguous memory."""
    out = [[(b.req.tolist(), b.B, b.C, b.row_slice, b.q_gather, b.valid_rows, b.valid_sel) for b in step.batches]]
    for g in range(len(step.layers)):  # one layer per group in these steps
        at = step.decode_plan_addresses(g)  # first: a natively planned step's, before its tensors exist
        handed = step.decode_plan(g)
        assert handed is None or all(t.is_contiguous() and t.dtype == torch.int64 for t in handed)
        out.append(None if handed is None else [t.tolist() for t in handed])
        assert (at is None) == (handed is None)
        if at is not None:  # the stack's addresses hold the same numbers
            slots, ids, first, count, per_row = at
            n = step.num_tokens
            assert per_row == handed[1].shape[1]
            assert [_read(slots, n), _read(ids, n * per_row), _read(first, n), _read(count, n)] == \
                [t.reshape(-1).tolist() for t in handed]
    for gp in step.groups:
        out.append((gp.slots.tolist(), None if gp.write_sel is None else gp.write_sel.tolist(),
                    [None if ids is None else ids.tolist() for ids in gp.gather_ids],
                    [(p.first_blk.tolist(), p.num_blocks, p.from_batch,
                      None if p.first_key is None else (p.first_key.dtype, p.first_key.tolist()),
                      None if p.key_count is None else (p.key_count.dtype, p.key_count.tolist()),
                      None if p.mask is None else p.mask.tolist()) for p in gp.plans]))
    return out


@settings(max_examples=150, deadline=None)
@given(data=st.data(), n=st.integers(1, 6), bs=st.sampled_from([1, 2, 4, 16]), per_token=st.booleans())
def test_the_decode_planner_makes_the_general_paths_plans(data, n: int, bs: int, per_token: bool) -> None:
    """Random decode steps: groups full, sliding or chunked-local; block ids random (null
    ones, window-tail allocation's, where a step falls back to the general path); positions
    random, sometimes all 0 (every key in the batch)."""
    kinds = data.draw(st.lists(st.sampled_from([(None, None), (3, None), (9, None), (None, 4), (None, 8)]),
                               min_size=1, max_size=4))
    windows, chunks = [w for w, _ in kinds], [c for _, c in kinds]
    starts = np.array(data.draw(st.lists(st.integers(0, 40), min_size=n, max_size=n)), dtype=np.int64)
    if data.draw(st.booleans()):
        starts[:] = 0
    tables = BlockTables(len(kinds))
    rows = np.array(data.draw(st.permutations(range(8)))[:n], dtype=np.int64)
    null_share = data.draw(st.sampled_from([0.0, 0.0, 0.3]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    for g in range(len(kinds)):
        for r, start in zip(rows, starts):
            blocks = int(start) // bs + 1 + int(rng.integers(0, 2))
            ids = rng.integers(1, 500, blocks) * (rng.random(blocks) >= null_share)
            tables.append(g, int(r), ids.tolist())
    cache = torch.zeros(500, bs, 2, 1, 8)

    def step() -> StepAttention:
        return StepAttention([(g, cache) for g in range(len(kinds))], windows, tables, bs, rows, starts,
                             np.ones(n, dtype=np.int64), 0.5, None, torch.device("cpu"), torch.float32,
                             chunks=chunks, per_token=per_token)

    try:
        fast = _plans(step())
    except RuntimeError as exc:  # batch-invariant attention with a null slot: both refuse
        fast = str(exc)
    with pytest.MonkeyPatch.context() as general:
        general.setattr(StepAttention, "_plan_decode", lambda *a, **k: False)
        try:
            assert fast == _plans(step())
        except RuntimeError as exc:
            assert fast == str(exc)
