"""In-flight accounting and settled-basis freeing: steps in flight while the next one is
scheduled (async, pipeline parallel), drafts rolled back, aborts and preemptions fenced.

Prompt 100 tokens, block 16. Window 16: tokens 0..84 are out of window once 100 are
processed -> 5 blocks. Chunk 32: 96 settled tokens -> 6 blocks.
"""

from __future__ import annotations

import pytest

from hybridserve.core.kv.block_pool import KVCacheBlock
from hybridserve.core.kv.spec import ChunkedLocalAttentionSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec
from hybridserve.testing import NullConnector, fake_runner_output, make_requests, make_scheduler

SW16 = SlidingWindowSpec(16, 1, 8, sliding_window=16)
CL32 = ChunkedLocalAttentionSpec(16, 1, 8, attention_chunk_size=32)


def nulls(sched, rid="0", group=0) -> int:
    return sum(1 for b in sched.kv.coordinator.managers[group].req_to_blocks[rid] if b.is_null)


def one(spec, async_scheduling=True, max_tokens=16, **kw):
    sched = make_scheduler(kv_specs=[spec], async_scheduling=async_scheduling, num_blocks=1000, **kw)
    (req,) = make_requests(1, 100, max_tokens=max_tokens)
    sched.add_request(req)
    return sched, req


def test_in_flight_accounting_async():
    sched, req = one(FullAttentionSpec(16, 1, 8))
    prefill = sched.schedule()
    assert req.num_in_flight_tokens == 100
    decode = sched.schedule()
    assert decode.requests[0].num_scheduled_tokens == 1
    assert req.num_in_flight_tokens == 101
    sched.update_from_output(prefill, fake_runner_output(prefill))
    assert req.num_in_flight_tokens == 1
    sched.update_from_output(decode, fake_runner_output(decode))
    assert req.num_in_flight_tokens == 0
    assert req.num_output_placeholders == 0
    assert len(req.output_token_ids) == 2


def test_sliding_window_async_frees_only_after_prefill_processed():
    sched, req = one(SW16)
    pool = sched.kv.pool
    prefill = sched.schedule()
    free_before = pool.num_free_blocks
    decode = sched.schedule()  # prefill still in flight: settled basis is 0
    assert nulls(sched) == 0
    assert pool.num_free_blocks == free_before
    sched.update_from_output(prefill, fake_runner_output(prefill))
    third = sched.schedule()  # 102 computed - 1 in flight... settled 100 -> 5 blocks
    assert nulls(sched) == 5
    assert pool.num_free_blocks == free_before + 5
    assert third.requests[0].num_null_blocks == (5,)
    # Later steps never free them twice (BlockPool would raise on a double free).
    for out in (decode, third):
        sched.update_from_output(out, fake_runner_output(out))
    for _ in range(5):
        out = sched.schedule()
        sched.update_from_output(out, fake_runner_output(out))
    assert pool.num_free_blocks + sum(1 for b in sched.kv.coordinator.managers[0].req_to_blocks["0"] if not b.is_null) == 999


def test_sliding_window_sync_frees_five_blocks_at_once():
    sched, req = one(SW16, async_scheduling=False)
    pool = sched.kv.pool
    prefill = sched.schedule()
    free_before = pool.num_free_blocks
    sched.update_from_output(prefill, fake_runner_output(prefill))
    sched.schedule()
    assert nulls(sched) == 5
    assert pool.num_free_blocks == free_before + 5


def test_chunked_local_async_six_blocks():
    # Without prefix caching: in a pure chunked-local model an all-null prefix "hit" of
    # the whole chunks before the current one is valid, and would skip the prefill.
    sched, req = one(CL32, enable_prefix_caching=False)
    pool = sched.kv.pool
    prefill = sched.schedule()
    free_before = pool.num_free_blocks
    sched.schedule()
    assert nulls(sched) == 0 and pool.num_free_blocks == free_before
    sched.update_from_output(prefill, fake_runner_output(prefill))
    sched.schedule()
    assert nulls(sched) == 6
    assert pool.num_free_blocks == free_before + 6


def test_unsafe_optimistic_free_frees_while_prefill_in_flight():
    sched, req = one(SW16, unsafe_optimistic_free=True)
    sched.schedule()
    sched.schedule()  # prunes on 101: blocks the prefill step still writes/reads
    assert nulls(sched) == 5


@pytest.mark.parametrize("overlap,expected", [(1, 129), (2, 193)])
def test_admission_caps_with_overlapping_batches(overlap, expected):
    sched = make_scheduler(
        kv_specs=[SlidingWindowSpec(16, 1, 8, sliding_window=1024)],
        num_blocks=400,
        max_model_len=16384,
        max_num_batched_tokens=1024,
        async_scheduling=overlap == 2,
    )
    assert sched.config.max_in_flight_tokens == 1024 * overlap
    spec = sched.kv.coordinator.managers[0].spec
    assert spec.max_admission_blocks_per_request(sched.config.max_in_flight_tokens, 16384) == expected
    assert sched.kv.config.min_num_blocks(sched.config.max_in_flight_tokens, 16384) == expected + 1


