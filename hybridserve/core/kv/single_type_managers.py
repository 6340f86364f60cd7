"""One manager per attention type. They differ in one hook and in how they find hits.

`get_num_skipped_tokens(n)`: with n tokens processed, how many leading tokens no future
query reads. `remove_skipped_blocks` turns every block wholly below that boundary into
the null block and frees it::

    sliding window W=4, block 2, n=7 processed: next query (pos 7) reads 4..7
    tokens  0 1 | 2 3 | 4 5 | 6 _
    blocks  [0]   [1]   [2]   [3]      skipped = 7-4+1 = 4 -> blocks 0,1 -> null
"""

from __future__ import annotations

from hybridserve.core.kv.block_pool import BlockPool, KVCacheBlock
from hybridserve.core.kv.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    WindowTail,
    cdiv,
)
from hybridserve.core.request import Request


class SingleTypeKVCacheManager:
    """Block tables of one KV cache group.

    Invariants: a request's table is indexed by absolute block position (block i holds
    tokens i*bs .. (i+1)*bs-1), so freeing never shifts it; every entry below
    num_null_blocks[request] is the null block (pruned, or padding before a prefix hit),
    and pruning only moves that mark forward, so no block is freed twice. With
    window-tail allocation, nulls also appear inside a table (chunk slots before a tail).
    """

    spec: KVCacheSpec

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int, enable_caching: bool) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.pool = block_pool
        self.group_id = group_id
        self.enable_caching = enable_caching
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        # Length of each table's null prefix, reported to the executor.
        self.num_null_blocks: dict[str, int] = {}
        # Real (non-null) blocks in each table, kept incrementally for admission.
        self.num_real_blocks: dict[str, int] = {}

    # -- the hook -------------------------------------------------------------
    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return 0

    # -- allocation -----------------------------------------------------------
    def num_required_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: list[KVCacheBlock] | tuple, chunk_start: int = 0
    ) -> int:
        """Blocks the pool must give up: new ones, plus free hit blocks leaving the queue."""
        blocks = self.req_to_blocks.get(request_id)
        num_new = self.num_required_blocks(num_tokens) - (len(blocks) if blocks else 0) - len(new_computed_blocks)
        if num_new < 0:
            num_new = 0
        elif num_new and (self.has_holes or not blocks):
            first = (len(blocks) if blocks else 0) + len(new_computed_blocks)
            num_new = sum(1 for i in range(first, first + num_new) if self.is_real(i, chunk_start, num_tokens))
        if new_computed_blocks:
            num_new += sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return num_new

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: list[KVCacheBlock]) -> None:
        blocks = self.req_to_blocks.setdefault(request_id, [])
        if new_computed_blocks:
            assert not blocks, "prefix hits are only taken by requests that hold no blocks"
            blocks.extend(new_computed_blocks)
            nulls = 0
            while nulls < len(blocks) and blocks[nulls].is_null:
                nulls += 1
            self.num_null_blocks[request_id] = nulls
            self.num_cached_blocks[request_id] = len(blocks)
            self.num_real_blocks[request_id] = sum(1 for b in blocks if not b.is_null)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, chunk_start: int = 0) -> list[KVCacheBlock]:
        """Blocks for positions up to num_tokens; returns the new table entries (nulls included)."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        n = self.num_required_blocks(num_tokens) - len(blocks)
        if n <= 0:
            return []
        first = len(blocks)
        if not self.has_holes and first > self.first_real_block(chunk_start):
            new = self.pool.get_new_blocks(n)
            num_real = n
        else:
            real = [self.is_real(i, chunk_start, num_tokens) for i in range(first, first + n)]
            num_real = sum(real)
            fresh = iter(self.pool.get_new_blocks(num_real))
            new = [next(fresh) if r else self.pool.null_block for r in real]
            nulls = self.num_null_blocks.get(request_id, 0)
            if nulls == first:  # a null prefix grows (blocks below the skip boundary)
                while nulls < first + n and new[nulls - first].is_null:
                    nulls += 1
                self.num_null_blocks[request_id] = nulls
        blocks.extend(new)
        self.num_real_blocks[request_id] = self.num_real_blocks.get(request_id, 0) + num_real
        return new

    # Window-tail allocation: set by the KV cache manager for sliding-window groups.
    window_tail: WindowTail | None = None

    @property
    def has_holes(self) -> bool:
        """Can a chunk's new blocks include nulls above the skip boundary (see is_real)?"""
        return self.window_tail is not None

    def first_real_block(self, chunk_start: int) -> int:
        """Blocks below this one are skipped when a chunk starts at chunk_start: a request's
        first chunk after a prefix hit or a connector load (tokens it never computes)
        gets the null block there, as pruning would give it right after."""
        return self.get_num_skipped_tokens(chunk_start) // self.block_size

    def is_real(self, index: int, chunk_start: int, chunk_end: int) -> bool:
        """Does block `index` need a real block for a chunk chunk_start .. chunk_end-1?

        Not below the skip boundary; with window-tail allocation see SlidingWindowManager."""
        return index >= self.first_real_block(chunk_start)

    def cache_blocks(self, request: Request, num_tokens: int, num_processed_tokens: int) -> None:
        """Publish the request's full blocks below num_tokens as prefix-cache entries.

        Attention blocks may be published while the step writing them is in flight: a
        step that hits them runs later, and within a step K/V land before attention.
        (num_processed_tokens matters only to Mamba checkpoints, see MambaManager.)"""
        rid = request.request_id
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        start = self.num_cached_blocks.get(rid, 0)
        if num_full <= start:
            return
        blocks = self.req_to_blocks[rid]
        for i in range(start, num_full):
            if not blocks[i].is_null:
                self.pool.cache_block(blocks[i], request.block_hashes[i], self.group_id)
        self.num_cached_blocks[rid] = num_full

    # -- freeing ----------------------------------------------------------------
    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int) -> None:
        """Null out and free blocks wholly below the skipped boundary.

        Only blocks between the null mark (num_null_blocks) and the boundary are visited,
        walking backward, and the mark then moves to the boundary: calling it again, or
        with a smaller count, never frees twice.
        """
        num_skipped = self.get_num_skipped_tokens(processed_computed_tokens)
        if num_skipped < self.block_size:
            return
        start = self.num_null_blocks.get(request_id, 0)
        end = num_skipped // self.block_size
        if end <= start:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        end = min(end, len(blocks))
        removed = []
        null = self.pool.null_block
        for i in range(end - 1, start - 1, -1):  # tail first: longer prefixes evicted first
            block = blocks[i]
            if block.is_null:
                continue  # a hole (window-tail allocation); never freed, never counted
            removed.append(block)
            blocks[i] = null
        self.pool.free_blocks(removed)
        self.num_null_blocks[request_id] = end
        self.num_real_blocks[request_id] -= len(removed)

    def next_free_basis(self, request_id: str) -> float:
        """Smallest processed count at which remove_skipped_blocks frees another block.

        Found from the hook alone (it is monotonic and never exceeds its argument), by
        doubling then bisecting above the target, so every manager gets it for free.
        """
        target = (self.num_null_blocks.get(request_id, 0) + 1) * self.block_size
        hook = self.get_num_skipped_tokens
        if hook(1 << 62) < target:
            return float("inf")  # never frees (full attention, Mamba)
        lo, step = target, self.block_size
        hi = lo + step
        while hook(hi) < target:
            lo, step = hi, step * 2
            hi = lo + step
        while lo < hi:
            mid = (lo + hi) // 2
            if hook(mid) >= target:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def num_covered_tokens(self, request_id: str) -> float:
        """Tokens the request's table has slots for."""
        return len(self.req_to_blocks.get(request_id, ())) * self.block_size

    def next_cache_tokens(self, request_id: str) -> float:
        """Token count at which cache_blocks would publish another block."""
        if not self.enable_caching:
            return float("inf")
        return (self.num_cached_blocks.get(request_id, 0) + 1) * self.block_size

    def pop(self, request_id: str) -> list[KVCacheBlock]:
        """Detach a request's table; return its real blocks tail first (for freeing)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_blocks.pop(request_id, None)
        self.num_null_blocks.pop(request_id, None)
        self.num_real_blocks.pop(request_id, None)
        return [b for b in reversed(blocks) if not b.is_null]

    # -- prefix cache -----------------------------------------------------------
    def find_longest_cache_hit(self, block_hashes: list[bytes], max_length: int) -> list[KVCacheBlock]:
        """Blocks (nulls allowed) covering the longest cached prefix of at most max_length tokens."""
        raise NotImplementedError

    def _lookup(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.pool.get_cached_block(block_hash, self.group_id)


class FullAttentionManager(SingleTypeKVCacheManager):
    def find_longest_cache_hit(self, block_hashes: list[bytes], max_length: int) -> list[KVCacheBlock]:
        hit = []
        for h in block_hashes[: max_length // self.block_size]:
            block = self._lookup(h)
            if block is None:
                break
            hit.append(block)
        return hit


class SlidingWindowManager(SingleTypeKVCacheManager):
    spec: SlidingWindowSpec

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        # The next token, at position n, reads n-W+1 .. n.
        return max(0, num_computed_tokens - self.spec.sliding_window + 1)

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_length: int) -> list[KVCacheBlock]:
        """Scan right to left for cdiv(W-1, bs) contiguous cached blocks; nulls before them."""
        need = cdiv(self.spec.sliding_window - 1, self.block_size)
        num_blocks = min(max_length // self.block_size, len(block_hashes))
        hit = [self.pool.null_block] * num_blocks
        if need == 0:
            return hit
        run = 0
        for i in range(num_blocks - 1, -1, -1):
            block = self._lookup(block_hashes[i])
            if block is None:
                run = 0
                continue
            hit[i] = block
            run += 1
            if run == need:
                return hit[: i + need]
        # Reached position 0 with a shorter run: the window covers all of it.
        return hit[:run]


    def is_real(self, index: int, chunk_start: int, chunk_end: int) -> bool:
        """Real iff the block overlaps the retained window before the chunk, or its tail.

        chunk s..e-1 (e = chunk_end), W window, d max drafts::

            [ s-W+1 .. s-1 ]  retained window: read from the cache by the chunk's queries
            [ s .. e-W-d ]    null: read only by the chunk's own queries, from the batch
            [ e-W-d+1 .. e-1] tail: read from the cache by the steps that follow
        """
        if index < self.first_real_block(chunk_start):
            return False  # below the skip boundary (see the base class)
        if self.window_tail is None:
            return True
        bs, w = self.block_size, self.spec.sliding_window - 1
        lo, hi = index * bs, index * bs + bs
        if hi > chunk_start - w and lo < chunk_start:
            return True
        return hi > max(chunk_start, chunk_end - w - self.window_tail.max_draft_tokens)


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    spec: ChunkedLocalAttentionSpec

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        c = self.spec.attention_chunk_size
        return (num_computed_tokens // c) * c

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_length: int) -> list[KVCacheBlock]:
        """Whole chunks before the one holding max_length are nulls; scan the rest left to right."""
        bs = self.block_size
        num_blocks = min(max_length // bs, len(block_hashes))
        first = self.get_num_skipped_tokens(max_length) // bs
        first = min(first, num_blocks)
        hit = [self.pool.null_block] * first
        for i in range(first, num_blocks):
            block = self._lookup(block_hashes[i])
            if block is None:
                break
            hit.append(block)
        return hit


class MambaManager(SingleTypeKVCacheManager):
    """State blocks of a Mamba group; see MambaSpec for its two layouts.

    With block checkpoints the table is positional and the state after n tokens lives
    in block (n-1)//bs. The next step reads only that block, but the request also keeps
    the checkpoint of the last whole block, so that at its finish a KV connector can
    store the state a continuation of the sequence would start from::

        bs 4, n = 10 processed: S10 in block 2, last whole-block checkpoint S8 in block 1
        tokens  0 1 2 3 | 4 5 6 7 | 8 9 _ _
        blocks  [S4]      [S8]      [S10]          skipped = (10//4 - 1)*4 = 4: block 0 freed

    A prefix hit needs just one block: the checkpoint at the hit's end.
    """

    spec: MambaSpec

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int, enable_caching: bool) -> None:
        super().__init__(spec, block_pool, group_id, enable_caching)
        self.checkpoints = self.spec.block_checkpoints

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        if not self.checkpoints:
            return 0
        if num_computed_tokens < 2 * self.block_size:
            return 0
        return (num_computed_tokens // self.block_size - 1) * self.block_size

    def num_required_blocks(self, num_tokens: int) -> int:
        if self.checkpoints:
            return -(-num_tokens // self.block_size)
        return self.spec.num_state_blocks if num_tokens > 0 else 0

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_length: int) -> list[KVCacheBlock]:
        """The rightmost cached checkpoint at or below max_length; nulls before it."""
        if not self.checkpoints:
            return []  # a state block is overwritten as the request runs: nothing to hit
        for i in range(min(max_length // self.block_size, len(block_hashes)) - 1, -1, -1):
            block = self._lookup(block_hashes[i])
            if block is not None:
                return [self.pool.null_block] * i + [block]
        return []

    def num_covered_tokens(self, request_id: str) -> float:
        if self.checkpoints:
            return super().num_covered_tokens(request_id)
        return float("inf") if request_id in self.req_to_blocks else 0

    def next_cache_tokens(self, request_id: str) -> float:
        return super().next_cache_tokens(request_id) if self.checkpoints else float("inf")

    def cache_blocks(self, request: Request, num_tokens: int, num_processed_tokens: int) -> None:
        """Checkpoints only of processed steps: a Mamba layer reads every request's state
        before it writes any, so a checkpoint an in-flight step writes is not there yet
        for a request that would hit it in the same step."""
        if self.checkpoints:
            super().cache_blocks(request, min(num_tokens, num_processed_tokens), num_processed_tokens)


class CheckpointBudget:
    """How many best-effort checkpoint columns the allocation under way may fill."""

    __slots__ = ("columns",)

    def __init__(self) -> None:
        self.columns = 0


class InPlaceMambaManager(MambaManager):
    """Mamba groups whose running state stays in one block (`MambaSpec.running_in_place`).

    The table is positional like MambaManager's (block i: the state after tokens up to
    the end of block i), except that its last entry is always the running block R, the
    one block a request truly needs. When a step's slots grow the table, R moves to the
    new last entry (same block id: every step reads and writes its state in place) and
    the entries it leaves get checkpoint blocks when the pool has blocks to spare
    (`budget`, set by the KV cache manager per allocation) or the null block (no
    checkpoint there, so fewer prefix hits)::

        bs 4, chunk 0..5 then 6..12:   [X4  R]   ->   [X4  X8  null  R]
        table delta of the second:     [X8, null], inserted before the last entry

    A step over s..e-1 reads R (the first step after a prefix hit or a connector load
    reads block (s-1)//bs instead, the source it starts from), writes its final state
    to R and the state at every boundary b in [s, e] (b > 0) to block b/bs - 1 when that
    is a checkpoint block, not R (b == s: the state it read; b == e: its final state). A
    checkpoint is written by a step that reaches its boundary, so it is published (and
    pruned) once the processed count has passed the boundary: (c + 1) * bs < processed.
    R is never published while the request runs: its column is never below the
    scheduled count (at a finish, see cache_final).
    """

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int, enable_caching: bool) -> None:
        super().__init__(spec, block_pool, group_id, enable_caching)
        self.running: set[str] = set()  # requests whose last table entry is their running block
        # Checkpoint columns an allocation may fill beyond what it needs: set once per
        # allocation by the KV cache manager, shared by every in-place group (they decide
        # alike, each taking that many blocks; see KVCacheManager._allocate_slots).
        self.budget = CheckpointBudget()

    @property
    def has_holes(self) -> bool:
        return True

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Every column below the last computed token's (its checkpoints are written and
        published by then), but with keep_last_checkpoint the last whole one (a KV
        connector stores it at the request's finish)."""
        if self.spec.keep_last_checkpoint:
            return super().get_num_skipped_tokens(num_computed_tokens)
        return max(0, (num_computed_tokens - 1) // self.block_size * self.block_size)

    def next_free_basis(self, request_id: str) -> float:
        """The base class's search, in closed form for this hook: block nn (the first past
        the null mark) goes at processed nn*bs + bs + 1 (the last whole one kept: + bs)."""
        mark = self.num_null_blocks.get(request_id, 0) + 1
        return (mark + 1) * self.block_size if self.spec.keep_last_checkpoint else mark * self.block_size + 1

    def _source_column(self, chunk_start: int) -> int:
        """Column of the state a request without a running block starts from (-1: zeros)."""
        return (chunk_start - 1) // self.block_size if chunk_start > 0 else -1

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: list[KVCacheBlock] | tuple, chunk_start: int = 0
    ) -> int:
        """Required blocks only: R at a request's first compute step and, after a connector
        load, the block the load fills; checkpoints take what `budget` allows."""
        blocks = self.req_to_blocks.get(request_id)
        have = (len(blocks) if blocks else 0) + len(new_computed_blocks)
        num_new = 0
        if -(-num_tokens // self.block_size) > have and request_id not in self.running:
            num_new = int(num_tokens > chunk_start) + int(self._source_column(chunk_start) >= have)
        if new_computed_blocks:
            num_new += sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return num_new

    def allocate_new_blocks(self, request_id: str, num_tokens: int, chunk_start: int = 0) -> list[KVCacheBlock]:
        """The table delta: appended entries, or for a running request the entries inserted
        before R (which moves to the new last column)."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        first, end = len(blocks), -(-num_tokens // self.block_size)
        if end <= first:
            return []
        pool, null = self.pool, self.pool.null_block
        spare = self.budget.columns
        running = request_id in self.running
        if running:  # the entries R leaves and passes, first - 1 .. end - 2: checkpoints
            real = [i < spare for i in range(end - first)]
        else:
            skip = self.first_real_block(chunk_start)
            source = self._source_column(chunk_start)
            last = end - 1 if num_tokens > chunk_start else end  # end: no running block yet (a load)
            real = []
            for i in range(first, min(last, end)):
                if i == source:
                    real.append(True)
                elif spare > 0 and i >= skip:
                    real.append(True)
                    spare -= 1
                else:
                    real.append(False)
        num_real = sum(real)
        fresh = iter(pool.get_new_blocks(num_real))
        new = [next(fresh) if r else null for r in real]
        if running:
            blocks[first - 1 : first - 1] = new  # insert before R
        else:
            if num_tokens > chunk_start:
                new.extend(pool.get_new_blocks(1))  # R
                num_real += 1
                self.running.add(request_id)
            nulls = self.num_null_blocks.get(request_id, 0)
            if nulls == first:  # a null prefix grows (blocks below the skip boundary)
                while nulls < first + len(new) and new[nulls - first].is_null:
                    nulls += 1
                self.num_null_blocks[request_id] = nulls
            blocks.extend(new)
        self.num_real_blocks[request_id] = self.num_real_blocks.get(request_id, 0) + num_real
        return new

    def cache_blocks(self, request: Request, num_tokens: int, num_processed_tokens: int) -> None:
        """Checkpoints whose boundary the processed count has passed: the step that
        crossed it (and wrote it) is processed, and the block is not R."""
        n = min(num_tokens, num_processed_tokens - 1)
        if n > 0:
            SingleTypeKVCacheManager.cache_blocks(self, request, n, num_processed_tokens)

    def next_cache_tokens(self, request_id: str) -> float:
        return super().next_cache_tokens(request_id) + 1

    def cache_final(self, request: Request, num_processed_tokens: int) -> None:
        """At a request's finish its block at the last processed boundary is settled: R
        there holds that state (no later step can write R without moving it on), and a
        checkpoint block there was written by the step that reached the boundary (a
        chunk's final state or a verify step's commit: boundaries b in [s, e]) or, when R
        moved on while that step was in flight, is by the step in flight that starts on
        it (b == s), which runs before any step that could read it."""
        SingleTypeKVCacheManager.cache_blocks(self, request, num_processed_tokens, num_processed_tokens)

    def pop(self, request_id: str) -> list[KVCacheBlock]:
        self.running.discard(request_id)
        return super().pop(request_id)


MANAGER_FOR_SPEC: dict[type, type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
    MambaSpec: MambaManager,
}


def make_manager(
    spec: KVCacheSpec, pool: BlockPool, group_id: int, enable_caching: bool, window_tail: WindowTail | None = None
) -> SingleTypeKVCacheManager:
    cls = MANAGER_FOR_SPEC[type(spec)]
    if isinstance(spec, MambaSpec) and spec.block_checkpoints and spec.running_in_place:
        cls = InPlaceMambaManager
    manager = cls(spec, pool, group_id, enable_caching)
    if isinstance(manager, SlidingWindowManager):
        manager.window_tail = window_tail
    return manager
