"""KVCacheManager: processed-basis pruning, admission, fenced frees, startup sizing.

Counters (`num_computed_tokens`, `num_in_flight_tokens`) are set by hand the way the
scheduler moves them, so each test pins one rule of the manager, not the scheduler.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import pytest

from hybridserve.core.errors import ConfigError
from hybridserve.core.kv.cache_manager import KVCacheManager
from hybridserve.core.kv.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    WindowTail,
    cdiv,
)
from hybridserve.core.request import Request, SamplingParams
from hybridserve.testing import make_kv_cache_config


def full(bs: int = 4) -> FullAttentionSpec:
    return FullAttentionSpec(bs, 1, 8)


def sw(window: int, bs: int = 4) -> SlidingWindowSpec:
    return SlidingWindowSpec(bs, 1, 8, sliding_window=window)


def cl(chunk: int, bs: int = 4) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(bs, 1, 8, attention_chunk_size=chunk)


def make_kv(
    specs: list[KVCacheSpec], num_blocks: int, max_model_len: int = 64, max_in_flight: int = 8, **kw: object
) -> KVCacheManager:
    config = make_kv_cache_config(num_blocks, specs, specs[0].block_size)
    return KVCacheManager(config, max_model_len=max_model_len, max_in_flight_tokens=max_in_flight, **kw)  # type: ignore[arg-type]


def make_req(kv: KVCacheManager, rid: str, num_tokens: int, max_tokens: int = 16, **kw: object) -> Request:
    r = Request(rid, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=max_tokens), **kw)  # type: ignore[arg-type]
    kv.init_request(r)
    return r


def real_blocks(kv: KVCacheManager, rid: str) -> list[int]:
    return [sum(1 for b in ids if b != 0) for ids in kv.get_block_ids(rid)]


# -- startup sizing -------------------------------------------------------------------


def test_startup_check_names_the_smallest_pool() -> None:
    specs: list[KVCacheSpec] = [full(), sw(8), cl(8)]
    # full cdiv(64,4)=16; sliding cdiv(7+8,4)+1=5; chunked cdiv(8+8,4)=4; + null block.
    with pytest.raises(ConfigError, match="need at least 26"):
        make_kv(specs, num_blocks=25)
    kv = make_kv(specs, num_blocks=26)
    assert kv.pool.num_free_blocks == 25


def drive_to_max_len(
    kv: KVCacheManager, prompt_len: int, chunk: int, steps_in_flight: int, check: Callable[[Request], None]
) -> None:
    """Schedule one request to max_model_len like an async scheduler: chunked prefill,
    then 1-token decode, at most `steps_in_flight` steps outstanding."""
    r = make_req(kv, "d", prompt_len, max_tokens=kv.max_model_len)
    outstanding: deque[int] = deque()
    while r.num_computed_tokens < kv.max_model_len:
        if len(outstanding) == steps_in_flight:
            r.num_in_flight_tokens -= outstanding.popleft()
            if r.num_processed_tokens >= r.num_prompt_tokens:
                r.append_output_token_ids([7] * (r.num_processed_tokens + 1 - r.num_tokens))
            kv.remove_skipped_blocks(r.request_id, r.num_processed_tokens)
        left = r.num_prompt_tokens - r.num_computed_tokens
        n = min(chunk if left > 0 else 1, max(left, 1), kv.max_model_len - r.num_computed_tokens)
        assert kv.allocate_slots(r, n) is not None, f"allocation failed at {r.num_computed_tokens} tokens"
        r.num_computed_tokens += n
        r.num_in_flight_tokens += n
        outstanding.append(n)
        check(r)


@pytest.mark.parametrize(
    ("specs", "chunk"),
    [
        ([full(), sw(8)], 4),
        ([full(), sw(7)], 4),  # window start never block aligned
        ([full(), sw(3), sw(13)], 4),
        ([full(), cl(8)], 4),
        ([full(), sw(5), cl(16)], 3),
        ([sw(6), cl(4)], 4),
    ],
)
def test_smallest_pool_serves_one_max_len_request(specs: list[KVCacheSpec], chunk: int) -> None:
    """A pool of exactly min_num_blocks never refuses, and no group exceeds its cap."""
    max_in_flight = 2 * chunk  # async scheduling on one stage: 2 batches in flight
    probe = make_kv_cache_config(2, specs, 4)
    kv = make_kv(specs, probe.min_num_blocks(max_in_flight, 64), max_in_flight=max_in_flight)
    caps = [s.max_admission_blocks_per_request(max_in_flight, 64) for s in specs]

    def check(r: Request) -> None:
        held = real_blocks(kv, r.request_id)
        assert all(h <= c for h, c in zip(held, caps)), (held, caps, r.num_computed_tokens)

    drive_to_max_len(kv, prompt_len=30, chunk=chunk, steps_in_flight=2, check=check)


def test_misaligned_chunk_is_rejected() -> None:
    """A chunk that is not a multiple of the block size is refused: a chunk boundary
    inside a block would leave that block live for two chunks, past the admission cap
    (chunk 6, block 4: processed 11, tokens 11-12 in flight, chunk [6, 12) starts inside
    block 1, so blocks 1-2 stay live and block 3 holds token 12: 3 blocks > cdiv(6+2, 4) = 2)."""
    with pytest.raises(ConfigError, match="6"):
        cl(6, bs=4)
    with pytest.raises(ConfigError):
        cl(2, bs=4)  # smaller than a block
    with pytest.raises(ConfigError):
        cl(0, bs=4)
    assert cl(8, bs=4).attention_chunk_size == 8  # a multiple is accepted


# -- the processed basis ------------------------------------------------------------


@pytest.mark.parametrize(
    ("computed", "in_flight", "unsafe", "nulls"),
    [
        (12, 12, False, 0),  # prefill in flight: nothing processed
        (13, 1, False, 4),  # basis 12 -> skipped 9 -> blocks 0..3
        (13, 5, False, 2),  # basis 8 -> skipped 5 -> blocks 0..1
        (13, 5, True, 5),  # optimistic 13 -> skipped 10 -> blocks 0..4
        (13, 12, True, 5),
        (3, 12, False, 0),  # more in flight than computed: basis clamps at 0
    ],
)
def test_allocate_prunes_on_processed_basis(computed: int, in_flight: int, unsafe: bool, nulls: int) -> None:
    kv = make_kv([sw(4, bs=2)], num_blocks=40, max_in_flight=16, unsafe_optimistic_free=unsafe)
    r = make_req(kv, "a", 12)
    assert kv.allocate_slots(r, 12) is not None  # 6 blocks
    r.num_computed_tokens, r.num_in_flight_tokens = computed, in_flight
    free_before = kv.pool.num_free_blocks
    assert kv.allocate_slots(r, 1) is not None
    ids = kv.get_block_ids("a")[0]
    assert ids[:nulls] == [0] * nulls and 0 not in ids[nulls:]
    assert kv.get_num_null_blocks("a") == (nulls,)
    new = max(0, cdiv(computed + 1, 2) - 6)
    assert kv.pool.num_free_blocks == free_before + nulls - new


def test_allocation_that_fits_only_after_pruning_succeeds() -> None:
    # sliding cap cdiv(3 + 2, 2) + 1 = 4 -> pool of 5 (4 usable).
    kv = make_kv([sw(4, bs=2)], num_blocks=5, max_model_len=32, max_in_flight=2)
    r = make_req(kv, "a", 8)
    assert kv.allocate_slots(r, 8) is not None
    assert kv.pool.num_free_blocks == 0
    r.num_computed_tokens = 8
    r.num_in_flight_tokens = 0  # prefill processed: blocks 0,1 are out of the window
    new = kv.allocate_slots(r, 1)
    assert new is not None and len(new[0]) == 1
    assert kv.get_block_ids("a")[0][:2] == [0, 0] and kv.pool.num_free_blocks == 1


def test_in_flight_prefill_blocks_pruning_and_none_changes_nothing() -> None:
    kv = make_kv([sw(4, bs=2)], num_blocks=5, max_model_len=32, max_in_flight=2)
    r = make_req(kv, "a", 8)
    kv.allocate_slots(r, 8)
    ids_before = kv.get_block_ids("a")
    refs_before = [b.ref_cnt for b in kv.pool.blocks]
    r.num_computed_tokens = r.num_in_flight_tokens = 8  # still in flight: nothing may go
    assert kv.allocate_slots(r, 1) is None
    assert kv.get_block_ids("a") == ids_before
    assert [b.ref_cnt for b in kv.pool.blocks] == refs_before and kv.pool.num_free_blocks == 0


def test_null_count_is_current_after_a_refused_allocation() -> None:
    kv = make_kv([sw(4, bs=2)], num_blocks=5, max_model_len=32, max_in_flight=2)
    r = make_req(kv, "a", 8)
    kv.allocate_slots(r, 8)
    r.num_computed_tokens = 8  # processed: blocks 0,1 leave the window
    assert kv.allocate_slots(r, 1, num_lookahead_tokens=8) is None  # pruned 2, still short
    assert kv.get_block_ids("a")[0][:2] == [0, 0]
    assert kv.get_num_null_blocks("a") == (2,)


def test_unsafe_optimistic_free_prunes_in_flight_blocks() -> None:
    kv = make_kv([sw(4, bs=2)], num_blocks=5, max_model_len=32, max_in_flight=2, unsafe_optimistic_free=True)
    r = make_req(kv, "a", 8)
    kv.allocate_slots(r, 8)
    r.num_computed_tokens = r.num_in_flight_tokens = 8
    assert kv.allocate_slots(r, 1) is not None
    assert kv.get_block_ids("a")[0][:2] == [0, 0]


@pytest.mark.parametrize("unsafe", [False, True])
def test_in_flight_steps_keep_their_window(unsafe: bool) -> None:
    """Every block a step reads stays in the table until that step is processed.

    The optimistic basis breaks this (and the test sees it), the processed basis never does.
    """
    window, bs = 5, 2
    kv = make_kv([full(bs), sw(window, bs)], num_blocks=80, max_in_flight=8, unsafe_optimistic_free=unsafe)
    r = make_req(kv, "a", 9, max_tokens=40)
    outstanding: deque[tuple[int, dict[int, int]]] = deque()  # (tokens, block position -> id)
    violations = 0
    for _ in range(30):
        if len(outstanding) == 2:
            n, _reads = outstanding.popleft()
            r.num_in_flight_tokens -= n
            if r.num_processed_tokens >= r.num_prompt_tokens:
                r.append_output_token_ids([5])
        start = r.num_computed_tokens
        n = 4 if start < r.num_prompt_tokens else 1
        n = min(n, max(1, r.num_prompt_tokens - start))
        assert kv.allocate_slots(r, n) is not None
        table = kv.get_block_ids("a")[1]
        for _, reads in outstanding:
            violations += sum(1 for pos, bid in reads.items() if table[pos] != bid)
        reads = {
            p: table[p] for t in range(start, start + n) for p in range(max(0, t - window + 1) // bs, t // bs + 1)
        }
        assert 0 not in reads.values()
        r.num_computed_tokens += n
        r.num_in_flight_tokens += n
        outstanding.append((n, reads))
    assert (violations > 0) == unsafe


# -- full_sequence_must_fit ----------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "peak"),
    [
        (20, 20, 10 + 5 + 4),  # N=40: full 10, sliding min(10, 5), chunked min(10, 4)
        (8, 4, 3 + 3 + 3),  # N=12: below every cap
        (20, 1000, 16 + 5 + 4),  # N clipped to max_model_len=64
    ],
)
def test_full_sequence_must_fit_charges_capped_peak(prompt: int, max_tokens: int, peak: int) -> None:
    specs: list[KVCacheSpec] = [full(), sw(8), cl(8)]  # caps 16, 5, 4 at in-flight 8
    for spare, fits in [(0, True), (-1, False)]:
        kv = make_kv(specs, num_blocks=30)
        kv.pool.get_new_blocks(29 - peak - spare)  # leave exactly peak + spare free
        r = make_req(kv, "a", prompt, max_tokens=max_tokens)
        free = kv.pool.num_free_blocks
        got = kv.allocate_slots(r, min(prompt, 8), full_sequence_must_fit=True)
        assert (got is not None) == fits
        if not fits:
            assert kv.pool.num_free_blocks == free and not kv.holds_blocks("a")
            assert kv.allocate_slots(r, min(prompt, 8)) is not None  # the chunk alone fits


# -- fenced frees --------------------------------------------------------------------


def test_fenced_free_waits_for_its_step() -> None:
    kv = make_kv([full()], num_blocks=20)
    a, b, c = (make_req(kv, x, 8) for x in "abc")
    for r in (a, b, c):
        kv.allocate_slots(r, 8)
    assert kv.pool.num_free_blocks == 13
    kv.free(a, fence_step=3)
    kv.free(b, fence_step=4)
    assert kv.get_block_ids("a") == ([],) and not kv.holds_blocks("a")
    assert kv.pool.num_free_blocks == 13
    kv.step_processed(2)
    assert kv.pool.num_free_blocks == 13
    kv.step_processed(3)
    assert kv.pool.num_free_blocks == 15
    kv.step_processed(4)
    assert kv.pool.num_free_blocks == 17
    kv.free(c, fence_step=4)  # that step is already processed: free at once
    assert kv.pool.num_free_blocks == 19 and not kv.fenced
    kv.free(c)  # unknown / already freed request: no-op
    assert kv.pool.num_free_blocks == 19


def test_unfenced_free_is_immediate_and_tail_first() -> None:
    kv = make_kv([full()], num_blocks=20)
    r = make_req(kv, "a", 12)
    kv.allocate_slots(r, 12)
    ids = kv.get_block_ids("a")[0]
    kv.free(r)
    assert [b.block_id for b in kv.pool.free_queue][-3:] == ids[::-1]  # cached: back, tail first


def test_fences_issued_out_of_order_release_on_their_step() -> None:
    """With PP > 2 a request last scheduled at an older step can be freed second."""
    kv = make_kv([full()], num_blocks=20)
    a, b = make_req(kv, "a", 8), make_req(kv, "b", 8)
    kv.allocate_slots(a, 8)
    kv.allocate_slots(b, 8)
    kv.free(a, fence_step=5)
    kv.free(b, fence_step=3)
    kv.step_processed(3)
    assert kv.pool.num_free_blocks == 17
    kv.step_processed(5)
    assert kv.pool.num_free_blocks == 19


# -- prefix hits through the manager ---------------------------------------------------


def hybrid_kv(num_blocks: int = 64, **kw: bool) -> KVCacheManager:
    # 1 full + 2 sliding groups: W=8 needs 2 cached blocks, W=4 needs 1 (bs=4).
    return make_kv([full(), sw(8), sw(4)], num_blocks=num_blocks, **kw)


def test_hybrid_hit_after_request_finished() -> None:
    kv = hybrid_kv()
    a = make_req(kv, "a", 33)
    kv.allocate_slots(a, 33)
    a_ids = kv.get_block_ids("a")
    kv.free(a)
    b = Request("b", a.prompt_token_ids[:32] + [999])
    kv.init_request(b)
    hits, length = kv.get_computed_blocks(b)
    assert length == 32
    assert [x.block_id for x in hits[0]] == a_ids[0][:8]
    assert [x.block_id for x in hits[1]] == [0] * 6 + a_ids[1][6:8]
    assert [x.block_id for x in hits[2]] == [0] * 7 + a_ids[2][7:8]
    free = kv.pool.num_free_blocks
    assert kv.allocate_slots(b, 1, num_new_computed_tokens=32, new_computed_blocks=hits) is not None
    # 8 + 2 + 1 cached free blocks leave the queue, plus 1 new block per group.
    assert kv.pool.num_free_blocks == free - 11 - 3
    assert kv.get_num_null_blocks("b") == (0, 6, 7)


def test_hit_always_leaves_the_last_prompt_token() -> None:
    kv = hybrid_kv()
    a = make_req(kv, "a", 32)
    kv.allocate_slots(a, 32)
    b = make_req(kv, "b", 32)  # same 32 tokens
    assert kv.get_computed_blocks(b)[1] == 28


def test_coordinator_shrinks_until_every_group_agrees() -> None:
    kv = hybrid_kv()
    d = make_req(kv, "d", 33)
    kv.allocate_slots(d, 33, delay_cache_blocks=True)
    assert not kv.pool.cached
    d_ids = kv.get_block_ids("d")
    cached = {0: range(8), 1: [1, 2, 4, 5, 7], 2: [2, 7]}
    for g, positions in cached.items():
        table = kv.coordinator.managers[g].req_to_blocks["d"]
        for p in positions:
            kv.pool.cache_block(table[p], d.block_hashes[p], g)
    b = make_req(kv, "b", 33)
    hits, length = kv.get_computed_blocks(b)
    # 32 (full) -> 24 (W=8 run 4-5) -> 12 (W=4 finds block 2) -> 12 (W=8 run 1-2): fixed point.
    assert length == 12
    assert [x.block_id for x in hits[0]] == d_ids[0][:3]
    assert [x.block_id for x in hits[1]] == [0, d_ids[1][1], d_ids[1][2]]
    assert [x.block_id for x in hits[2]] == [0, 0, d_ids[2][2]]


def test_load_past_a_mamba_hit_drops_the_superseded_checkpoint() -> None:
    """A connector load past a prefix hit: the first computed token (12) starts from the
    load's state (column 2), so the hit's checkpoint (column 1, the state after 8) is never
    read and the request must not hold it beside the loaded block: one block, the cap. (The
    random workloads found the request holding both, 2 real blocks against a cap of 1.)"""
    mamba = MambaSpec(4, shapes=((4, 4),))
    kv = make_kv([full(), mamba], num_blocks=64, in_flight=WindowTail(1), keep_last_checkpoint=True)
    assert kv.caps[1] == 1
    a = make_req(kv, "a", 13)
    assert kv.allocate_slots(a, 13) is not None  # columns 0..2 checkpoints (blocks to spare), 3 running
    a.num_computed_tokens = 13
    kv.cache_blocks(a, 13, final=True)
    a_ids = kv.get_block_ids("a")
    kv.free(a)
    b = Request("b", a.prompt_token_ids[:12] + [999])
    kv.init_request(b)
    hits, length = kv.coordinator.find_longest_cache_hit(b.block_hashes, 8)  # the device holds 8; the host 12
    assert length == 8
    assert [x.block_id for x in hits[1]] == [0, a_ids[1][1]]
    free = kv.pool.num_free_blocks
    assert kv.allocate_slots(b, 0, num_new_computed_tokens=8, new_computed_blocks=hits,
                             num_external_computed_tokens=4, delay_cache_blocks=True) is not None
    table = kv.get_block_ids("b")
    assert table[0][:2] == a_ids[0][:2] and table[0][2] not in a_ids[0]
    assert table[1][:2] == [0, 0] and table[1][2] != 0  # the load fills column 2
    assert real_blocks(kv, "b") == [3, 1]
    assert hits[1][1].ref_cnt == 0  # still only cached, in the free queue
    # Two full-attention hits leave the queue, plus one new block per group.
    assert kv.pool.num_free_blocks == free - 2 - 2


def test_load_past_a_sliding_hit_holds_only_the_loaded_window() -> None:
    """W=4, bs 4: a hit of 8 tokens holds block 1; a load to 16 starts at token 16, whose
    window (13..16) begins in block 3, so the hit's block 1 is not held."""
    kv = make_kv([full(), sw(4)], num_blocks=64)
    a = make_req(kv, "a", 17)
    kv.allocate_slots(a, 17)
    a_ids = kv.get_block_ids("a")
    kv.free(a)
    b = Request("b", a.prompt_token_ids[:16] + [999])
    kv.init_request(b)
    hits, length = kv.coordinator.find_longest_cache_hit(b.block_hashes, 8)
    assert length == 8 and [x.block_id for x in hits[1]] == [0, a_ids[1][1]]
    assert kv.allocate_slots(b, 0, num_new_computed_tokens=8, new_computed_blocks=hits,
                             num_external_computed_tokens=8, delay_cache_blocks=True) is not None
    assert kv.get_block_ids("b")[1][:3] == [0, 0, 0]
    assert real_blocks(kv, "b") == [4, 1]
    assert kv.get_num_null_blocks("b") == (0, 3)