def test_connector_finished_prunes_on_settled_basis():
    class Recorder(NullConnector):
        def __init__(self):
            self.tables = []

        def request_finished(self, request, block_ids):
            self.tables.append(block_ids)
            return False, None

    conn = Recorder()
    sched, req = one(SW16, connector=conn)
    prefill = sched.schedule()
    sched.schedule()  # an over-scheduled decode, also in flight
    sched.transfer.request_finished(req)
    assert nulls(sched) == 0
    assert 0 not in conn.tables[-1][0]
    sched.update_from_output(prefill, fake_runner_output(prefill))
    sched.transfer.request_finished(req)
    assert nulls(sched) == 5
    assert conn.tables[-1][0][:5] == [0] * 5


def _spec_rollback(spec, enable_prefix_caching=True):
    """A decode step with 1 + 3 drafts, 2 rejected, under async scheduling."""
    sched = make_scheduler(kv_specs=[spec], async_scheduling=True, num_blocks=1000, num_speculative_tokens=3,
                           enable_prefix_caching=enable_prefix_caching)
    (req,) = make_requests(1, 59, max_tokens=50)
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, fake_runner_output(out))  # 59 processed, 1 output -> 60 tokens
    assert req.num_computed_tokens == 59 and req.num_tokens == 60
    spec_step = sched.schedule()
    sr = spec_step.requests[0]
    assert (sr.num_scheduled_tokens, sr.num_draft_tokens) == (4, 3)
    assert req.num_computed_tokens == 63 and req.num_in_flight_tokens == 4
    nxt = sched.schedule()  # scheduled while the spec step is in flight
    # Settled basis is still 59: nothing the rolled-back position reads may be nulled.
    table = sched.kv.coordinator.managers[0].req_to_blocks["0"]
    sched.update_from_output(spec_step, fake_runner_output(spec_step, {"0": [7, 8]}))  # 1 accepted + bonus
    assert req.num_computed_tokens == 61 + nxt.requests[0].num_scheduled_tokens
    # The true next position is 61 (60 tokens computed + accepted draft); it reads from
    # 61 - W + 1 on: those blocks must be real.
    return sched, table, req


def test_spec_rejection_never_nulls_needed_blocks_sliding_window():
    sched, table, req = _spec_rollback(SlidingWindowSpec(16, 1, 8, sliding_window=32))
    true_next = 61
    first_needed_block = (true_next - 32 + 1) // 16
    assert all(not b.is_null for b in table[first_needed_block:])
    for _ in range(4):
        out = sched.schedule()
        sched.update_from_output(out, fake_runner_output(out))
        lo = (req.num_computed_tokens - req.num_in_flight_tokens - 32 + 1) // 16
        assert all(not b.is_null for b in table[max(lo, 0):])


def test_spec_rejection_never_nulls_mamba_state():
    spec = MambaSpec(16, shapes=((4, 8),), num_speculative_blocks=3)
    sched, table, req = _spec_rollback(spec, enable_prefix_caching=False)
    assert len(table) == 4 and not any(b.is_null for b in table)


