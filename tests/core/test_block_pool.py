"""BlockPool and FreeBlockQueue: the null block, errors, free-queue order, prefix-cache map."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.core.errors import BlockPoolError, ConfigError, OutOfBlocksError
from hybridserve.core.kv.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


# -- the null block ---------------------------------------------------------------


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(6)
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert free_ids(pool) == [1, 2, 3, 4, 5]
    assert pool.num_free_blocks == 5
    got = pool.get_new_blocks(5)
    assert [b.block_id for b in got] == [1, 2, 3, 4, 5]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.null_block.ref_cnt == 0
    with pytest.raises(OutOfBlocksError):
        pool.get_new_blocks(1)


def test_null_block_cannot_be_freed_cached_or_referenced() -> None:
    pool = BlockPool(4)
    with pytest.raises(BlockPoolError, match="null"):
        pool.free_blocks([pool.null_block])
    with pytest.raises(BlockPoolError, match="null"):
        pool.cache_block(pool.null_block, 123, 0)
    pool.touch([pool.null_block])  # a hit list may contain nulls: they are skipped
    assert pool.null_block.ref_cnt == 0
    assert pool.null_block.cache_key is None and not pool.cached
    assert 0 not in free_ids(pool)


def test_pool_needs_a_real_block() -> None:
    with pytest.raises(ConfigError):
        BlockPool(1)


# -- errors -------------------------------------------------------------------------


def test_double_free_raises() -> None:
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(BlockPoolError, match="double free of block 1"):
        pool.free_blocks([b])
    assert pool.num_free_blocks == 3


def test_asking_for_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(5)
    pool.get_new_blocks(2)
    before = free_ids(pool)
    with pytest.raises(OutOfBlocksError, match="asked for 3 blocks, only 2 free"):
        pool.get_new_blocks(3)
    assert free_ids(pool) == before and pool.num_free_blocks == 2
    with pytest.raises(BlockPoolError):  # callers that catch pool errors catch this one too
        pool.get_new_blocks(3)
    assert free_ids(pool) == before


def test_remove_of_block_not_in_queue_raises() -> None:
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    with pytest.raises(BlockPoolError, match="not in the free queue"):
        pool.free_queue.remove(b)


# -- free-queue order ---------------------------------------------------------------


def test_unhashed_freed_blocks_go_to_front_and_are_reused_first() -> None:
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(4)  # 1..4
    pool.free_blocks(reversed(blocks[2:]))  # tail first: 4 then 3
    assert free_ids(pool) == [3, 4, 5, 6, 7]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 4]


def test_hashed_freed_blocks_go_to_back_longest_prefix_evicted_first() -> None:
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(3)  # a request's table: 1, 2, 3
    for i, b in enumerate(blocks):
        pool.cache_block(b, 100 + i, 0)
    pool.free_blocks(reversed(blocks))  # tail first
    assert free_ids(pool) == [4, 5, 6, 7, 3, 2, 1]
    # Drain the never-used blocks, then evict one cached block: the tail (longest prefix) goes.
    pool.get_new_blocks(4)
    (evicted,) = pool.get_new_blocks(1)
    assert evicted.block_id == 3 and evicted.cache_key is None
    assert pool.get_cached_block(102, 0) is None
    assert pool.get_cached_block(101, 0) is blocks[1]
    assert pool.get_cached_block(100, 0) is blocks[0]
    assert (102, 0) not in pool.cached


def test_mixed_free_keeps_unhashed_front_hashed_back() -> None:
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(4)  # 1..4, only 1 and 2 are full (hashed) blocks
    pool.cache_block(blocks[0], 7, 0)
    pool.cache_block(blocks[1], 8, 0)
    pool.free_blocks(reversed(blocks))  # 4, 3 (unhashed) then 2, 1 (hashed)
    assert free_ids(pool) == [3, 4, 5, 2, 1]


def test_lru_a_hit_refreshes_position() -> None:
    pool = BlockPool(5)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 1, 0)
    pool.cache_block(b, 2, 0)
    pool.free_blocks([a])
    pool.free_blocks([b])
    assert free_ids(pool) == [3, 4, 1, 2]
    pool.touch([pool.get_cached_block(1, 0)])  # hit on a: leaves the queue
    assert a.ref_cnt == 1 and free_ids(pool) == [3, 4, 2]
    pool.free_blocks([a])  # most recently used: back of the queue
    assert free_ids(pool) == [3, 4, 2, 1]


# -- prefix cache map ------------------------------------------------------------


def test_stale_hash_is_evicted_when_cached_free_block_is_reused() -> None:
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 42, 0)
    pool.free_blocks([b, a])
    assert pool.get_cached_block(42, 0) is a
    got = pool.get_new_blocks(2)
    assert [x.block_id for x in got] == [2, 1]  # unhashed b first, then cached a
    assert a.cache_key is None and pool.get_cached_block(42, 0) is None and not pool.cached


def test_touch_shared_and_free_cached_blocks() -> None:
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 1, 0)
    pool.cache_block(b, 2, 0)
    pool.free_blocks([b])
    pool.touch([a, b])  # a shared (ref 1 -> 2), b revived from the queue (0 -> 1)
    assert (a.ref_cnt, b.ref_cnt) == (2, 1)
    assert free_ids(pool) == [3] and pool.num_free_blocks == 1


def test_same_key_on_two_blocks_stays_findable_until_both_evicted() -> None:
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)  # two requests computed the same prefix
    pool.cache_block(a, 9, 0)
    pool.cache_block(b, 9, 0)
    pool.cache_block(a, 9, 0)  # caching again is a no-op
    assert set(pool.cached[(9, 0)]) == {1, 2}
    pool.free_blocks([a, b])
    pool.get_new_blocks(1)  # evicts a
    assert pool.get_cached_block(9, 0) is b
    pool.get_new_blocks(1)
    assert pool.get_cached_block(9, 0) is None and not pool.cached


def test_cache_key_includes_group() -> None:
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 5, 0)
    pool.cache_block(b, 5, 1)
    assert pool.get_cached_block(5, 0) is a
    assert pool.get_cached_block(5, 1) is b
    assert pool.get_cached_block(5, 2) is None


def test_reset_prefix_cache_refuses_while_in_use() -> None:
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 1, 0)
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(1, 0) is a  # nothing forgotten
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is True
    assert not pool.cached and all(x.cache_key is None for x in pool.blocks)
    assert pool.num_free_blocks == 3


def test_usage_fraction() -> None:
    pool = BlockPool(5)
    assert pool.usage == 0.0
    got = pool.get_new_blocks(3)
    assert pool.usage == pytest.approx(0.75)
    pool.free_blocks(got)
    assert pool.usage == 0.0


def test_on_free_hook_sees_each_block_reaching_zero() -> None:
    pool = BlockPool(4)
    seen: list[int] = []
    pool.on_free = seen.append
    a, b = pool.get_new_blocks(2)
    pool.touch([a])  # a shared: first free only drops a ref
    pool.free_blocks([b, a])
    assert seen == [2]
    pool.free_blocks([a])
    assert seen == [2, 1]


# -- FreeBlockQueue is an intrusive list (O(1) operations) -----------------------


class CountingBlock(KVCacheBlock):
    """A block that counts every read of its list pointers."""

    reads = 0

    def __init__(self, block_id: int) -> None:
        self._links: list[KVCacheBlock | None] = [None, None]
        super().__init__(block_id)

    @property  # type: ignore[override]
    def prev_free(self) -> KVCacheBlock | None:
        CountingBlock.reads += 1
        return self._links[0]

    @prev_free.setter
    def prev_free(self, value: KVCacheBlock | None) -> None:
        self._links[0] = value

    @property  # type: ignore[override]
    def next_free(self) -> KVCacheBlock | None:
        CountingBlock.reads += 1
        return self._links[1]

    @next_free.setter
    def next_free(self, value: KVCacheBlock | None) -> None:
        self._links[1] = value


@pytest.mark.parametrize("size", [10, 5000])
def test_queue_operations_touch_a_constant_number_of_links(size: int) -> None:
    """remove-from-middle, popleft and append read O(1) links whatever the queue length."""
    blocks = [CountingBlock(i) for i in range(size)]
    queue = FreeBlockQueue(blocks)
    middle = blocks[size // 2]
    CountingBlock.reads = 0
    queue.remove(middle)
    queue.append(middle)
    queue.appendleft(queue.popleft())
    assert CountingBlock.reads <= 12
    assert queue.num_free_blocks == size


def test_queue_remove_from_middle_relinks_neighbours() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    assert blocks[1].next_free is blocks[3] and blocks[3].prev_free is blocks[1]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert [b.block_id for b in queue] == [1, 3] and queue.num_free_blocks == 2
    assert queue.popleft() is blocks[1] and queue.popleft() is blocks[3]
    with pytest.raises(OutOfBlocksError):
        queue.popleft()


@pytest.mark.parametrize("size", [0, 1, 7])
def test_queue_built_in_one_pass_links_like_appends(size: int) -> None:
    built = FreeBlockQueue([KVCacheBlock(i) for i in range(size)])
    appended = FreeBlockQueue([])
    for i in range(size):
        appended.append(KVCacheBlock(i))
    for q in (built, appended):
        forward = [b.block_id for b in q]
        backward, b = [], q.tail.prev_free
        while b is not q.head:
            backward.append(b.block_id)
            b = b.prev_free
        assert forward == backward[::-1] == list(range(size)) and q.num_free_blocks == size
        assert q.head.prev_free is None and q.tail.next_free is None


# -- retention: cached blocks recycled before never-used blocks are touched -----------


def cached_and_freed(pool: BlockPool, n: int, key0: int) -> list[KVCacheBlock]:
    """n new blocks as one request's table, each cached, then freed tail first."""
    table = pool.get_new_blocks(n)
    for i, b in enumerate(table):
        pool.cache_block(b, key0 + i, 0)
    pool.free_blocks(reversed(table))
    return table


