"""KVCacheManager: the scheduler's whole view of the KV cache.

The rule this class exists to keep: out-of-window blocks are freed on the processed
basis, `max(0, total_computed_tokens - request.num_in_flight_tokens)`, never on the
optimistic count, and before free blocks are counted. Whole-request frees issued while
a step of the request may still be in flight are fenced behind that step.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace

from hybridserve.core.errors import ConfigError
from hybridserve.core.kv.block_pool import BlockPool, KVCacheBlock
from hybridserve.core.kv.coordinator import BlocksPerGroup, KVCacheCoordinator
from hybridserve.core.kv.hashing import make_block_hasher
from hybridserve.core.kv.spec import KVCacheConfig, WindowTail, with_mamba_checkpoints
from hybridserve.core.request import Request

# Best-effort Mamba checkpoints never take the last this share of the pool's blocks: a
# step's required blocks (running states, attention slots) come first (InPlaceMambaManager).
CHECKPOINT_FREE_SHARE = 0.05

# A limit no token count reaches: the steady-decode limits are ints (not float("inf")),
# so the per-step comparisons stay int-to-int.
NEVER = 1 << 62


class SteadyDecode:
    """A request's limits below which `allocate_slots` has nothing to do (set after each
    allocation, dropped whenever its tables change by another way).

    slot_end: tokens its tables have slots for (at most max_model_len); free_basis: the
    processed count at which pruning frees a block; cache_end: the token count at which a
    block fills and is published; decode_end = min(slot_end, free_basis, cache_end - 1),
    below which any decode is steady (see `append_decode_slot`); num_null_blocks: each
    group's null-prefix length, what a steady step reports to the executor.
    """

    __slots__ = ("decode_end", "slot_end", "free_basis", "cache_end", "num_null_blocks")

    def __init__(self, slot_end: int, free_basis: int, cache_end: int, num_null_blocks: tuple[int, ...]) -> None:
        self.slot_end = slot_end
        self.free_basis = free_basis
        self.cache_end = cache_end
        self.decode_end = min(slot_end, free_basis, cache_end - 1)
        self.num_null_blocks = num_null_blocks

    def covers(self, num_tokens_need_slot: int, basis: int, num_cacheable: int) -> bool:
        """Slots suffice, pruning on this basis frees nothing, and no block fills."""
        return num_tokens_need_slot <= self.slot_end and basis < self.free_basis and num_cacheable < self.cache_end


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
        window_tail: WindowTail | None = None,
        in_flight: WindowTail | None = None,
        keep_last_checkpoint: bool = True,
        prefix_cache_retention: float = 1.0,
    ) -> None:
        """in_flight: the scheduler's steps and drafts in flight (SchedulerConfig.window_tail,
        whether or not window-tail allocation is on); with it Mamba states stay in place
        (checkpoints are best-effort), and a request holds the last whole checkpoint only
        if keep_last_checkpoint (a KV connector is attached). prefix_cache_retention: the
        share of the pool's blocks that freed cached blocks keep before never-used blocks
        are handed out (block_pool.FreeBlocks; 1.0 keeps every cached block)."""
        if enable_caching:  # Mamba groups then keep state checkpoints, so prefixes can hit
            groups = with_mamba_checkpoints(kv_cache_config.groups, in_flight, keep_last_checkpoint)
            kv_cache_config = replace(kv_cache_config, groups=groups)
        need = kv_cache_config.min_num_blocks(max_in_flight_tokens, max_model_len, window_tail)
        if kv_cache_config.num_blocks < need:
            raise ConfigError(
                f"num_blocks={kv_cache_config.num_blocks} cannot hold one request of max_model_len="
                f"{max_model_len} with {max_in_flight_tokens} tokens in flight; need at least {need}"
            )
        self.config = kv_cache_config
        # Each group's admission cap: what a request's held blocks are counted against.
        self.caps = [g.spec.max_admission_blocks_per_request(max_in_flight_tokens, max_model_len, window_tail)
                     for g in kv_cache_config.groups]
        # Best-effort Mamba checkpoints leave this many blocks free for the steps' own needs.
        self.checkpoint_floor = int(CHECKPOINT_FREE_SHARE * (kv_cache_config.num_blocks - 1))
        self.block_size = kv_cache_config.block_size
        self.max_model_len = max_model_len
        self.max_in_flight_tokens = max_in_flight_tokens
        self.enable_caching = enable_caching
        # Research switch: free on the optimistic count (the bug this engine avoids).
        self.unsafe_optimistic_free = unsafe_optimistic_free
        self.pool = BlockPool(kv_cache_config.num_blocks, enable_caching,
                              retained_cached_blocks=int(prefix_cache_retention * (kv_cache_config.num_blocks - 1)))
        # Window-tail allocation (sliding groups hold the window and chunk tails only).
        self.window_tail = window_tail
        self.coordinator = KVCacheCoordinator(kv_cache_config.groups, self.pool, enable_caching, window_tail)
        self.block_hasher = make_block_hasher(self.block_size)
        self.prefix_cache_stats = PrefixCacheStats()
        # Heap of (fence step, seq, blocks tail first): freed once the fence is processed.
        self.fenced: list[tuple[int, int, list[KVCacheBlock]]] = []
        self._fence_seq = 0
        self.last_processed_step = -1
        self.no_new_blocks: BlocksPerGroup = [[] for _ in kv_cache_config.groups]
        # Per request: the limits below which allocate_slots has nothing to do.
        self._steady: dict[str, SteadyDecode] = {}
        # What each request holding blocks may still take before its peak (per group up to
        # its cap, over the coordinator's leaders), and their sum, which best-effort Mamba
        # checkpoints leave free: they never starve a request's own next chunk (it would
        # preempt itself and take them all again) nor full-sequence admission's promise.
        self._leader_caps = [self.caps[self.coordinator.managers.index(m)] for m in self.coordinator.leader_managers]
        self._peaks_of: dict[str, list[int]] = {}
        self._outstanding: dict[str, int] = {}
        self.total_outstanding = 0

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

        At least the last prompt token is always recomputed, so its logits exist. A request
        that asks for prompt logprobs hits nothing: each position it skipped would lack its
        logits.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return self.coordinator.empty(), 0
        return self.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (not the retries of a blocked one)."""
        self.prefix_cache_stats.queries += num_tokens
        self.prefix_cache_stats.hits += num_hit_tokens

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
        num_reserved_blocks: int = 0,
    ) -> BlocksPerGroup | None:
        """Give the request slots for num_new_tokens (+ lookahead) more tokens.

        Returns the newly allocated blocks per group, or None if they do not fit; a None
        changes nothing beyond freeing out-of-window blocks on the processed basis.
        With full_sequence_must_fit, the request's peak by the admission caps must fit in
        the free blocks left after `num_reserved_blocks` (what admitted requests will
        still grow by, see `outstanding_blocks`).
        """
        rid = request.request_id
        mml = self.max_model_len
        total_computed = request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens
        if total_computed > mml:
            total_computed = mml
        num_tokens_need_slot = total_computed + num_new_tokens + num_lookahead_tokens
        if num_tokens_need_slot > mml:
            num_tokens_need_slot = mml
        if self.unsafe_optimistic_free:
            basis = total_computed
        else:
            basis = total_computed - request.num_in_flight_tokens
            if basis < 0:
                basis = 0

        steady = self._steady.get(rid)
        if steady is not None and new_computed_blocks is None:
            # Caching is due only when a block fills up with known tokens.
            cacheable = len(request.prompt_token_ids) + len(request.output_token_ids)
            if total_computed + num_new_tokens < cacheable:
                cacheable = total_computed + num_new_tokens
            if steady.covers(num_tokens_need_slot, basis, -1 if delay_cache_blocks else cacheable):
                return self.no_new_blocks
        self._forget(rid)
        result = self._allocate_slots(
            request, total_computed, num_new_tokens, num_tokens_need_slot, basis, new_computed_blocks,
            delay_cache_blocks, full_sequence_must_fit, num_reserved_blocks,
        )
        if result is not None or rid in self._peaks_of:  # blocks taken, or pruned
            self._track(request)
        if result is not None:
            slots, frees, caches = [x if x < NEVER else NEVER for x in self.coordinator.slack(rid)]
            nulls = tuple([m.num_null_blocks.get(rid, 0) for m in self.coordinator.managers])
            # Slots at or past max_model_len are never asked for (num_tokens_need_slot is capped).
            slots = min(slots, mml)
            self._steady[rid] = SteadyDecode(slots, frees, caches, nulls)
        return result

    def append_decode_slot(self, request: Request) -> tuple[int, ...] | None:
        """`allocate_slots(request, 1)` for a decode that needs no new block, frees nothing
        and fills no block (most steps of a long decode): returns the request's null-block
        counts; None means "call allocate_slots" (the same checks as its fast path).

        Below the decode end one comparison decides: the processed basis never exceeds
        computed and min(cacheable, computed + 1) never exceeds computed + 1, so computed <
        min(slot limit, free limit, cache limit - 1) implies the exact checks below, which
        run only near a limit.
        """
        steady = self._steady.get(request.request_id)
        if steady is None:
            return None
        computed = request.num_computed_tokens
        if computed < steady.decode_end:
            return steady.num_null_blocks
        basis = computed if self.unsafe_optimistic_free else computed - request.num_in_flight_tokens
        cacheable = len(request.prompt_token_ids) + len(request.output_token_ids)
        if steady.covers(computed + 1, basis if basis > 0 else 0, cacheable if cacheable <= computed else computed + 1):
            return steady.num_null_blocks
        return None

    def _allocate_slots(
        self,
        request: Request,
        total_computed: int,
        num_new_tokens: int,
        num_tokens_need_slot: int,
        basis: int,
        new_computed_blocks: BlocksPerGroup | None,
        delay_cache_blocks: bool,
        full_sequence_must_fit: bool,
        num_reserved_blocks: int,
    ) -> BlocksPerGroup | None:
        rid = request.request_id
        managers = self.coordinator.managers
        processed = total_computed - request.num_in_flight_tokens  # basis, unless unsafe
        if processed < 0:
            processed = 0
        if self.enable_caching and not delay_cache_blocks and new_computed_blocks is None:
            # Publish blocks filled since the last allocation before pruning nulls them: a
            # spec-decode step fills a block past the known tokens, so it becomes cacheable
            # only once the next token is known, when it may already be out of window.
            self.coordinator.cache_blocks(request, min(total_computed, request.num_tokens), processed)
        for m in managers:
            m.remove_skipped_blocks(rid, basis)

        hits = new_computed_blocks
        if hits is not None:
            hits = self.coordinator.drop_unread_hits(hits, total_computed)
        num_needed = 0
        if hits is None and not full_sequence_must_fit:  # a running request: the common, cheap path
            num_needed = self.coordinator.num_blocks_to_allocate(rid, num_tokens_need_slot, total_computed)
        else:
            needs = [m.get_num_blocks_to_allocate(rid, num_tokens_need_slot, group_hits, total_computed)
                     for m, group_hits in zip(managers, hits or [()] * len(managers))]
            num_needed = sum(needs)
        num_free = self.pool.num_free_blocks
        if num_needed > num_free:
            return None
        if full_sequence_must_fit and self._growth_after(request, hits, needs) + num_needed + num_reserved_blocks > num_free:
            return None

        if hits is not None:
            for group_hits in hits:
                self.pool.touch(group_hits)
            self.coordinator.save_new_computed_blocks(rid, hits)
        if self.coordinator.in_place:
            # Best-effort Mamba checkpoints: only blocks beyond what this allocation needs,
            # what admitted requests are reserved, and the free share kept for steps.
            # A checkpoint column costs a block in every such group (they decide alike:
            # a hit needs every group, every page of a state).
            self._track(request)  # its own growth counts too (before this allocation: conservative)
            reserve = max(num_reserved_blocks, self.checkpoint_floor, self.total_outstanding)
            spare = (num_free - num_needed - reserve) // len(self.coordinator.in_place)
            self.coordinator.checkpoint_budget.columns = spare if spare > 0 else 0
        new_blocks = self.coordinator.allocate_new_blocks(rid, num_tokens_need_slot, total_computed)
        if self.enable_caching and not delay_cache_blocks:
            self.coordinator.cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens), processed)
        return new_blocks

    def _track(self, request: Request) -> None:
        """Refresh what the request may still take before its peak (see total_outstanding)."""
        rid = request.request_id
        peaks = self._peaks_of.get(rid)
        if peaks is None:
            n = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
            peaks = self._peaks_of[rid] = [min(m.num_required_blocks(n), cap) for m, cap in
                                           zip(self.coordinator.leader_managers, self._leader_caps)]
        self._set_outstanding(rid, peaks)

    def _set_outstanding(self, rid: str, peaks: list[int]) -> None:
        left = 0
        for (m, weight), peak in zip(self.coordinator.leaders, peaks):
            held = m.num_real_blocks.get(rid, 0)
            if held < peak:  # peak <= cap: blocks past the cap (best-effort) never count
                left += weight * (peak - held)
        self.total_outstanding += left - self._outstanding.get(rid, 0)
        self._outstanding[rid] = left

    def peak_blocks(self, request: Request) -> int:
        """Blocks the request holds at its peak (prompt + max_tokens), by the admission caps."""
        return sum(self._peaks(request))

    def _peaks(self, request: Request) -> list[int]:
        n = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
        return [min(m.num_required_blocks(n), cap) for m, cap in zip(self.coordinator.managers, self.caps)]

    def _growth_after(self, request: Request, hits: BlocksPerGroup | None, needs: list[int]) -> int:
        """Blocks the request may still take past this allocation, to its peak: per group
        the peak less what it will hold, counted up to the cap (its blocks, the non-null
        hits and the new blocks; a Mamba hit's source held beside the running state is a
        block past the cap, not growth).

        With attention groups only this is the peak less held blocks less all hits less
        new blocks, so with `needs` added back: peak - held - shared hits."""
        rid = request.request_id
        total = 0
        for m, cap, peak, need, group_hits in zip(self.coordinator.managers, self.caps, self._peaks(request), needs,
                                                  hits or [()] * len(needs)):
            real_hits = [b for b in group_hits if not b.is_null]
            new = need - sum(1 for b in real_hits if b.ref_cnt == 0)
            held = m.num_real_blocks.get(rid, 0) + len(real_hits) + new
            total += max(0, peak - min(held, cap))
        return total

    def outstanding_blocks(self, requests: list[Request]) -> int:
        """How many more blocks these requests may still take before their peaks (blocks
        held beyond a group's cap, best-effort checkpoints, do not count as taken)."""
        managers = self.coordinator.managers
        total = 0
        for r in requests:
            rid = r.request_id
            total += sum(max(0, peak - min(m.num_real_blocks.get(rid, 0), cap))
                         for m, cap, peak in zip(managers, self.caps, self._peaks(r)))
        return total

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int) -> None:
        self._forget(request_id)
        self.coordinator.remove_skipped_blocks(request_id, processed_computed_tokens)
        peaks = self._peaks_of.get(request_id)
        if peaks is not None:
            self._set_outstanding(request_id, peaks)

    def cache_blocks(self, request: Request, num_processed_tokens: int, final: bool = False) -> None:
        """Publish the full blocks below a count whose steps are all processed (final: the
        request finishes there, so an in-place Mamba group's block at that boundary is
        settled too, see InPlaceMambaManager.cache_final)."""
        if self.enable_caching:
            self._forget(request.request_id)
            self.coordinator.cache_blocks(request, num_processed_tokens, num_processed_tokens)
            if final:
                for m in self.coordinator.in_place:
                    m.cache_final(request, num_processed_tokens)

    def _forget(self, request_id: str) -> None:
        self._steady.pop(request_id, None)

    def init_request(self, request: Request) -> None:
        """Give a new request its block hasher (hashes cover known tokens only)."""
        if self.enable_caching:
            request.set_block_hasher(self.block_hasher)

    # -- freeing -------------------------------------------------------------
    def done_growing(self, request_id: str) -> None:
        """The request takes no more blocks (finished; its blocks may stay for a store)."""
        self._peaks_of.pop(request_id, None)
        self.total_outstanding -= self._outstanding.pop(request_id, 0)

    def free(self, request: Request, fence_step: int | None = None) -> None:
        """Detach the request's tables now; return its blocks once `fence_step` is processed."""
        self._forget(request.request_id)
        self.done_growing(request.request_id)
        blocks = self.coordinator.pop(request.request_id)
        if not blocks:
            return
        if fence_step is None or fence_step <= self.last_processed_step:
            self.pool.free_blocks(blocks)
        else:
            self._fence_seq += 1
            heapq.heappush(self.fenced, (fence_step, self._fence_seq, blocks))

    def step_processed(self, step_id: int) -> None:
        """Steps are processed in order: release every fenced free up to this step."""
        self.last_processed_step = step_id
        while self.fenced and self.fenced[0][0] <= step_id:
            self.pool.free_blocks(heapq.heappop(self.fenced)[2])

    def holds_blocks(self, request_id: str) -> bool:
        return request_id in self.coordinator.managers[0].req_to_blocks

    @property
    def num_requests_holding_blocks(self) -> int:
        return len(self.coordinator.managers[0].req_to_blocks)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.coordinator.get_block_ids(request_id)

    def get_num_null_blocks(self, request_id: str) -> tuple[int, ...]:
        steady = self._steady.get(request_id)
        if steady is not None:
            return steady.num_null_blocks
        return tuple([m.num_null_blocks.get(request_id, 0) for m in self.coordinator.managers])

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