def test_spec_rejection_never_nulls_mamba_checkpoint_blocks():
    """With prefix caching a Mamba table is positional and its running state stays in
    place, the table's last entry (InPlaceMambaManager): a rollback to the true 61
    tokens must find it real, and so on for every processed count afterwards; pruning
    on the processed count nulls only the checkpoints below block (processed - 1) // 16."""
    spec = MambaSpec(16, shapes=((4, 8),), num_speculative_blocks=3)
    sched, table, req = _spec_rollback(spec)
    assert len(table) == 5 and not table[-1].is_null  # 63 + lookahead 3 -> 5 blocks, R last
    for _ in range(4):
        out = sched.schedule()  # prunes on the processed count
        processed = req.num_computed_tokens - req.num_in_flight_tokens
        assert not table[-1].is_null
        assert all(b.is_null for b in table[: (processed - 1) // 16])
        sched.update_from_output(out, fake_runner_output(out))


def _two_in_flight(sched_kwargs):
    sched = make_scheduler(async_scheduling=True, num_blocks=1000, **sched_kwargs)
    reqs = make_requests(2, 40, max_tokens=10)
    for r in reqs:
        sched.add_request(r)
    s1 = sched.schedule()
    s2 = sched.schedule()
    return sched, reqs, s1, s2


def test_abort_with_two_steps_in_flight_fences_blocks():
    sched, reqs, s1, s2 = _two_in_flight({})
    pool = sched.kv.pool
    held = 2 * 3  # 41 tokens each -> 3 blocks
    assert pool.num_free_blocks == 999 - held
    sched.abort_requests(["0"])
    assert "0" not in sched.requests
    assert pool.num_free_blocks == 999 - held  # fenced until both steps return
    outs1 = sched.update_from_output(s1, fake_runner_output(s1))
    assert pool.num_free_blocks == 999 - held
    outs2 = sched.update_from_output(s2, fake_runner_output(s2))
    assert pool.num_free_blocks == 999 - 3
    assert reqs[0].num_in_flight_tokens == 0
    assert [o.request_id for o in outs1 + outs2] == ["1", "1"]
    assert reqs[1].output_token_ids == [1000, 1000]


def test_preempt_with_two_steps_in_flight_fences_blocks_and_counts_outputs():
    sched, reqs, s1, s2 = _two_in_flight({})
    pool = sched.kv.pool
    victim = reqs[1]
    sched._preempt(victim)
    assert victim.num_computed_tokens == 0 and victim.num_in_flight_tokens == 41
    assert pool.num_free_blocks == 999 - 6
    sched.update_from_output(s1, fake_runner_output(s1))
    assert pool.num_free_blocks == 999 - 6
    sched.update_from_output(s2, fake_runner_output(s2))
    assert pool.num_free_blocks == 999 - 3  # the victim's 3 blocks are back
    assert victim.num_in_flight_tokens == 0 and victim.num_computed_tokens == 0
    # Outputs of steps scheduled before the preemption are delivered, counters stay reset.
    assert victim.output_token_ids == [1000, 1000]
    assert victim.num_output_placeholders == 0
    # It resumes by recomputing prompt + outputs, and finishes with exactly max_tokens.
    tokens = {r.request_id: list(r.output_token_ids) for r in reqs}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        for o in sched.update_from_output(out, fake_runner_output(out)):
            tokens[o.request_id] += o.new_token_ids
    assert all(len(r.output_token_ids) == 10 for r in reqs)
    # Every output delivered once: the resumed victim's recomputation emits nothing twice.
    assert tokens == {"0": [1000] * 10, "1": [1000] * 10}
    assert pool.num_free_blocks == 999


def test_stop_by_max_tokens_under_async_never_overgenerates():
    sched = make_scheduler(async_scheduling=True, num_blocks=1000)
    reqs = make_requests(3, 30, max_tokens=7) + make_requests(2, 50, max_tokens=1, start_id=3)
    for r in reqs:
        sched.add_request(r)
    total = 0
    pending = []
    while sched.has_unfinished_requests() or pending:
        if sched.has_unfinished_requests() and len(pending) < 2:
            out = sched.schedule()
            total += out.total_num_scheduled_tokens
            pending.append(out)
            continue
        out = pending.pop(0)
        sched.update_from_output(out, fake_runner_output(out))
    assert total == sum(r.num_prompt_tokens + r.max_tokens - 1 for r in reqs)
    assert all(len(r.output_token_ids) == r.max_tokens for r in reqs)
    assert sched.kv.pool.num_free_blocks == 999


def test_kv_cache_block_is_slotted():
    """Blocks are slotted (tens of thousands per pool): a misspelt field raises instead
    of silently adding one."""
    block = KVCacheBlock(1)
    with pytest.raises(AttributeError):
        block.refcnt = 2  # type: ignore[attr-defined]
    assert block.ref_cnt == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_blocks_filled_by_accepted_drafts_are_cached_by_the_finish(async_scheduling):
    """A verify step fills blocks before its tokens are known, so its allocation cannot
    publish them; they must be published later (before pruning, and at the finish),
    or a follow-up turn misses them. Every whole block of processed tokens ends cached."""
    spec = SlidingWindowSpec(16, 1, 8, sliding_window=16)
    sched = make_scheduler(kv_specs=[spec], async_scheduling=async_scheduling, num_speculative_tokens=3)
    (req,) = make_requests(1, 30, max_tokens=23)
    sched.add_request(req)
    queue = []
    while sched.has_unfinished_requests() or queue:
        if sched.has_unfinished_requests():
            queue.append(sched.schedule())
        if len(queue) == (2 if async_scheduling else 1) or not sched.has_unfinished_requests():
            out = queue.pop(0)
            sched.update_from_output(out, fake_runner_output(out, lambda rid: [5, 6, 7, 8]))  # all accepted
    assert req.is_finished and len(req.output_token_ids) == 23
    processed = 30 + 23 - 1
    cached = [sched.kv.pool.get_cached_block(h, 0) is not None for h in req.block_hashes]
    assert cached[: processed // 16] == [True] * (processed // 16)