def test_cached_blocks_beyond_the_retained_go_before_never_used_ones() -> None:
    pool = BlockPool(10, retained_cached_blocks=2)  # 9 blocks, the cache keeps 2 of them first
    cached_and_freed(pool, 3, 100)  # blocks 1, 2, 3 freed as 3, 2, 1: 3 is the oldest
    assert free_ids(pool) == [3, 4, 5, 6, 7, 8, 9, 2, 1]
    (b,) = pool.get_new_blocks(1)
    assert b.block_id == 3 and b.cache_key is None and pool.get_cached_block(102, 0) is None
    assert [x.block_id for x in pool.get_new_blocks(2)] == [4, 5]  # 2 cached left: new blocks now
    assert pool.get_cached_block(101, 0) is pool.blocks[2] and pool.get_cached_block(100, 0) is pool.blocks[1]
    pool.free_blocks([b])  # no key: first out again
    assert free_ids(pool) == [3, 6, 7, 8, 9, 2, 1]


def test_no_retention_recycles_every_cached_block_first() -> None:
    pool = BlockPool(8, retained_cached_blocks=0)
    cached_and_freed(pool, 2, 100)  # 1, 2 freed as 2, 1
    assert free_ids(pool) == [2, 1, 3, 4, 5, 6, 7]
    assert [b.block_id for b in pool.get_new_blocks(3)] == [2, 1, 3]
    assert not pool.cached


