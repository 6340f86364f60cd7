"""Fans KV operations out over the groups of a hybrid model, and agrees on prefix hits."""

from __future__ import annotations

from hybridserve.core.kv.block_pool import BlockPool, KVCacheBlock
from hybridserve.core.kv.single_type_managers import (
    CheckpointBudget, FullAttentionManager, InPlaceMambaManager, SingleTypeKVCacheManager, make_manager,
)
from hybridserve.core.kv.spec import KVCacheGroup, MambaSpec, WindowTail
from hybridserve.core.request import Request

BlocksPerGroup = list[list[KVCacheBlock]]


class KVCacheCoordinator:
    # Page groups 1.. of a paged Mamba state get exactly the calls page 0 gets (a hit too:
    # every group must agree on its length), so their tables keep page 0's shape: the
    # per-request limits and a running request's block count are computed over page 0
    # alone (weighted by its page count). Tests turn it off to compare with all groups.
    mirror_fast_path = True

    def __init__(
        self,
        groups: tuple[KVCacheGroup, ...],
        pool: BlockPool,
        enable_caching: bool,
        window_tail: WindowTail | None = None,
    ) -> None:
        self.groups = groups
        self.pool = pool
        self.block_size = groups[0].spec.block_size
        self.managers: list[SingleTypeKVCacheManager] = [
            make_manager(g.spec, pool, i, enable_caching, window_tail) for i, g in enumerate(groups)
        ]
        # Mamba groups keeping their running state in place (their checkpoints are best-effort),
        # sharing one checkpoint budget.
        self.in_place = [m for m in self.managers if isinstance(m, InPlaceMambaManager)]
        self.checkpoint_budget = CheckpointBudget()
        for m in self.in_place:
            m.budget = self.checkpoint_budget
        # (group, how many groups it stands for): every group but Mamba pages 1.., which
        # mirror their page 0 (see mirror_fast_path).
        self.leaders = [(m, m.spec.num_pages if isinstance(m.spec, MambaSpec) else 1)
                        for m in self.managers if not (isinstance(m.spec, MambaSpec) and m.spec.page_index > 0)]
        self.leader_managers = [m for m, _ in self.leaders]
        # Full attention first: it is the most selective, so later groups search short.
        self.search_order = sorted(
            range(len(groups)), key=lambda i: not isinstance(self.managers[i], FullAttentionManager)
        )

    def empty(self) -> BlocksPerGroup:
        return [[] for _ in self.managers]

    def find_longest_cache_hit(self, block_hashes: list[int], max_length: int) -> tuple[BlocksPerGroup, int]:
        """The longest prefix every group can serve: shrink until no group shrinks it."""
        candidate = (max_length // self.block_size) * self.block_size
        hits = self.empty()
        while True:
            shrunk = False
            for i in self.search_order:
                hit = self.managers[i].find_longest_cache_hit(block_hashes, candidate)
                hits[i] = hit
                length = len(hit) * self.block_size
                if length < candidate:
                    candidate = length
                    shrunk = True
            if not shrunk:
                return hits, candidate

    def drop_unread_hits(self, hits: BlocksPerGroup, first_computed: int) -> BlocksPerGroup:
        """The hits with the null block wherever the request's first computed token never
        reads: below each group's skip boundary at first_computed. Without a connector
        load that is where the hit has nulls already; a load past the hit moves the
        boundary (its end supersedes a Mamba hit's checkpoint, and a window's oldest hit
        blocks fall out of the loaded end's window), and those hits would otherwise be held
        beside the loaded blocks, past the group's admission cap."""
        null = self.pool.null_block
        out: BlocksPerGroup = []
        for m, group_hits in zip(self.managers, hits):
            first = min(m.first_real_block(first_computed), len(group_hits))
            if first and any(not b.is_null for b in group_hits[:first]):
                group_hits = [null] * first + list(group_hits[first:])
            out.append(group_hits)
        return out

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: BlocksPerGroup) -> None:
        for i, m in enumerate(self.managers):
            m.save_new_computed_blocks(request_id, new_computed_blocks[i])

    def allocate_new_blocks(self, request_id: str, num_tokens: int, chunk_start: int = 0) -> BlocksPerGroup:
        return [m.allocate_new_blocks(request_id, num_tokens, chunk_start) for m in self.managers]

    def cache_blocks(self, request: Request, num_tokens: int, num_processed_tokens: int) -> None:
        for m in self.managers:
            m.cache_blocks(request, num_tokens, num_processed_tokens)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int) -> None:
        for m in self.managers:
            m.remove_skipped_blocks(request_id, processed_computed_tokens)

    def pop(self, request_id: str) -> list[KVCacheBlock]:
        """Detach the request from every group; its real blocks, each group tail first."""
        out: list[KVCacheBlock] = []
        for m in self.managers:
            out.extend(m.pop(request_id))
        return out

    def full_sequence_blocks(
        self, num_tokens: int, max_in_flight_tokens: int, max_model_len: int, window_tail: WindowTail | None = None
    ) -> int:
        """Blocks a request of num_tokens tokens holds at its peak, by the admission caps."""
        total = 0
        for m in self.managers:
            cap = m.spec.max_admission_blocks_per_request(max_in_flight_tokens, max_model_len, window_tail)
            total += min(m.num_required_blocks(num_tokens), cap)
        return total

    def num_blocks_to_allocate(self, request_id: str, num_tokens: int, chunk_start: int) -> int:
        """Blocks a running request (no new hits) takes from the pool for num_tokens slots."""
        if self.mirror_fast_path:
            return sum([w * m.get_num_blocks_to_allocate(request_id, num_tokens, (), chunk_start)
                        for m, w in self.leaders])
        return sum([m.get_num_blocks_to_allocate(request_id, num_tokens, (), chunk_start) for m in self.managers])

    def slack(self, request_id: str) -> tuple[float, float, float]:
        """(tokens with slots, processed count that frees a block, tokens that cache a block)."""
        inf = float("inf")
        slots = frees = caches = inf
        managers = self.leader_managers if self.mirror_fast_path else self.managers
        for m in managers:  # a plain loop: generator min()s cost more than the work
            slots = min(slots, m.num_covered_tokens(request_id))
            frees = min(frees, m.next_free_basis(request_id))
            caches = min(caches, m.next_cache_tokens(request_id))
        return slots, frees, caches

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in m.req_to_blocks.get(request_id, ())] for m in self.managers)