def test_failed_allocation_leaves_hit_ref_counts_untouched() -> None:
    kv = hybrid_kv(num_blocks=26)  # the smallest pool: 25 usable
    a = make_req(kv, "a", 17)
    kv.allocate_slots(a, 17)  # 5 blocks per group
    b = Request("b", a.prompt_token_ids[:16] + [999])
    kv.init_request(b)
    for a_running in (True, False):
        if not a_running:
            kv.free(a)
        hits, length = kv.get_computed_blocks(b)
        assert length == 16
        hit_blocks = [x for g in hits for x in g if not x.is_null]
        refs = [x.ref_cnt for x in hit_blocks]
        assert refs == [1 if a_running else 0] * len(hit_blocks)
        free = kv.pool.num_free_blocks
        assert kv.allocate_slots(b, 41, num_new_computed_tokens=16, new_computed_blocks=hits) is None
        assert [x.ref_cnt for x in hit_blocks] == refs
        assert kv.pool.num_free_blocks == free and not kv.holds_blocks("b")
        assert all(kv.pool.get_cached_block(x.cache_key[0], x.cache_key[1]) is not None for x in hit_blocks)  # type: ignore[index]


def test_cache_salt_separates_prefixes() -> None:
    kv = make_kv([full()], num_blocks=40)
    owner = make_req(kv, "a", 9, cache_salt="tenant-1")
    kv.allocate_slots(owner, 9)
    for rid, salt, expected in [("b", "tenant-2", 0), ("c", None, 0), ("d", "tenant-1", 8)]:
        r = make_req(kv, rid, 9, cache_salt=salt)
        assert kv.get_computed_blocks(r)[1] == expected, salt


