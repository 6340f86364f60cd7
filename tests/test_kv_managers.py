"""Per-attention-type managers: the skipped-token hook, pruning and prefix-hit search."""

from __future__ import annotations

import pytest

from hybridserve.core.kv.block_pool import BlockPool, KVCacheBlock
from hybridserve.core.kv.coordinator import KVCacheCoordinator
from hybridserve.core.kv.single_type_managers import (
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    make_manager,
)
from hybridserve.core.kv.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    WindowTail,
)

RID = "r"


def manager_for(spec: KVCacheSpec, num_blocks: int = 32, group_id: int = 0) -> SingleTypeKVCacheManager:
    return make_manager(spec, BlockPool(num_blocks), group_id, enable_caching=True)


def sw(window: int = 4, bs: int = 2) -> SingleTypeKVCacheManager:
    return manager_for(SlidingWindowSpec(bs, 1, 8, sliding_window=window))


def cl(chunk: int = 4, bs: int = 2) -> SingleTypeKVCacheManager:
    return manager_for(ChunkedLocalAttentionSpec(bs, 1, 8, attention_chunk_size=chunk))


def null_positions(m: SingleTypeKVCacheManager) -> list[int]:
    return [i for i, b in enumerate(m.req_to_blocks[RID]) if b.is_null]


def test_make_manager_picks_the_type() -> None:
    assert isinstance(manager_for(FullAttentionSpec(2, 1, 8)), FullAttentionManager)
    assert isinstance(sw(), SlidingWindowManager)
    assert isinstance(cl(), ChunkedLocalAttentionManager)
    assert isinstance(manager_for(MambaSpec(2, shapes=((2,),))), MambaManager)


# -- the hook and pruning ------------------------------------------------------------


@pytest.mark.parametrize(
    ("processed", "skipped", "freed"),
    [(0, 0, []), (3, 0, []), (4, 1, []), (5, 2, [0]), (6, 3, [0]), (7, 4, [0, 1]), (11, 8, [0, 1, 2, 3])],
)
def test_sliding_window_w4_block2(processed: int, skipped: int, freed: list[int]) -> None:
    m = sw(window=4, bs=2)
    assert m.get_num_skipped_tokens(processed) == skipped
    m.allocate_new_blocks(RID, 12)  # 6 blocks
    free_before = m.pool.num_free_blocks
    m.remove_skipped_blocks(RID, processed)
    assert null_positions(m) == freed
    assert m.pool.num_free_blocks == free_before + len(freed)
    assert m.num_null_blocks.get(RID, 0) == len(freed)


