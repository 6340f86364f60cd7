"""Window-tail allocation: sliding-window memory independent of the chunk size."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.core.kv.spec import FullAttentionSpec, SlidingWindowSpec, WindowTail, blocks_touched
from hybridserve.testing import fake_runner_output, make_requests, make_scheduler
from tests.helpers.sim_helpers import make_request, reference_output, run_sim


def sliding_table(sched, rid="0", group=0):
    return sched.kv.coordinator.managers[group].req_to_blocks[rid]


def test_only_the_tail_of_a_long_chunk_gets_real_blocks():
    sw = SlidingWindowSpec(16, 1, 8, sliding_window=32)
    sched = make_scheduler(kv_specs=[sw], num_blocks=200, max_model_len=1024, window_tail_allocation=True)
    (req,) = make_requests(1, 300)
    sched.add_request(req)
    out = sched.schedule()
    table = sliding_table(sched)
    assert len(table) == 19  # positions 0..299, absolute positions kept
    # Tail: the last W-1 = 31 positions, 269..299 -> blocks 16, 17, 18.
    assert [i for i, b in enumerate(table) if not b.is_null] == [16, 17, 18]
    assert out.requests[0].new_block_ids[0][:16] == [0] * 16
    assert sched.kv.pool.num_free_blocks == 199 - 3


def test_settled_mode_allocates_every_slot_of_the_chunk():
    sw = SlidingWindowSpec(16, 1, 8, sliding_window=32)
    sched = make_scheduler(kv_specs=[sw], num_blocks=200, max_model_len=1024, window_tail_allocation=False)
    (req,) = make_requests(1, 300)
    sched.add_request(req)
    sched.schedule()
    assert all(not b.is_null for b in sliding_table(sched))


def test_next_chunk_reads_the_previous_tail_and_pruning_skips_holes():
    sw = SlidingWindowSpec(16, 1, 8, sliding_window=32)
    sched = make_scheduler(
        kv_specs=[FullAttentionSpec(16, 1, 8), sw], num_blocks=400, max_model_len=2048,
        max_num_batched_tokens=256, async_scheduling=True, window_tail_allocation=True,
    )
    (req,) = make_requests(1, 600, max_tokens=4)
    sched.add_request(req)
    a = sched.schedule()  # 0..255
    b = sched.schedule()  # 256..511, scheduled while a is in flight
    table = sliding_table(sched, group=1)
    real = [i for i, blk in enumerate(table) if not blk.is_null]
    # a's tail (225..255 -> blocks 14, 15) and b's tail (481..511 -> blocks 30, 31).
    assert real == [14, 15, 30, 31]
    sched.update_from_output(a, fake_runner_output(a))
    sched.schedule()  # settled 256: a's tail beyond the window start (225) stays
    assert [i for i, blk in enumerate(table) if not blk.is_null][:2] == [14, 15]
    sched.update_from_output(b, fake_runner_output(b))
    sched.schedule()  # settled 512: blocks below 481 are pruned, holes skipped
    assert [i for i, blk in enumerate(table) if not blk.is_null][:2] == [30, 31]


def test_cap_is_independent_of_max_num_batched_tokens():
    sw = SlidingWindowSpec(16, 1, 8, sliding_window=1024)
    tail = WindowTail(max_in_flight_steps=2)
    caps = {b: sw.max_admission_blocks_per_request(2 * b, 32768, tail) for b in (2048, 8192, 32768)}
    assert len(set(caps.values())) == 1
    assert caps[8192] == blocks_touched(1023, 16) + 2 * blocks_touched(1023, 16) == 3 * 65
    # Against the settled basis with two overlapping batches of 8192: 1089 blocks.
    assert sw.max_admission_blocks_per_request(2 * 8192, 32768) == 1089


@settings(max_examples=80, deadline=None)
@given(
    window=st.integers(2, 80),
    bs=st.sampled_from([1, 2, 4, 8, 16]),
    budget=st.integers(1, 300),
    batches=st.integers(1, 3),
    spec_tokens=st.integers(0, 3),
    prompt=st.integers(1, 400),
    async_sched=st.booleans(),
)
def test_no_request_holds_more_real_blocks_than_the_cap(window, bs, budget, batches, spec_tokens, prompt, async_sched):
    """Run through the scheduler with the shadow-KV detector; run_sim asserts the cap per step."""
    budget = max(budget, spec_tokens + 1)
    specs = [SlidingWindowSpec(bs, 1, 8, sliding_window=window)]
    req = make_request("0", [(j * 7) % 300 + 2 for j in range(prompt)], 12)
    other = make_request("1", [(j * 11) % 300 + 2 for j in range(prompt // 2 + 1)], 12)
    run = run_sim(
        specs, [(0, req), (1, other)], 2000, async_scheduling=async_sched, concurrent_batches=batches,
        max_num_batched_tokens=budget, max_model_len=512, num_speculative_tokens=spec_tokens,
        acceptance_rate=0.5, window_tail_allocation=True,
    )
    assert run.violations == []
    assert run.outputs["0"] == reference_output(req.prompt_token_ids, 12, 512)
    assert run.num_free_blocks == 1999
