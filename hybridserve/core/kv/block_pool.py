"""The shared pool of KV blocks, with the null block and the prefix-cache map.

Invariants (checked by the state-machine test after every operation):
- block 0 is the null block: never in the free queue, never allocated, freed or cached;
- every other block is either in the free queue (ref_cnt == 0) or referenced (ref_cnt > 0);
- num_free_blocks + used blocks == num_blocks - 1;
- a block with a hash is findable in the cache map until it is handed out again;
- blocks ever handed out <= the most blocks in use at once + retained_cached_blocks (the
  pool's memory grows with what it serves, not with its budget: see FreeBlocks).
"""

from __future__ import annotations

from typing import Callable, Iterable

from hybridserve.core.errors import BlockPoolError, ConfigError, OutOfBlocksError

CacheKey = tuple[bytes, int]  # (block hash, group id)


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "cache_key", "prev_free", "next_free", "is_null", "never_used")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.cache_key: CacheKey | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False
        self.never_used = True  # not handed out yet: its KV memory was never written

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, key={self.cache_key})"


class FreeBlockQueue:
    """Intrusive doubly linked list: O(1) pop-front, remove-from-middle, push front/back."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        # Linked in one pass (a pool has tens of thousands of blocks): the same as
        # append()ing each block in order.
        prev = self.head
        count = 0
        for b in blocks:
            prev.next_free, b.prev_free = b, prev
            prev = b
            count += 1
        prev.next_free, self.tail.prev_free = self.tail, prev
        self.num_free_blocks = count

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free
        if block is self.tail or block is None:
            raise OutOfBlocksError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise BlockPoolError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def _insert_after(self, anchor: KVCacheBlock, block: KVCacheBlock) -> None:
        nxt = anchor.next_free
        assert nxt is not None
        block.prev_free, block.next_free = anchor, nxt
        anchor.next_free = nxt.prev_free = block
        self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        self._insert_after(self.tail.prev_free, block)  # type: ignore[arg-type]

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self.head, block)

    def __iter__(self):
        b = self.head.next_free
        while b is not self.tail and b is not None:
            yield b
            b = b.next_free


class FreeBlocks:
    """The free blocks in the order they are handed out, with a cap on what the prefix cache
    keeps resident.

    Never-used blocks have KV memory the process has not written yet (the pool's tensors are
    zero pages until then), so handing them out before recycling used ones would make the
    whole budget resident over a server's life, whatever its working set; and first writes
    to such pages cost more than writes to recycled ones (benchmarks/results/
    kv_pool_huge_pages.md). Freed blocks with nothing to find go first; cached blocks are
    kept for prefix hits, oldest first out, but only `retained` of them are kept in
    preference to touching a never-used block. The order:

    1. freed blocks without a cache key (most recently freed first);
    2. the oldest cached blocks beyond the `retained` newest;
    3. never-used blocks, in id order;
    4. the `retained` newest cached blocks, oldest first.

    So blocks ever handed out never exceed the most in use at once + `retained`.
    `retained` >= the pool's size keeps every cached block (never-used blocks first)."""

    def __init__(self, blocks: list[KVCacheBlock], retained: int) -> None:
        if retained < 0:
            raise ConfigError(f"retained cached blocks must be >= 0, got {retained}")
        self.retained = retained
        self.fresh = FreeBlockQueue(blocks)
        # Used blocks: those without a key at the front, the cached ones behind (LRU order).
        self.used = FreeBlockQueue(())
        self.num_cached = 0  # blocks in `used` with a cache key

    @property
    def num_free_blocks(self) -> int:
        return self.fresh.num_free_blocks + self.used.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        front = self.used.head.next_free
        if front is not self.used.tail and (front.cache_key is None or self.num_cached > self.retained
                                            or not self.fresh.num_free_blocks):
            return self._pop_used()
        block = self.fresh.popleft()  # raises OutOfBlocksError when none is left either
        block.never_used = False
        return block

    def _pop_used(self) -> KVCacheBlock:
        block = self.used.popleft()
        if block.cache_key is not None:
            self.num_cached -= 1
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Take a free block out (a prefix hit); never-used blocks have no key to be hit by."""
        if block.never_used:
            raise BlockPoolError(f"block {block.block_id} was never used: nothing can hit it")
        self.used.remove(block)
        if block.cache_key is not None:
            self.num_cached -= 1

    def append(self, block: KVCacheBlock) -> None:
        """A freed block with a cache key: findable until evicted, newest last."""
        self.used.append(block)
        self.num_cached += block.cache_key is not None

    def appendleft(self, block: KVCacheBlock) -> None:
        """A freed block with nothing to find: handed out first."""
        self.used.appendleft(block)
        self.num_cached += block.cache_key is not None

    def forget_keys(self) -> None:
        """The cache's keys were cleared (every block free): no block is cached any more."""
        self.num_cached = 0

    def __iter__(self):
        """The free blocks in the order popleft hands them out (while nothing is freed)."""
        evicted_first = max(0, self.num_cached - self.retained)
        fresh_done = False
        for block in self.used:
            if block.cache_key is not None:
                if evicted_first == 0 and not fresh_done:
                    yield from self.fresh
                    fresh_done = True
                evicted_first -= 1
            yield block
        if not fresh_done:
            yield from self.fresh


