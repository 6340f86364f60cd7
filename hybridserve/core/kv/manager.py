"""KVCacheManager: the scheduler's whole view of the KV cache.

The rule this class exists to keep: out-of-window blocks are freed on the processed
basis, `max(0, total_computed_tokens - request.num_in_flight_tokens)`, never on the
optimistic count, and before free blocks are counted. Whole-request frees issued while
a step of the request may still be in flight are fenced behind that step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hybridserve.core.errors import ConfigError
from hybridserve.core.kv.block_pool import BlockPool, KVCacheBlock
from hybridserve.core.kv.coordinator import BlocksPerGroup, KVCacheCoordinator
from hybridserve.core.kv.hashing import make_block_hasher
from hybridserve.core.kv.spec import KVCacheConfig
from hybridserve.core.request import Request


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_in_flight_tokens: int,
        enable_caching: bool = True,
        unsafe_optimistic_free: bool = False,
    ) -> None:
        need = kv_cache_config.min_num_blocks(max_in_flight_tokens, max_model_len)
        if kv_cache_config.num_blocks < need:
            raise ConfigError(
                f"num_blocks={kv_cache_config.num_blocks} cannot hold one request of max_model_len="
                f"{max_model_len} with {max_in_flight_tokens} tokens in flight; need at least {need}"
            )
        self.config = kv_cache_config
        self.block_size = kv_cache_config.block_size
        self.max_model_len = max_model_len
        self.max_in_flight_tokens = max_in_flight_tokens
        self.enable_caching = enable_caching
        # Research switch: free on the optimistic count (the bug this engine avoids).
        self.unsafe_optimistic_free = unsafe_optimistic_free
        self.pool = BlockPool(kv_cache_config.num_blocks, enable_caching)
        self.coordinator = KVCacheCoordinator(kv_cache_config.groups, self.pool, enable_caching)
        self.block_hasher = make_block_hasher(self.block_size)
        self.prefix_cache_stats = PrefixCacheStats()
        # (fence step, blocks tail first): freed once every step up to the fence is processed.
        self.fenced: deque[tuple[int, list[KVCacheBlock]]] = deque()
        self.last_processed_step = -1

    @property
    def num_groups(self) -> int:
        return len(self.coordinator.managers)

    @property
    def usage(self) -> float:
        return self.pool.usage

    def group_usage(self) -> list[float]:
        """Fraction of allocatable blocks each group's tables hold (fenced blocks excluded)."""
        total = self.pool.num_blocks - 1
        return [
            sum(1 for blocks in m.req_to_blocks.values() for b in blocks if not b.is_null) / total
            for m in self.coordinator.managers
        ]

    # -- prefix hits -------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[BlocksPerGroup, int]:
        """Blocks of the longest cached prefix and its length in tokens.

        At least the last prompt token is always recomputed, so its logits exist.
        """
        if not self.enable_caching:
            return self.coordinator.empty(), 0
        hits, length = self.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += length
        return hits, length

    # -- allocation --------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: BlocksPerGroup | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        full_sequence_must_fit: bool = False,
    ) -> BlocksPerGroup | None:
        """Give the request slots for num_new_tokens (+ lookahead) more tokens.

        Returns the newly allocated blocks per group, or None if they do not fit; a None
        changes nothing beyond freeing out-of-window blocks on the processed basis.
        """
        rid = request.request_id
        hits = new_computed_blocks if new_computed_blocks is not None else self.coordinator.empty()
        total_computed = min(
            request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens,
            self.max_model_len,
        )
        num_tokens_need_slot = min(total_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)

        basis = total_computed if self.unsafe_optimistic_free else max(0, total_computed - request.num_in_flight_tokens)
        self.coordinator.remove_skipped_blocks(rid, basis)

        num_needed = self.coordinator.get_num_blocks_to_allocate(rid, num_tokens_need_slot, hits)
        num_free = self.pool.num_free_blocks
        if num_needed > num_free:
            return None
        if full_sequence_must_fit:
            n = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
            peak = self.coordinator.full_sequence_blocks(n, self.max_in_flight_tokens, self.max_model_len)
            shared_hits = sum(1 for g in hits for b in g if b.ref_cnt > 0 and not b.is_null)
            if peak - shared_hits > num_free:
                return None

        for group_hits in hits:
            self.pool.touch(group_hits)
        self.coordinator.save_new_computed_blocks(rid, hits)
        new_blocks = self.coordinator.allocate_new_blocks(rid, num_tokens_need_slot)
        if self.enable_caching and not delay_cache_blocks:
            self.coordinator.cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int) -> None:
        self.coordinator.remove_skipped_blocks(request_id, processed_computed_tokens)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def init_request(self, request: Request) -> None:
        """Give a new request its block hasher (hashes cover known tokens only)."""
        if self.enable_caching:
            request.set_block_hasher(self.block_hasher)

    # -- freeing -------------------------------------------------------------
    def free(self, request: Request, fence_step: int | None = None) -> None:
        """Detach the request's tables now; return its blocks once `fence_step` is processed."""
        blocks = self.coordinator.pop(request.request_id)
        if not blocks:
            return
        if fence_step is None or fence_step <= self.last_processed_step:
            self.pool.free_blocks(blocks)
        else:
            self.fenced.append((fence_step, blocks))

    def step_processed(self, step_id: int) -> None:
        """Steps are processed in order: release every fenced free up to this step."""
        self.last_processed_step = step_id
        while self.fenced and self.fenced[0][0] <= step_id:
            self.pool.free_blocks(self.fenced.popleft()[1])

    def holds_blocks(self, request_id: str) -> bool:
        return request_id in self.coordinator.managers[0].req_to_blocks

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.coordinator.get_block_ids(request_id)

    def get_num_null_blocks(self, request_id: str) -> tuple[int, ...]:
        return tuple(m.num_null_blocks.get(request_id, 0) for m in self.coordinator.managers)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
