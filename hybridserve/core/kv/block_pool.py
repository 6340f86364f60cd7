"""The shared pool of KV blocks, with the null block and the prefix-cache map.

Invariants (checked by the state-machine test after every operation):
- block 0 is the null block: never in the free queue, never allocated, freed or cached;
- every other block is either in the free queue (ref_cnt == 0) or referenced (ref_cnt > 0);
- num_free_blocks + used blocks == num_blocks - 1;
- a block with a hash is findable in the cache map until it is handed out again.
"""

from __future__ import annotations

from typing import Callable, Iterable

from hybridserve.core.errors import BlockPoolError, ConfigError, OutOfBlocksError

CacheKey = tuple[bytes, int]  # (block hash, group id)


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "cache_key", "prev_free", "next_free", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.cache_key: CacheKey | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False

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


class BlockPool:
    """All groups draw block ids from here. Block 0 is the null block."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ConfigError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.free_queue = FreeBlockQueue(self.blocks[1:])
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
        return True
