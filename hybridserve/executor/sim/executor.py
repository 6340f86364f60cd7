"""A simulated executor: deterministic tokens, speculative decoding, shadow-KV checking.

The token sampled after a prefix is a pure function of that prefix (a fingerprint chain),
so a request's output stream is the same under any scheduling. Steps execute at
dispatch, in order, like a GPU stream; `wait` completes them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from hybridserve.core.errors import HybridServeError
from hybridserve.core.kv.block_pool import BlockPool
from hybridserve.core.kv.spec import ChunkedLocalAttentionSpec, KVCacheConfig, MambaSpec, SlidingWindowSpec
from hybridserve.core.sched.output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from hybridserve.engine.executor import Executor
from hybridserve.executor.sim.shadow_kv import NULL, ShadowKV, Violation

ROOT_FP = 0x51A1


class SimExecutorError(HybridServeError, RuntimeError):
    """The scheduler asked the simulated executor for something impossible."""


def extend_fp(fp: int, token: int) -> int:
    return hash((fp, token))


@dataclass
class _ReqState:
    tokens: list[int]
    fps: list[int]  # fps[p]: fingerprint of tokens[0..p]
    num_computed: int
    tables: list[list[int]]
    num_nulls: list[int]
    # group -> block index -> (block id, version, highest slot verified)
    verified: list[dict[int, tuple[int, int, int]]] = field(default_factory=list)

    def append(self, token: int) -> None:
        self.fps.append(extend_fp(self.fps[-1] if self.fps else ROOT_FP, token))
        self.tokens.append(token)


class SimExecutor(Executor):
    # Keys of a step's own positions are read from the batch, not the cache.
    computes_in_chunk_attention_from_batch = True

    def __init__(
        self,
        vocab_size: int = 32_000,
        num_speculative_tokens: int = 0,
        acceptance_rate: float = 0.7,
        seed: int = 0,
        detector: bool = True,
        strict: bool = True,
        connector: Any = None,
    ) -> None:
        if not 0.0 <= acceptance_rate <= 1.0:
            raise SimExecutorError(f"acceptance_rate must be in [0, 1], got {acceptance_rate}")
        self.vocab_size = vocab_size
        self.num_speculative_tokens = num_speculative_tokens
        self.acceptance_rate = acceptance_rate
        self.rng = random.Random(seed)
        self.detector = detector
        self.strict = strict
        self.connector = connector
        self.shadow: ShadowKV | None = None
        self.reqs: dict[str, _ReqState] = {}
        self.group_kinds: list[tuple[str, int]] = []

    @property
    def violations(self) -> list[Violation]:
        return self.shadow.violations if self.shadow else []

    def token_after(self, fp: int) -> int:
        return fp % self.vocab_size

    # -- Executor interface -------------------------------------------------------
    def initialize(self, kv_cache_config: KVCacheConfig) -> None:
        self.block_size = kv_cache_config.block_size
        self.group_kinds = []
        for g in kv_cache_config.groups:
            s = g.spec
            if isinstance(s, SlidingWindowSpec):
                self.group_kinds.append(("sliding", s.sliding_window))
            elif isinstance(s, ChunkedLocalAttentionSpec):
                self.group_kinds.append(("chunked", s.attention_chunk_size))
            elif isinstance(s, MambaSpec):
                self.group_kinds.append(("mamba", 0))
            else:
                self.group_kinds.append(("full", 0))
        if self.detector:
            self.shadow = ShadowKV(kv_cache_config.num_blocks, self.block_size, self.strict)
        if self.connector is not None:
            self.connector.attach_executor(self)

    def observe_block_pool(self, pool: BlockPool) -> None:
        if self.shadow is not None:
            pool.on_free = self.shadow.on_free

    def execute(self, scheduler_output: SchedulerOutput) -> Any:
        so = scheduler_output
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.reqs.pop(rid, None)
        kco = None
        if self.connector is not None:
            kco = self.connector.run_step(so.step_id, so.kv_connector_metadata)
        touched: list[tuple[int, str, int, int]] = []
        ids, sampled = [], []
        for sr in so.requests:
            ids.append(sr.request_id)
            sampled.append(self._run(sr, so.step_id, touched))
        rec = self.shadow.begin(so.step_id, touched) if self.shadow else None
        return ModelRunnerOutput(ids, sampled, kv_connector_output=kco), rec

    def wait(self, handle: Any) -> ModelRunnerOutput:
        out, rec = handle
        if rec is not None and self.shadow is not None:
            self.shadow.end(rec)
        return out

    # -- one request of one step ------------------------------------------------
    def _state(self, sr: ScheduledRequest) -> _ReqState:
        if sr.new is not None:
            st = _ReqState([], [], sr.num_computed_tokens, [list(t) for t in sr.new_block_ids], list(sr.num_null_blocks))
            for t in sr.new.token_ids:
                st.append(t)
            st.verified = [{} for _ in self.group_kinds]
            self.reqs[sr.request_id] = st
            return st
        st = self.reqs.get(sr.request_id)
        if st is None:
            raise SimExecutorError(f"step schedules unknown request {sr.request_id!r}")
        for g, ids in enumerate(sr.new_block_ids):
            if ids:
                st.tables[g].extend(ids)
            nulls = sr.num_null_blocks[g]
            if nulls > st.num_nulls[g]:
                table = st.tables[g]
                for i in range(st.num_nulls[g], nulls):
                    table[i] = NULL
                st.num_nulls[g] = nulls
        return st

    def _run(self, sr: ScheduledRequest, step: int, touched: list) -> list[int]:
        st = self._state(sr)
        s = st.num_computed
        d = sr.num_draft_tokens
        k = sr.num_scheduled_tokens - d
        if s + k > len(st.tokens):
            raise SimExecutorError(
                f"request {sr.request_id}: step {step} computes positions up to {s + k - 1}, "
                f"but only {len(st.tokens)} tokens are known"
            )
        accepted: list[int] = []
        out: list[int] = []
        if sr.samples:
            fp = st.fps[s + k - 1]
            for _ in range(d):
                if self.rng.random() >= self.acceptance_rate:
                    break
                t = self.token_after(fp)
                accepted.append(t)
                fp = extend_fp(fp, t)
            out = accepted + [self.token_after(fp)]
        if self.shadow is not None:
            self._shadow_step(sr, st, s, k, d, accepted, step, touched)
        st.num_computed = s + k + len(accepted)
        for t in out:
            st.append(t)
        return out

    def _shadow_step(
        self, sr: ScheduledRequest, st: _ReqState, s: int, k: int, d: int, accepted: list[int], step: int, touched: list
    ) -> None:
        shadow = self.shadow
        assert shadow is not None
        bs = self.block_size
        rid = sr.request_id
        # Fingerprints this step writes: known tokens, accepted drafts, then garbage for
        # rejected drafts (a later read of those slots must fail).
        writes = st.fps[s : s + k]
        fp = writes[-1] if writes else ROOT_FP
        for t in accepted:
            fp = extend_fp(fp, t)
            writes.append(fp)
        writes.extend(~hash((rid, s + k + j, "rejected")) for j in range(d - len(accepted)))
        end = s + len(writes)  # exclusive
        for g, (kind, size) in enumerate(self.group_kinds):
            table = st.tables[g]
            if kind == "mamba":
                self._mamba(table, g, s, st.fps[s - 1] if s else None, writes[k + len(accepted) - 1], rid, step, touched)
                continue
            # Reads from the cache: keys lo..s-1 (the step's own keys come from the batch).
            lo = 0 if kind == "full" else max(0, s - size + 1) if kind == "sliding" else (s // size) * size
            if s > lo:
                self._check_reads(st, g, lo, s - 1, rid, step, touched)
            for b in range(s // bs, (end - 1) // bs + 1):
                if b >= len(table):
                    shadow.report(Violation("unallocated-slot", step, rid, g, -1, b * bs))
                    break
                a = max(s, b * bs)
                z = min(end, b * bs + bs)
                shadow.write(table[b], a - b * bs, writes[a - s : z - s], rid)
                touched.append((table[b], rid, g, a))

    def _check_reads(self, st: _ReqState, g: int, lo: int, hi: int, rid: str, step: int, touched: list) -> None:
        shadow = self.shadow
        assert shadow is not None
        bs = self.block_size
        table = st.tables[g]
        verified = st.verified[g]
        version = shadow.version
        for b in range(lo // bs, hi // bs + 1):
            a = max(lo, b * bs)
            z = min(hi, b * bs + bs - 1)
            if b >= len(table):
                shadow.report(Violation("unallocated-slot", step, rid, g, -1, a))
                return
            bid = table[b]
            touched.append((bid, rid, g, a))
            v = verified.get(b)
            if v is not None and v[0] == bid and bid != NULL and v[1] == version[bid] and v[2] >= z:
                continue
            if shadow.check_read(bid, a - b * bs, st.fps[a : z + 1], (step, rid, g, a)):
                verified[b] = (bid, version[bid], z)

    def _mamba(
        self, table: list[int], g: int, s: int, read_fp: int | None, state_fp: int, rid: str, step: int, touched: list
    ) -> None:
        """Read the state after position s-1, write the state after the last valid position."""
        shadow = self.shadow
        assert shadow is not None
        if not table:
            shadow.report(Violation("unallocated-slot", step, rid, g, -1, s))
            return
        bid = table[0]
        if read_fp is not None:
            shadow.check_read(bid, 0, [read_fp], (step, rid, g, s - 1))
        shadow.write_state(bid, state_fp, rid)
        touched.append((bid, rid, g, s))
