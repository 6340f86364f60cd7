"""Property tests: random KVCacheManager traffic keeps the pool's books exact.

The state machine drives a hybrid manager (full + sliding window, optionally chunked local)
over a small pool with requests built from a few shared prefixes, so prefix hits, shared
blocks, evictions, fenced frees and out-of-pool refusals all happen. After every step it
recounts every block from scratch and compares with the pool's own bookkeeping.
"""

from __future__ import annotations

from collections import Counter, deque

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hybridserve.core.kv.cache_manager import KVCacheManager
from hybridserve.core.kv.spec import ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from hybridserve.core.request import Request, SamplingParams
from hybridserve.testing import make_kv_cache_config

BS = 4
MAX_MODEL_LEN = 48
MAX_IN_FLIGHT = 8
# Three shared prefixes of 4 blocks each: prompts take a slice of one, then a short suffix.
PREFIXES = [tuple(range(100 * i + 1, 100 * i + 17)) for i in range(3)]


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv: KVCacheManager | None = None
        self.live: dict[str, Request] = {}
        self.next_id = 0
        self.step = 0  # id of the step being filled
        self.open_step: list[tuple[str, int]] = []
        self.sealed: deque[tuple[int, list[tuple[str, int]]]] = deque()

    # -- setup ------------------------------------------------------------------
    @initialize(chunked=st.booleans(), window=st.sampled_from([3, 6, 9]), spare=st.integers(0, 24))
    def setup(self, chunked: bool, window: int, spare: int) -> None:
        specs: list[KVCacheSpec] = [FullAttentionSpec(BS, 1, 8), SlidingWindowSpec(BS, 1, 8, sliding_window=window)]
        if chunked:
            specs.append(ChunkedLocalAttentionSpec(BS, 1, 8, attention_chunk_size=8))
        need = make_kv_cache_config(2, specs, BS).min_num_blocks(MAX_IN_FLIGHT, MAX_MODEL_LEN)
        self.kv = KVCacheManager(make_kv_cache_config(need + spare, specs, BS), MAX_MODEL_LEN, MAX_IN_FLIGHT)

    # -- helpers ------------------------------------------------------------------
    def pick(self, index: int) -> Request:
        return self.live[sorted(self.live)[index % len(self.live)]]

    def snapshot(self) -> tuple[object, ...]:
        kv = self.kv
        assert kv is not None
        return (
            [b.ref_cnt for b in kv.pool.blocks],
            [b.block_id for b in kv.pool.free_queue],
            {k: sorted(v) for k, v in kv.pool.cached.items()},
            [{rid: [b.block_id for b in t] for rid, t in m.req_to_blocks.items()} for m in kv.coordinator.managers],
        )

    def allocate(self, r: Request, n: int, **kw: object) -> bool:
        kv = self.kv
        assert kv is not None
        before = self.snapshot()
        got = kv.allocate_slots(r, n, **kw)  # type: ignore[arg-type]
        if got is None:
            assert self.snapshot() == before, "a refused allocation changed the pool"
            return False
        r.num_computed_tokens += n + int(kw.get("num_new_computed_tokens", 0))  # type: ignore[call-overload]
        r.num_in_flight_tokens += n
        r.last_scheduled_step = self.step
        self.open_step.append((r.request_id, n))
        return True

    # -- rules ------------------------------------------------------------------
    @precondition(lambda self: self.kv is not None)
    @rule(
        prefix=st.integers(0, 2),
        prefix_len=st.sampled_from([0, 3, 4, 8, 12, 16, 16, 16]),
        suffix_len=st.integers(1, 10),
        salted=st.sampled_from([False, False, False, True]),
        chunk=st.integers(1, MAX_IN_FLIGHT),
    )
    def add_request(self, prefix: int, prefix_len: int, suffix_len: int, salted: bool, chunk: int) -> None:
        kv = self.kv
        assert kv is not None
        rid = f"r{self.next_id}"
        self.next_id += 1
        suffix = [10_000 + self.next_id * 16 + j for j in range(suffix_len)]
        r = Request(
            rid,
            list(PREFIXES[prefix][:prefix_len]) + suffix,
            SamplingParams(max_tokens=MAX_MODEL_LEN),
            cache_salt="s" if salted else None,
        )
        kv.init_request(r)
        hits, num_hit = kv.get_computed_blocks(r)
        assert num_hit % BS == 0 and num_hit < r.num_tokens
        assert all(len(g) * BS == num_hit for g in hits if g) or num_hit == 0
        n = min(chunk, r.num_tokens - num_hit)
        if self.allocate(r, n, num_new_computed_tokens=num_hit, new_computed_blocks=hits):
            self.live[rid] = r
        else:
            assert not kv.holds_blocks(rid)

    @precondition(lambda self: self.kv is not None and self.live)
    @rule(index=st.integers(0, 99), n=st.integers(1, 6), lookahead=st.integers(0, 2))
    def schedule(self, index: int, n: int, lookahead: int) -> None:
        kv = self.kv
        assert kv is not None
        r = self.pick(index)
        room = MAX_MODEL_LEN - r.num_computed_tokens
        if room <= 1 or r.num_in_flight_tokens >= MAX_IN_FLIGHT:
            return
        left = r.num_prompt_tokens - r.num_computed_tokens
        n = min(n, left) if left > 0 else 1
        # Prune first so the allocation's own (identical) prune is a no-op and a refusal
        # must leave the snapshot exactly as it was.
        kv.remove_skipped_blocks(r.request_id, r.num_processed_tokens)
        self.allocate(r, min(n, room), num_lookahead_tokens=lookahead)

    @precondition(lambda self: self.kv is not None and self.open_step)
    @rule()
    def seal_step(self) -> None:
        self.sealed.append((self.step, self.open_step))
        self.open_step = []
        self.step += 1

    @precondition(lambda self: self.kv is not None and self.sealed)
    @rule()
    def process_step(self) -> None:
        kv = self.kv
        assert kv is not None
        step_id, entries = self.sealed.popleft()
        for rid, n in entries:
            r = self.live.get(rid)
            if r is None:
                continue  # freed (fenced) while in flight
            r.num_in_flight_tokens -= n
            processed = r.num_processed_tokens
            if processed >= r.num_prompt_tokens and processed + 1 > r.num_tokens:
                r.append_output_token_ids([7] * (processed + 1 - r.num_tokens))
            kv.remove_skipped_blocks(rid, processed)
        kv.step_processed(step_id)

    @precondition(lambda self: self.kv is not None and self.live)
    @rule(index=st.integers(0, 99), fenced=st.booleans())
    def free(self, index: int, fenced: bool) -> None:
        kv = self.kv
        assert kv is not None
        r = self.live.pop(self.pick(index).request_id)
        kv.free(r, fence_step=r.last_scheduled_step if fenced else None)
        assert not kv.holds_blocks(r.request_id)

    @precondition(lambda self: self.kv is not None and self.live)
    @rule(index=st.integers(0, 99), fraction=st.floats(0, 1))
    def prune(self, index: int, fraction: float) -> None:
        kv = self.kv
        assert kv is not None
        r = self.pick(index)
        kv.remove_skipped_blocks(r.request_id, int(r.num_processed_tokens * fraction))

    @precondition(lambda self: self.kv is not None and self.live)
    @rule(index=st.integers(0, 99), fraction=st.floats(0, 1))
    def cache(self, index: int, fraction: float) -> None:
        kv = self.kv
        assert kv is not None
        r = self.pick(index)
        kv.cache_blocks(r, int(min(r.num_computed_tokens, r.num_tokens) * fraction))

    @precondition(lambda self: self.kv is not None)
    @rule()
    def reset_prefix_cache(self) -> None:
        kv = self.kv
        assert kv is not None
        idle = kv.pool.num_free_blocks == kv.pool.num_blocks - 1
        assert kv.reset_prefix_cache() is idle
        if idle:
            assert not kv.pool.cached

    # -- invariants -------------------------------------------------------------
    @invariant()
    def books_balance(self) -> None:
        kv = self.kv
        if kv is None:
            return
        pool = kv.pool
        holders: Counter[int] = Counter()
        for m in kv.coordinator.managers:
            for rid, table in m.req_to_blocks.items():
                nulls = sum(1 for b in table if b.is_null)
                assert all(b.is_null for b in table[:nulls]), f"{rid}: nulls are not a prefix"
                assert m.num_null_blocks.get(rid, 0) == nulls, f"{rid}: null-prefix count drifted"
                assert m.num_real_blocks.get(rid, 0) == len(table) - nulls, f"{rid}: real-block count drifted"
                holders.update(b.block_id for b in table if not b.is_null)
        for entry in kv.fenced:  # (fence step, ..., blocks): the blocks come last
            holders.update(b.block_id for b in entry[-1])
        queue = [b.block_id for b in pool.free_queue]
        in_queue = set(queue)
        assert len(queue) == len(in_queue) == pool.num_free_blocks
        assert 0 not in in_queue and 0 not in holders
        null = pool.null_block
        assert null.ref_cnt == 0 and null.cache_key is None
        used = 0
        for b in pool.blocks[1:]:
            assert b.ref_cnt == holders[b.block_id], f"block {b.block_id}: ref {b.ref_cnt} != holders"
            assert (b.ref_cnt == 0) == (b.block_id in in_queue), f"block {b.block_id} neither free nor held"
            used += b.ref_cnt > 0
            if b.cache_key is not None:
                assert pool.cached[b.cache_key][b.block_id] is b
        assert pool.num_free_blocks + used == pool.num_blocks - 1
        assert pool.num_shared_blocks == sum(1 for b in pool.blocks if b.ref_cnt > 1)
        for key, entry in pool.cached.items():
            assert entry, f"empty cache entry for {key}"
            assert all(b.cache_key == key and b.block_id == bid for bid, b in entry.items())

    @invariant()
    def counters_are_sane(self) -> None:
        for r in self.live.values():
            assert 0 <= r.num_in_flight_tokens <= r.num_computed_tokens <= MAX_MODEL_LEN


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# -- admission caps hold for every geometry ------------------------------------------