def test_unlimited_retention_is_the_plain_lru_order() -> None:
    pool = BlockPool(8)  # retained_cached_blocks=None: every cached block kept
    cached_and_freed(pool, 2, 100)
    assert free_ids(pool) == [3, 4, 5, 6, 7, 2, 1]


def test_a_hit_on_a_retained_block_and_a_reset_keep_the_count() -> None:
    pool = BlockPool(8, retained_cached_blocks=1)
    table = cached_and_freed(pool, 3, 100)  # freed 3, 2, 1: 3 and 2 beyond the one retained
    assert pool.free_queue.num_cached == 3 and free_ids(pool) == [3, 2, 4, 5, 6, 7, 1]
    pool.touch([table[0]])  # a prefix hit takes block 1 (the newest) out of the queue
    assert pool.free_queue.num_cached == 2 and free_ids(pool) == [3, 4, 5, 6, 7, 2]
    pool.free_blocks([table[0]])
    assert free_ids(pool) == [3, 2, 4, 5, 6, 7, 1]
    assert pool.reset_prefix_cache() and pool.free_queue.num_cached == 0
    assert free_ids(pool) == [3, 2, 1, 4, 5, 6, 7]  # keyless now: used blocks first


def test_a_never_used_block_cannot_be_hit() -> None:
    pool = BlockPool(4, retained_cached_blocks=0)
    with pytest.raises(BlockPoolError, match="block 2 was never used"):
        pool.free_queue.remove(pool.blocks[2])
    assert pool.num_free_blocks == 3


def test_negative_retention_is_refused() -> None:
    with pytest.raises(ConfigError, match="retained cached blocks must be >= 0"):
        BlockPool(4, retained_cached_blocks=-1)


@settings(max_examples=150)
@given(retained=st.integers(0, 6), ops=st.lists(st.tuples(st.integers(1, 4), st.integers(0, 3), st.booleans()),
                                                 max_size=40))
def test_blocks_ever_used_stay_within_the_peak_in_use_plus_the_retained(retained: int, ops) -> None:  # type: ignore[no-untyped-def]
    """Whatever is allocated, cached, freed and hit: the blocks ever handed out never exceed
    the most in use at once + `retained`, and the free queue lists the blocks in the order
    get_new_blocks then hands them out. Each op allocates a table of n blocks (all but the
    last cached), maybe takes a prefix hit on a cached block, then frees one table (chosen
    by `which`) while more than two are held: few in use, so never-used blocks stay
    available and only the order decides what gets touched."""
    pool = BlockPool(16, retained_cached_blocks=retained)
    tables: list[list[KVCacheBlock]] = []
    next_key, peak = 0, 0
    for n, which, hit in ops:
        table = pool.get_new_blocks(n)
        for b in table[: n - 1]:
            pool.cache_block(b, next_key, 0)
            next_key += 1
        tables.append(table)
        if hit and pool.cached:
            block = pool.get_cached_block(*sorted(pool.cached)[which % len(pool.cached)])
            pool.touch([block])
            tables.append([block])
        peak = max(peak, pool.num_blocks - 1 - pool.num_free_blocks)
        while len(tables) > 2:
            pool.free_blocks(reversed(tables.pop(which % len(tables))))
        assert sum(not b.never_used for b in pool.blocks[1:]) <= peak + retained
        assert pool.free_queue.num_cached == sum(b.cache_key is not None for b in pool.free_queue)
    order = free_ids(pool)
    assert [b.block_id for b in pool.get_new_blocks(pool.num_free_blocks)] == order