class BlockPool:
    """All groups draw block ids from here. Block 0 is the null block.

    retained_cached_blocks: how many freed cached blocks the prefix cache keeps in
    preference to handing out never-used blocks (FreeBlocks); None keeps them all."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, retained_cached_blocks: int | None = None) -> None:
        if num_blocks < 2:
            raise ConfigError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.null_block.never_used = False
        retained = num_blocks if retained_cached_blocks is None else retained_cached_blocks
        self.free_queue = FreeBlocks(self.blocks[1:], retained)
        # Several blocks may carry the same key (two requests computed the same prefix
        # before either was cached); any of them serves a hit.
        self.cached: dict[CacheKey, dict[int, KVCacheBlock]] = {}
        # Debug hook (the simulator's race detector): called with each block id freed.
        self.on_free: Callable[[int], None] | None = None
        # Blocks with ref_cnt >= 2 (shared by several tables, or a table and a fenced free).
        # While it is 0 no two tables share a block, so usage can be counted per table.
        self.num_shared_blocks = 0

    # -- counts ---------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of allocatable blocks in use (0.0 .. 1.0)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    # -- allocation -----------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop n free blocks, evicting any stale prefix-cache entry they carry."""
        if n > self.num_free_blocks:
            raise OutOfBlocksError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.cache_key is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hit blocks (pulling free ones out of the queue)."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            elif block.ref_cnt == 1:
                self.num_shared_blocks += 1
            block.ref_cnt += 1

    def free_blocks(self, blocks_tail_first: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching zero return to the queue.

        Pass a request's blocks tail first: cached blocks go to the back in that order,
        so a longer prefix is evicted before the shorter prefix it extends.
        """
        for block in blocks_tail_first:
            if block.is_null:
                raise BlockPoolError("the null block cannot be freed")
            if block.ref_cnt <= 0:
                raise BlockPoolError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if self.on_free is not None:
                    self.on_free(block.block_id)
                if block.cache_key is None:
                    self.free_queue.appendleft(block)  # nothing to find: reuse first
                else:
                    self.free_queue.append(block)  # findable until evicted (LRU)
            elif block.ref_cnt == 1:
                self.num_shared_blocks -= 1

    # -- prefix cache -----------------------------------------------------------
    def get_cached_block(self, block_hash: bytes, group_id: int) -> KVCacheBlock | None:
        entry = self.cached.get((block_hash, group_id))
        if not entry:
            return None
        return next(iter(entry.values()))

    def cache_block(self, block: KVCacheBlock, block_hash: bytes, group_id: int) -> None:
        if block.is_null:
            raise BlockPoolError("the null block cannot be cached")
        if block.cache_key is not None:
            return  # already cached (shared prefix block)
        key = (block_hash, group_id)
        block.cache_key = key
        self.cached.setdefault(key, {})[block.block_id] = block

    def _evict(self, block: KVCacheBlock) -> None:
        key = block.cache_key
        assert key is not None
        entry = self.cached.get(key)
        if entry is not None:
            entry.pop(block.block_id, None)
            if not entry:
                del self.cached[key]
        block.cache_key = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refuses (returns False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.blocks[1:]:
            block.cache_key = None
        self.cached.clear()
        self.free_queue.forget_keys()
        return True