@settings(max_examples=80, deadline=None)
@given(
    kind=st.sampled_from(["sliding", "chunked"]),
    size=st.integers(1, 40),
    bs=st.sampled_from([1, 2, 4, 8, 16]),
    chunk=st.integers(1, 12),
    steps_in_flight=st.integers(1, 3),
    prompt_len=st.integers(1, 80),
)
def test_held_blocks_never_exceed_the_admission_cap(
    kind: str, size: int, bs: int, chunk: int, steps_in_flight: int, prompt_len: int
) -> None:
    """Chunked prefill then decode, up to `steps_in_flight` steps outstanding: every group
    holds at most max_admission_blocks_per_request(steps_in_flight * chunk, max_model_len)."""
    max_len = 96
    if kind == "chunked":
        size = bs * max(1, size // bs)  # real models: chunk is a multiple of the block size
        spec: KVCacheSpec = ChunkedLocalAttentionSpec(bs, 1, 8, attention_chunk_size=size)
    else:
        spec = SlidingWindowSpec(bs, 1, 8, sliding_window=size)
    max_in_flight = steps_in_flight * chunk
    cap = spec.max_admission_blocks_per_request(max_in_flight, max_len)
    kv = KVCacheManager(make_kv_cache_config(1 + cap, [spec], bs), max_len, max_in_flight)
    r = Request("a", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_len))
    kv.init_request(r)
    outstanding: deque[int] = deque()
    while r.num_computed_tokens < max_len:
        if len(outstanding) == steps_in_flight:
            r.num_in_flight_tokens -= outstanding.popleft()
        left = r.num_prompt_tokens - r.num_computed_tokens
        n = min(chunk, left) if left > 0 else 1
        n = min(n, max_len - r.num_computed_tokens)
        assert kv.allocate_slots(r, n) is not None, f"refused at {r.num_computed_tokens} tokens (cap {cap})"
        r.num_computed_tokens += n
        r.num_in_flight_tokens += n
        outstanding.append(n)
        held = sum(1 for b in kv.get_block_ids("a")[0] if b != 0)
        assert held <= cap