@pytest.mark.parametrize(("processed", "num_freed"), [(3, 0), (4, 2), (6, 2), (7, 2), (8, 4), (12, 6)])
def test_chunked_local_c4_block2(processed: int, num_freed: int) -> None:
    m = cl(chunk=4, bs=2)
    assert m.get_num_skipped_tokens(processed) == (processed // 4) * 4
    m.allocate_new_blocks(RID, 14)  # 7 blocks
    free_before = m.pool.num_free_blocks
    m.remove_skipped_blocks(RID, processed)
    assert null_positions(m) == list(range(num_freed))
    assert m.pool.num_free_blocks == free_before + num_freed


def test_pruning_again_never_double_frees() -> None:
    m = sw(window=4, bs=2)
    m.allocate_new_blocks(RID, 12)
    start = m.pool.num_free_blocks
    for processed, total_freed in [(5, 1), (5, 1), (6, 1), (7, 2), (3, 2), (0, 2), (11, 4), (11, 4), (7, 4)]:
        m.remove_skipped_blocks(RID, processed)  # would raise BlockPoolError on a double free
        assert m.pool.num_free_blocks == start + total_freed
        assert null_positions(m) == list(range(total_freed))


def test_pruning_frees_tail_first_within_the_batch() -> None:
    m = sw(window=4, bs=2)
    blocks = m.allocate_new_blocks(RID, 12)
    for i, b in enumerate(blocks[:4]):
        m.pool.cache_block(b, 1000 + i, 0)
    m.remove_skipped_blocks(RID, 11)  # frees positions 3, 2, 1, 0 in that order
    cached_order = [b.block_id for b in m.pool.free_queue if b.cache_key is not None]
    assert cached_order == [blocks[3].block_id, blocks[2].block_id, blocks[1].block_id, blocks[0].block_id]


def test_pruning_unknown_request_or_empty_table_is_a_noop() -> None:
    m = sw()
    m.remove_skipped_blocks("nobody", 100)
    assert m.pool.num_free_blocks == 31


def test_full_attention_skips_nothing() -> None:
    m = manager_for(FullAttentionSpec(2, 1, 8))
    assert m.get_num_skipped_tokens(10_000) == 0
    m.allocate_new_blocks(RID, 12)
    m.remove_skipped_blocks(RID, 10_000)
    assert null_positions(m) == [] and m.pool.num_free_blocks == 31 - 6


@pytest.mark.parametrize("num_spec", [0, 2])
def test_mamba_keeps_state_blocks_whatever_the_length(num_spec: int) -> None:
    m = manager_for(MambaSpec(2, shapes=((3, 4),), num_speculative_blocks=num_spec))
    assert m.num_required_blocks(0) == 0
    assert len(m.allocate_new_blocks(RID, 1)) == 1 + num_spec
    assert m.allocate_new_blocks(RID, 5000) == []
    m.remove_skipped_blocks(RID, 5000)
    assert len(m.req_to_blocks[RID]) == 1 + num_spec and null_positions(m) == []
    assert m.get_num_blocks_to_allocate(RID, 9000, []) == 0
    assert m.find_longest_cache_hit([1, 2, 3], 6) == []


@pytest.mark.parametrize(
    ("processed", "skipped", "freed"),
    [(0, 0, []), (2, 0, []), (3, 0, []), (4, 2, [0]), (5, 2, [0]), (6, 4, [0, 1]), (11, 8, [0, 1, 2, 3])],
)
def test_mamba_checkpoints_keep_the_processed_state_and_the_last_whole_block(processed: int, skipped: int,
                                                                             freed: list[int]) -> None:
    """Block size 2: the state after n tokens lives in block (n-1)//2, the last whole
    block's checkpoint in block n//2 - 1; everything below that goes."""
    m = manager_for(MambaSpec(2, shapes=((3, 4),), block_checkpoints=True))
    assert m.get_num_skipped_tokens(processed) == skipped
    assert len(m.allocate_new_blocks(RID, 12)) == 6  # positional: one block per 2 tokens
    m.remove_skipped_blocks(RID, processed)
    assert null_positions(m) == freed


def test_mamba_checkpoint_hit_is_the_rightmost_cached_block() -> None:
    m = manager_for(MambaSpec(2, shapes=((3, 4),), block_checkpoints=True))
    null = m.pool.null_block
    cached = cache_positions(m, [1, 2, 5])
    assert m.find_longest_cache_hit(HASHES, 16) == [null] * 5 + [cached[5]]
    assert m.find_longest_cache_hit(HASHES, 11) == [null] * 2 + [cached[2]]  # 5 blocks max: 4, 3 missing
    assert m.find_longest_cache_hit(HASHES, 3) == []  # block 0 only: not cached


def test_mamba_checkpoint_admission_cap() -> None:
    spec = MambaSpec(16, shapes=((3, 4),), block_checkpoints=True)
    # The last whole-block checkpoint + the blocks 64 tokens in flight can reach:
    # cdiv(63, 16) + 2 (P = 20: blocks 0 (S16), 1 (running, S20), 2, 3, 4, 5 for e = 84).
    assert spec.max_admission_blocks_per_request(64, 4096) == 6
    assert spec.max_admission_blocks_per_request(64, 40) == 3  # never more than max_model_len needs
    assert MambaSpec(16, shapes=((3, 4),), num_speculative_blocks=2).max_admission_blocks_per_request(64, 4096) == 3


def test_hybrid_hit_ends_at_a_mamba_checkpoint() -> None:
    """Full attention has blocks 0..5 cached, Mamba checkpoints at 2 and 4: the hit is 5
    blocks (the longest prefix both serve), Mamba giving only block 4."""
    pool = BlockPool(32)
    groups = (KVCacheGroup(FullAttentionSpec(2, 1, 8), ("a",)),
              KVCacheGroup(MambaSpec(2, shapes=((3, 4),), block_checkpoints=True), ("m",)))
    coord = KVCacheCoordinator(groups, pool, enable_caching=True)
    full, mamba = coord.managers
    cache_positions(full, [0, 1, 2, 3, 4, 5])
    ckpt = cache_positions(mamba, [2, 4])
    hits, length = coord.find_longest_cache_hit(HASHES, 15)
    assert length == 10
    assert len(hits[0]) == 5 and hits[1] == [pool.null_block] * 4 + [ckpt[4]]


def test_pop_returns_real_blocks_tail_first() -> None:
    m = sw(window=4, bs=2)
    blocks = m.allocate_new_blocks(RID, 8)
    m.remove_skipped_blocks(RID, 5)
    assert m.pop(RID) == [blocks[3], blocks[2], blocks[1]]
    assert RID not in m.req_to_blocks and RID not in m.num_null_blocks


# -- prefix-hit search per type ---------------------------------------------------------

HASHES = [100 + i for i in range(8)]


def cache_positions(m: SingleTypeKVCacheManager, positions: list[int]) -> dict[int, KVCacheBlock]:
    """Cache donor blocks for the given block positions of HASHES; return them by position."""
    blocks = m.pool.get_new_blocks(len(positions))
    out = {}
    for pos, b in zip(positions, blocks):
        m.pool.cache_block(b, HASHES[pos], m.group_id)
        out[pos] = b
    return out


def test_full_attention_hit_scans_left_to_right() -> None:
    m = manager_for(FullAttentionSpec(2, 1, 8))
    cached = cache_positions(m, [0, 1, 3, 4])
    assert m.find_longest_cache_hit(HASHES, 16) == [cached[0], cached[1]]
    assert m.find_longest_cache_hit(HASHES, 3) == [cached[0]]  # max_length caps whole blocks
    assert m.find_longest_cache_hit(HASHES[2:], 16) == []  # block 2 missing: nothing


def test_full_attention_hit_is_per_group() -> None:
    pool = BlockPool(8)
    m0 = make_manager(FullAttentionSpec(2, 1, 8), pool, 0, True)
    m1 = make_manager(FullAttentionSpec(2, 1, 8), pool, 1, True)
    cache_positions(m0, [0, 1])
    assert len(m0.find_longest_cache_hit(HASHES, 16)) == 2
    assert m1.find_longest_cache_hit(HASHES, 16) == []


def test_sliding_window_hit_scans_right_to_left_with_null_padding() -> None:
    m = sw(window=5, bs=2)  # needs cdiv(4, 2) = 2 contiguous blocks
    cached = cache_positions(m, [2, 3, 5, 7])
    null = m.pool.null_block
    # 7 alone, 6 missing, 5 alone, 4 missing, then 3 and 2: a run of 2 ending at block 3.
    assert m.find_longest_cache_hit(HASHES, 16) == [null, null, cached[2], cached[3]]
    # max_length shorter than the run's end: the run is cut at the limit.
    assert m.find_longest_cache_hit(HASHES, 7) == []  # blocks 0..2: only 2 cached, 0-1 missing
    assert m.find_longest_cache_hit(HASHES, 8) == [null, null, cached[2], cached[3]]


def test_sliding_window_hit_short_run_from_position_zero() -> None:
    m = sw(window=9, bs=2)  # needs 4 blocks, but a prefix shorter than W needs no padding
    cached = cache_positions(m, [0, 1])
    assert m.find_longest_cache_hit(HASHES, 16) == [cached[0], cached[1]]


def test_sliding_window_of_one_needs_no_blocks() -> None:
    m = sw(window=1, bs=2)
    assert m.find_longest_cache_hit(HASHES, 8) == [m.pool.null_block] * 4


def test_chunked_local_hit_nulls_whole_chunks_then_scans() -> None:
    m = cl(chunk=4, bs=2)
    null = m.pool.null_block
    cached = cache_positions(m, [4, 5, 6])
    # max_length 13 -> block limit 6; the chunk holding 13 starts at 12 -> blocks 0..5 null.
    assert m.find_longest_cache_hit(HASHES, 13) == [null] * 6
    # max_length 11 -> 5 blocks; chunk start 8 -> blocks 0..3 null, then block 4 cached.
    assert m.find_longest_cache_hit(HASHES, 11) == [null] * 4 + [cached[4]]
    # max_length 15 -> 7 blocks; chunk start 12 -> blocks 0..5 null, block 6 cached.
    assert m.find_longest_cache_hit(HASHES, 15) == [null] * 6 + [cached[6]]


def test_get_num_blocks_to_allocate_counts_free_hits() -> None:
    m = sw(window=5, bs=2)
    cached = cache_positions(m, [2, 3])
    m.pool.free_blocks([cached[3]])  # block at position 3 is free but cached; position 2 shared
    hit = m.find_longest_cache_hit(HASHES, 8)
    # 6 blocks for 12 tokens; 4 come from the hit; the free hit block leaves the queue too.
    assert m.get_num_blocks_to_allocate(RID, 12, hit) == 2 + 1
    m.pool.touch(hit)
    m.save_new_computed_blocks(RID, hit)
    assert m.num_null_blocks[RID] == 2
    assert len(m.allocate_new_blocks(RID, 12)) == 2
    assert [b.is_null for b in m.req_to_blocks[RID]] == [True, True, False, False, False, False]


def sparse_mamba(interval: int, drafts: int = 0, keep: bool = True) -> MambaSpec:
    return MambaSpec(16, shapes=((3, 4),), block_checkpoints=True, num_pages=2, in_flight=WindowTail(2, drafts),
                     checkpoint_interval=interval, keep_last_checkpoint=keep)


@pytest.mark.parametrize(("interval", "drafts", "nulls"), [
    (4, 0, [0, 1, 2, 4, 5]),  # the period keeps block 3 (S64), the tail block 6 (S100 running)
    (0, 0, [0, 1, 2, 3, 4, 5]),  # no period: the tail only
    (0, 8, [0, 1, 2, 3, 4]),  # tail = slots 99 - 16 .. 99: blocks 5, 6
    (1, 0, []),  # interval 1: every block, the dense layout
])
def test_sparse_mamba_checkpoints_are_real_only_on_the_period_and_in_the_tail(interval, drafts, nulls) -> None:
    m = manager_for(sparse_mamba(interval, drafts))
    assert m.get_num_blocks_to_allocate(RID, 100, []) == 7 - len(nulls)
    m.allocate_new_blocks(RID, 100)
    assert null_positions(m) == nulls and m.num_real_blocks[RID] == 7 - len(nulls)


def test_sparse_mamba_reads_after_a_load_from_its_own_real_block() -> None:
    """A chunk starting at 96 (after a KV-connector load): block 5 (S96) is what it reads."""
    m = manager_for(sparse_mamba(0))
    m.allocate_new_blocks(RID, 140, chunk_start=96)
    assert null_positions(m) == [0, 1, 2, 3, 4, 6, 7] and m.num_real_blocks[RID] == 2  # blocks 5 and 8


@pytest.mark.parametrize(("processed", "keep", "freed"), [(100, True, [0, 1, 2, 3, 4]), (100, False, [0, 1, 2, 3, 4, 5])])
def test_sparse_mamba_without_a_connector_holds_only_the_running_state(processed, keep, freed) -> None:
    # Interval 2: blocks 1, 3, 5 on the period, 6 the tail. Processed 100: the running
    # state is in block 6; the last whole checkpoint (S96) in block 5.
    m = manager_for(sparse_mamba(2, keep=keep))
    m.allocate_new_blocks(RID, 112)
    m.remove_skipped_blocks(RID, processed)
    assert [i for i in range(7) if m.req_to_blocks[RID][i].is_null] == freed


def test_sparse_mamba_admission_cap() -> None:
    # B = 1024 in flight, bs 16, k = 2 steps, d drafts, interval K:
    #   dense = touch(1024) + 1 = 1 + cdiv(1023, 16) + 1 = 66
    #   sparse = (1 + keep) + k * touch(1 + 2d) + cdiv(touch(1024 + d), K)
    assert sparse_mamba(4).max_admission_blocks_per_request(1024, 8192) == 2 + 2 * 1 + 17  # touch(1024) = 65
    assert sparse_mamba(4, keep=False).max_admission_blocks_per_request(1024, 8192) == 1 + 2 * 1 + 17
    assert sparse_mamba(0).max_admission_blocks_per_request(1024, 8192) == 2 + 2 * 1
    assert sparse_mamba(0, drafts=8).max_admission_blocks_per_request(1024, 8192) == 2 + 2 * 2  # touch(17) = 2
    assert sparse_mamba(1).max_admission_blocks_per_request(1024, 8192) == 66  # dense
    assert sparse_mamba(4).max_admission_blocks_per_request(64, 8192) == 6  # dense is smaller: touch(64) + 1