def test_caching_disabled_finds_and_stores_nothing() -> None:
    kv = make_kv([full(), sw(8)], num_blocks=40, enable_caching=False)
    a = make_req(kv, "a", 17)
    assert a.block_hashes == []
    kv.allocate_slots(a, 17)
    b = make_req(kv, "b", 17)
    assert kv.get_computed_blocks(b) == ([[], []], 0) and not kv.pool.cached


def test_delayed_caching_then_cache_blocks() -> None:
    kv = make_kv([full(), sw(8)], num_blocks=40)
    a = make_req(kv, "a", 10)
    kv.allocate_slots(a, 10, delay_cache_blocks=True)
    assert not kv.pool.cached
    kv.cache_blocks(a, 8)
    assert len(kv.pool.cached) == 4  # 2 full blocks x 2 groups
    assert kv.get_computed_blocks(make_req(kv, "b", 10))[1] == 8


def test_lookahead_and_usage() -> None:
    kv = make_kv([full()], num_blocks=21)
    r = make_req(kv, "a", 5)
    new = kv.allocate_slots(r, 5, num_lookahead_tokens=3)  # 8 slots -> 2 blocks
    assert new is not None and len(new[0]) == 2
    assert kv.usage == pytest.approx(0.1)
    assert kv.group_usage() == [pytest.approx(0.1)]
