"""Per-attention-type managers: the skipped-token hook, pruning and prefix-hit search."""

from __future__ import annotations

import pytest

from hybridserve.core.kv.block_pool import BlockPool, KVCacheBlock
from hybridserve.core.kv.coordinator import KVCacheCoordinator
from hybridserve.core.kv.single_type_managers import (
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    InPlaceMambaManager,
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


def in_place(spare: int, keep: bool = False, num_blocks: int = 32) -> InPlaceMambaManager:
    spec = MambaSpec(16, shapes=((3, 4),), block_checkpoints=True, running_in_place=True, keep_last_checkpoint=keep)
    m = manager_for(spec, num_blocks)
    assert isinstance(m, InPlaceMambaManager)
    m.budget.columns = spare
    return m


def ids(m: SingleTypeKVCacheManager) -> list[int]:
    return [b.block_id for b in m.req_to_blocks[RID]]


def test_in_place_mamba_first_chunk_takes_only_the_running_block_as_required() -> None:
    """Chunk 0..99 (bs 16): 7 columns, R last; columns 0..5 want checkpoints. With 2
    to spare, columns 0 and 1 get them (in order), 2..5 the null block."""
    m = in_place(spare=2)
    assert m.get_num_blocks_to_allocate(RID, 100, []) == 1  # R only
    new = m.allocate_new_blocks(RID, 100)
    assert [b.is_null for b in new] == [False, False, True, True, True, True, False]
    assert m.num_real_blocks[RID] == 3 and m.num_null_blocks[RID] == 0


def test_in_place_mamba_running_block_moves_to_the_new_last_entry() -> None:
    """Chunk 0..19 then 20..52: R (block 2 of the pool) moves from column 1 to column 3;
    the delta is the entries inserted before it: column 1 (S32) and 2 (S48), the first
    with a checkpoint block, the second null (1 to spare). Nothing is required."""
    m = in_place(spare=8)
    m.allocate_new_blocks(RID, 20)  # [X16, R]
    running = m.req_to_blocks[RID][-1]
    m.budget.columns = 1
    assert m.get_num_blocks_to_allocate(RID, 53, [], chunk_start=20) == 0
    delta = m.allocate_new_blocks(RID, 53, chunk_start=20)
    assert len(delta) == 2 and not delta[0].is_null and delta[1].is_null
    assert m.req_to_blocks[RID][1:] == [delta[0], delta[1], running] and m.num_real_blocks[RID] == 3
    assert m.allocate_new_blocks(RID, 60, chunk_start=53) == []  # same last column: nothing moves


def test_in_place_mamba_after_a_hit_or_a_load() -> None:
    """A hit at column 3 (S64): the first chunk 64..99 needs R only (the hit is its
    source). A connector load to 64 (no hit): the source column 3 is required too, and
    columns 0..2 are below the skip boundary (null); a load-only allocation (no tokens
    computed yet) takes the source alone, R comes with the first chunk."""
    m = in_place(spare=0)
    hit = [m.pool.null_block] * 3 + m.pool.get_new_blocks(1)
    assert m.get_num_blocks_to_allocate(RID, 100, hit, chunk_start=64) == 1
    m.save_new_computed_blocks(RID, hit)
    m.allocate_new_blocks(RID, 100, chunk_start=64)
    assert [b.is_null for b in m.req_to_blocks[RID]] == [True, True, True, False, True, True, False]
    load = in_place(spare=5)
    assert load.get_num_blocks_to_allocate(RID, 64, [], chunk_start=64) == 1  # the source, no R yet
    load.allocate_new_blocks(RID, 64, chunk_start=64)
    assert [b.is_null for b in load.req_to_blocks[RID]] == [True, True, True, False] and RID not in load.running
    assert load.get_num_blocks_to_allocate(RID, 100, [], chunk_start=64) == 1  # R
    load.allocate_new_blocks(RID, 100, chunk_start=64)
    assert [b.is_null for b in load.req_to_blocks[RID]] == [True, True, True, False, False, False, False]


@pytest.mark.parametrize(("processed", "keep", "freed"), [
    (64, False, [0, 1, 2]), (65, False, [0, 1, 2, 3]), (100, False, [0, 1, 2, 3, 4, 5]),
    (65, True, [0, 1, 2]), (100, True, [0, 1, 2, 3, 4]),
])
def test_in_place_mamba_prunes_checkpoints_once_their_boundary_is_processed(processed, keep, freed) -> None:
    """Checkpoint column c is written by the step that reaches boundary (c+1)*16, so it
    is published and freed once processed > (c+1)*16; a connector keeps the last whole
    one (column processed//16 - 1). R (column 7 of 120 tokens) is never freed."""
    m = in_place(spare=10, keep=keep)
    m.allocate_new_blocks(RID, 120)
    m.remove_skipped_blocks(RID, processed)
    assert null_positions(m) == freed and not m.req_to_blocks[RID][-1].is_null


def test_in_place_mamba_publishes_only_checkpoints_whose_writer_is_processed() -> None:
    from hybridserve.core.request import Request, SamplingParams

    m = in_place(spare=10)
    req = Request(RID, list(range(120)), SamplingParams(max_tokens=1))
    req.block_hashes = [bytes([i]) for i in range(7)]
    m.allocate_new_blocks(RID, 120)
    m.cache_blocks(req, 120, 64)  # boundary 64 reached, its checkpoint not yet past
    assert [b.cache_key is not None for b in m.req_to_blocks[RID][:4]] == [True, True, True, False]
    m.cache_blocks(req, 120, 65)
    assert m.req_to_blocks[RID][3].cache_key is not None
    m.cache_blocks(req, 120, 112)  # R sits at column 7 (boundary 128): never published while running
    assert m.req_to_blocks[RID][-1].cache_key is None
    m.cache_final(req, 112)  # at a finish the block at the last processed boundary is settled
    assert m.req_to_blocks[RID][6].cache_key is not None


def test_in_place_mamba_admission_cap_is_one() -> None:
    spec = MambaSpec(16, shapes=((3, 4),), block_checkpoints=True, running_in_place=True)
    assert spec.max_admission_blocks_per_request(1024, 8192) == 1
    assert spec.max_admission_blocks_per_request(64, 40) == 1


@pytest.mark.parametrize("keep", [False, True])
def test_in_place_mamba_next_free_basis_agrees_with_the_general_search(keep: bool) -> None:
    """The closed form (mark m = null prefix + 1: m*16 + 1 tokens, or (m + 1)*16 when the
    last whole checkpoint is kept) against the base class's doubling-bisecting search."""
    m = in_place(spare=10, keep=keep)
    m.allocate_new_blocks(RID, 200)
    for processed in (0, 1, 17, 32, 33, 64, 100, 150):
        m.remove_skipped_blocks(RID, processed)
        assert m.next_free_basis(RID) == SingleTypeKVCacheManager.next_free_basis(m, RID)
