"""A simulated executor: deterministic tokens, speculative decoding, shadow-KV checking.

The token sampled after a prefix is a pure function of that prefix (a fingerprint chain),
so a request's output stream is the same under any scheduling. Steps execute at
dispatch, in order, like a GPU stream; `wait` completes them.

Per request the executor keeps the fingerprint of every known prefix (fps[p] covers
tokens 0..p; len(fps) is the number of known tokens) and its own computed count. Block
tables are kept only when the detector is on: nothing else reads them.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

from hybridserve.core.errors import HybridServeError
from hybridserve.core.kv.block_pool import BlockPool
from hybridserve.core.kv.spec import ChunkedLocalAttentionSpec, KVCacheConfig, MambaSpec, SlidingWindowSpec
from hybridserve.core.sched.output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from hybridserve.executor.base import Executor
from hybridserve.executor.sim.shadow_kv import (
    NULL, NULL_READ, UNALLOCATED, UNOWNED, WRONG, ShadowKV, StepTouches, Violation,
)

ROOT_FP = 0x51A1
_NO_FPS: list[int] = []  # segments that only write never compare content
_NO_DRAFTS: tuple[int, ...] = ()  # shared "no accepted drafts"; never mutated
_FULL, _SLIDING, _CHUNKED, _MAMBA = range(4)  # attention kinds of a KV cache group


class SimExecutorError(HybridServeError, RuntimeError):
    """The scheduler asked the simulated executor for something impossible."""


def extend_fp(fp: int, token: int) -> int:
    return hash((fp, token))


def prefix_fingerprints(tokens: list[int]) -> list[int]:
    """fps[p] = fingerprint of tokens[0..p] (the extend_fp chain from ROOT_FP), inlined."""
    fps: list[int] = []
    add = fps.append
    fp = ROOT_FP
    for t in tokens:
        fp = hash((fp, t))
        add(fp)
    return fps


class _ReqState:
    """One request as the executor sees it. Invariant: num_computed <= len(fps)."""

    __slots__ = ("fps", "num_computed", "tables", "num_nulls", "row", "from_source")

    def __init__(self, fps: list[int], num_computed: int) -> None:
        self.fps = fps
        self.num_computed = num_computed
        self.tables: list[list[int]] = []
        self.num_nulls: tuple[int, ...] = ()
        self.row = -1  # shadow table row (detector on)
        # In-place Mamba states: the first step starts from block (s-1)//bs (a prefix hit
        # or a connector load), later ones from the running block (InPlaceMambaManager).
        self.from_source = True


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
        self._groups: tuple[tuple[int, int, int], ...] = ()  # (group, kind code, window/chunk)

    @property
    def violations(self) -> list[Violation]:
        return self.shadow.violations if self.shadow else []

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
            elif isinstance(s, MambaSpec):  # 0: one state block, 1: positional, 2: running state in place
                self.group_kinds.append(("mamba", int(s.block_checkpoints) + int(s.block_checkpoints
                                                                                  and s.running_in_place)))
            else:
                self.group_kinds.append(("full", 0))
        codes = {"full": _FULL, "sliding": _SLIDING, "chunked": _CHUNKED, "mamba": _MAMBA}
        # A Mamba state's pages 1.. (MambaSpec.num_pages) mirror page 0's tables: the shadow
        # follows page 0 only, so a paged state costs the detector one group, not num_pages.
        mirrors = {g for g, grp in enumerate(kv_cache_config.groups)
                   if isinstance(grp.spec, MambaSpec) and grp.spec.page_index > 0}
        self._groups = tuple((g, codes[kind], size) for g, (kind, size) in enumerate(self.group_kinds)
                             if g not in mirrors)
        # The groups whose tables the shadow keeps (a mirror's blocks are never touched, so
        # its frees can never report: its table is not needed).
        self._tracked = [g for g in range(len(self.group_kinds)) if g not in mirrors]
        self._in_place = [kind == "mamba" and size == 2 for kind, size in self.group_kinds]
        if self.detector:
            self.shadow = ShadowKV(kv_cache_config.num_blocks, self.block_size, len(self.group_kinds), self.strict)
        if self.connector is not None:
            self.connector.attach_executor(self)

    def observe_block_pool(self, pool: BlockPool) -> None:
        if self.shadow is not None:
            pool.on_free = self.shadow.on_free
            blocks = pool.blocks
            self.shadow.is_shared = lambda bid: blocks[bid].ref_cnt > 1

    def execute(self, scheduler_output: SchedulerOutput) -> Any:
        so = scheduler_output
        shadow = self.shadow
        reqs = self.reqs
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self._drop(rid)
        kco = None
        if self.connector is not None:
            kco = self.connector.run_step(so.step_id, so.kv_connector_metadata)
        touches = StepTouches(so.step_id) if shadow is not None else None
        ids = [sr.request_id for sr in so.requests]  # one row per scheduled request, in order
        sampled: list[list[int]] = []
        vocab = self.vocab_size
        for sr in so.requests:
            rid = sr.request_id
            if sr.new is not None:
                st = self._new_state(sr)
            else:
                st = reqs.get(rid)  # type: ignore[assignment]
                if st is None:
                    raise SimExecutorError(f"step schedules unknown request {rid!r}")
                if shadow is not None and (sr.num_null_blocks != st.num_nulls or any(sr.new_block_ids)):
                    self._update_tables(sr, st)
            fps = st.fps
            s = st.num_computed
            d = sr.num_draft_tokens
            n = s + sr.num_scheduled_tokens - d  # exclusive end of the known tokens computed
            if n > len(fps):
                raise SimExecutorError(
                    f"request {rid}: step {so.step_id} computes positions up to {n - 1}, "
                    f"but only {len(fps)} tokens are known"
                )
            if not sr.samples:  # a prefill chunk short of the prompt's end
                if touches is not None:
                    self._shadow_step(touches, st, rid, s, n - s, d, _NO_DRAFTS)
                st.num_computed = n
                sampled.append([])
                continue
            fp = fps[n - 1]
            if not d:  # the usual case, kept short: one token after fp, no drafts
                t = fp % vocab
                if touches is not None:
                    self._shadow_step(touches, st, rid, s, n - s, d, _NO_DRAFTS)
                st.num_computed = n
                fps.append(hash((fps[-1], t)))  # fps[-1] is fp unless more tokens were known
                sampled.append([t])
                continue
            accepted, out = self._verify_drafts(fp, d)  # fingerprints after each accepted draft
            fp = accepted[-1] if accepted else fp
            t = out[-1]
            if touches is not None:
                self._shadow_step(touches, st, rid, s, n - s, d, accepted)
            st.num_computed = n + len(accepted)
            if len(fps) == n:  # the usual case: the chain continues from fps[n-1]
                if accepted:
                    fps += accepted
                fps.append(hash((fp, t)))
            else:
                last = fps[-1]
                for tok in out:
                    last = hash((last, tok))
                    fps.append(last)
            sampled.append(out)
        if shadow is not None:  # only the shadow reads it
            for sr in so.requests:
                reqs[sr.request_id].from_source = False
        if touches is not None and touches.state_writes:
            # A Mamba layer reads every request's state before it writes any (the runner's
            # StepMambaStates): a state written this step is not there for another's read.
            for bid, fp, writer, group in touches.state_writes:
                shadow.write_state(bid, fp, writer, so.step_id, group)  # type: ignore[union-attr]
        rec = shadow.begin(touches) if shadow is not None and touches is not None else None
        return ModelRunnerOutput(ids, sampled, kv_connector_output=kco), rec

    def _verify_drafts(self, fp: int, num_drafts: int) -> tuple[list[int], list[int]]:
        """Propose num_drafts drafts after fp; each matches the true next token with the
        acceptance probability (one rng draw per draft until the first miss). Returns the
        fingerprints after each accepted draft and the tokens produced (accepted + bonus)."""
        rand, rate, vocab = self.rng.random, self.acceptance_rate, self.vocab_size
        accepted: list[int] = []
        out: list[int] = []
        for _ in range(num_drafts):
            if rand() >= rate:
                break
            out.append(fp % vocab)
            fp = hash((fp, fp % vocab))
            accepted.append(fp)
        out.append(fp % vocab)
        return accepted, out

    def wait(self, handle: Any) -> ModelRunnerOutput:
        out, rec = handle
        if rec is not None and self.shadow is not None:
            self.shadow.end(rec)
        return out

    # -- request state ------------------------------------------------------------
    def _drop(self, rid: str) -> None:
        st = self.reqs.pop(rid, None)
        if st is not None and st.row >= 0 and self.shadow is not None:
            self.shadow.release_row(st.row)

    def _new_state(self, sr: ScheduledRequest) -> _ReqState:
        assert sr.new is not None
        self._drop(sr.request_id)
        st = _ReqState(prefix_fingerprints(sr.new.token_ids), sr.num_computed_tokens)
        shadow = self.shadow
        if shadow is not None:
            st.tables = [[] for _ in sr.new_block_ids]
            st.num_nulls = tuple(sr.num_null_blocks)
            st.row = shadow.alloc_row()
            for g in self._tracked:
                st.tables[g] = table = list(sr.new_block_ids[g])
                shadow.set_blocks(g, st.row, 0, table)
        self.reqs[sr.request_id] = st
        return st

    def _update_tables(self, sr: ScheduledRequest, st: _ReqState) -> None:
        shadow = self.shadow
        assert shadow is not None
        new_ids, new_nulls = sr.new_block_ids, sr.num_null_blocks
        for g in self._tracked:
            table, ids = st.tables[g], new_ids[g]
            if ids:
                if self._in_place[g]:  # the running state's block R stays last (InPlaceMambaManager)
                    shadow.insert_before_last(g, st.row, len(table) - 1, ids)
                    table[-1:-1] = ids
                else:
                    shadow.set_blocks(g, st.row, len(table), ids)
                    table.extend(ids)
            nulls = new_nulls[g]
            old = st.num_nulls[g]
            if nulls > old:
                for i in range(old, nulls):
                    table[i] = NULL
                shadow.set_null(g, st.row, old, nulls)
        st.num_nulls = tuple(max(a, b) for a, b in zip(st.num_nulls, sr.num_null_blocks))

    # -- shadow KV: one request of one step ---------------------------------------------
    def _shadow_step(
        self, touches: StepTouches, st: _ReqState, rid: str, s: int, k: int, d: int, accepted: Sequence[int]
    ) -> None:
        """Write the step's slots now; queue its reads and touches (checked in ShadowKV.begin).

        Touch order per group matches the order a step makes them: reads (lo..s-1, the
        step's own keys come from the batch), then writes (s..end-1).
        """
        shadow = self.shadow
        assert shadow is not None
        bs = self.block_size
        fps = st.fps
        row = st.row
        # Fingerprints this step writes: known tokens, accepted drafts, then garbage for
        # rejected drafts (a later read of those slots must fail).
        writes = fps[s : s + k]
        if d:
            writes += accepted
            if d > len(accepted):
                writes.extend(~hash((rid, s + k + j, "rejected")) for j in range(d - len(accepted)))
        end = s + len(writes)  # exclusive
        nums, ctx = touches.nums, touches.ctx
        seg_ctx = (rid, fps)
        slots_of, writer, filled = shadow.slots, shadow.writer, shadow.filled
        w_first, w_last = s // bs, (end - 1) // bs
        for g, kind, size in self._groups:
            table = st.tables[g]
            num_blocks = len(table)
            if kind == _MAMBA:
                if size == 2:
                    self._mamba_in_place(touches, st, g, s, fps[s - 1] if s else None, writes, k + len(accepted), rid)
                elif size:  # a state checkpoint per block
                    self._mamba_checkpoints(touches, table, g, row, s, fps[s - 1] if s else None, writes,
                                            k + len(accepted), rid)
                else:
                    self._mamba(touches, table, g, row, s, fps[s - 1] if s else None, writes[k + len(accepted) - 1],
                                rid)
                continue
            lo = 0 if kind == _FULL else (s - size + 1 if s >= size else 0) if kind == _SLIDING else s - s % size
            if s > lo:
                first, last = lo // bs, (s - 1) // bs
                if last < num_blocks:
                    nums += (g, row, first, last - first + 1, lo, s - 1)
                    ctx.append(seg_ctx)
                else:
                    nums += (g, row, first, num_blocks - first if num_blocks > first else 0, lo, s - 1)
                    ctx.append(seg_ctx)
                    touches.mark(Violation(UNALLOCATED, touches.step, rid, g, -1, max(lo, max(first, num_blocks) * bs)))
            if end <= s:
                continue
            if w_first == w_last < num_blocks:  # the loop below for one held block (decodes)
                nums += (g, row, w_first, 1, s, -1)
                ctx.append(seg_ctx)
                bid = table[w_first]
                if bid != NULL:
                    slots = slots_of[bid]
                    if slots is None:
                        slots = slots_of[bid] = [0] * bs
                    base = w_first * bs
                    slots[s - base : end - base] = writes
                    f = filled[bid]  # ShadowKV.wrote, inlined: a decode appends (no stamp move)
                    if s - base < f:
                        shadow.stamp[bid] += 1
                    if end - base > f:
                        filled[bid] = end - base
                    if writer[bid] != rid:
                        writer[bid] = rid
                        shadow.version[bid] += 1
                continue
            stop = w_last + 1 if w_last < num_blocks else num_blocks
            nums += (g, row, w_first, stop - w_first if stop > w_first else 0, s, -1)
            ctx.append(seg_ctx)
            for b in range(w_first, stop):
                bid = table[b]
                if bid == NULL:
                    continue  # writes to the null block vanish
                base = b * bs
                a = s if s > base else base
                z = end if end < base + bs else base + bs
                slots = slots_of[bid]
                if slots is None:
                    slots = slots_of[bid] = [0] * bs
                slots[a - base : z - base] = writes[a - s : z - s]
                shadow.wrote(bid, a - base, z - base)
                if writer[bid] != rid:
                    writer[bid] = rid
                    shadow.version[bid] += 1
            if w_last >= num_blocks:
                touches.mark(Violation(UNALLOCATED, touches.step, rid, g, -1, max(w_first, num_blocks) * bs))

    def _mamba(
        self, touches: StepTouches, table: list[int], g: int, row: int, s: int, read_fp: int | None, state_fp: int,
        rid: str,
    ) -> None:
        """Read the state after position s-1, write the state after the last valid position.

        The read is checked now, before the write replaces it; its outcome joins the
        step's reports in touch order; the write is applied after every read of the step.
        """
        if not table:
            touches.mark(Violation(UNALLOCATED, touches.step, rid, g, -1, s))
            return
        bid = table[0]
        if read_fp is not None:
            self._check_state_read(touches, g, row, 0, bid, s, read_fp, rid)
        touches.state_writes.append((bid, state_fp, rid, g))
        touches.add(g, row, 0, 1, s, -1, rid, _NO_FPS)

    def _mamba_checkpoints(
        self, touches: StepTouches, table: list[int], g: int, row: int, s: int, read_fp: int | None,
        writes: list[int], num_valid: int, rid: str,
    ) -> None:
        """Positional states (MambaSpec.block_checkpoints): read the state after s tokens
        from block (s-1)//bs; write the chunk's final state to block (end-1)//bs as the
        mixer does, then, as the runner's commit does, the state at every boundary
        crossed by the valid tokens whose block is real and the state after the last valid one. A rejected
        draft thus leaves a garbage state only in a block past the valid end."""
        bs = self.block_size
        end = s + len(writes)
        first, last = ((s - 1) // bs if s else 0), (end - 1) // bs
        if last >= len(table):
            touches.mark(Violation(UNALLOCATED, touches.step, rid, g, -1, max(s, len(table) * bs)))
            return
        if read_fp is not None:
            self._check_state_read(touches, g, row, first, table[first], s, read_fp, rid)
        state_writes = touches.state_writes
        state_writes.append((table[last], writes[-1], rid, g))
        valid_end = s + num_valid
        for b in range((s // bs + 1) * bs, valid_end, bs):  # boundaries strictly inside
            if table[b // bs - 1] != NULL:  # sparse checkpoints keep only some (MambaSpec)
                state_writes.append((table[b // bs - 1], writes[b - s - 1], rid, g))
        state_writes.append((table[(valid_end - 1) // bs], writes[num_valid - 1], rid, g))
        touches.add(g, row, first, last - first + 1, s, -1, rid, _NO_FPS)

    def _mamba_in_place(
        self, touches: StepTouches, st: _ReqState, g: int, s: int, read_fp: int | None, writes: list[int],
        num_valid: int, rid: str,
    ) -> None:
        """Running state in place (MambaSpec.running_in_place): read it from the table's last
        entry R (the first step after a hit or a load: from block (s-1)//bs), write the
        chunk's final state to R then, as the runner's commit does, the state after the last
        valid token; and the state at every boundary b in [s, s + num_valid] to block
        b/bs - 1 where that is a checkpoint block, not R (b == s: the state read; b at the
        end: the state after the last valid token)."""
        bs = self.block_size
        table, row = st.tables[g], st.row
        end = s + len(writes)
        last = len(table) - 1
        if last < (end - 1) // bs:
            touches.mark(Violation(UNALLOCATED, touches.step, rid, g, -1, max(s, len(table) * bs)))
            return
        source = st.from_source and s > 0
        first = (s - 1) // bs if source else last
        if read_fp is not None:
            self._check_state_read(touches, g, row, first, table[first], s, read_fp, rid)
        running = table[last]
        state_writes = touches.state_writes
        state_writes.append((running, writes[-1], rid, g))
        for b in range((s // bs + 1) * bs if source else -(-s // bs) * bs, s + num_valid + 1, bs):
            col = b // bs - 1
            if b and col != last and table[col] != NULL:
                state_writes.append((table[col], read_fp if b == s else writes[b - s - 1], rid, g))  # type: ignore[arg-type]
        state_writes.append((running, writes[num_valid - 1], rid, g))
        lo = (s - 1) // bs if s else 0  # the source, or the first boundary's checkpoint
        touches.add(g, row, lo, last - lo + 1, s, -1, rid, _NO_FPS)

    def _check_state_read(
        self, touches: StepTouches, g: int, row: int, index: int, bid: int, s: int, read_fp: int, rid: str
    ) -> None:
        """A step starting at s reads the state after s tokens from block bid (entry
        index of the row's table): the request must still own it and it must hold
        read_fp (checked before any state write of the step; see execute)."""
        if bid == NULL:
            touches.mark(Violation(NULL_READ, touches.step, rid, g, bid, s - 1))
            return
        shadow = self.shadow
        assert shadow is not None
        if not shadow.owns(g, row, index, bid):
            touches.mark(Violation(UNOWNED, touches.step, rid, g, bid, s - 1))
            return
        slots = shadow.slots[bid]
        if slots is None or slots[0] != read_fp:
            touches.mark(Violation(WRONG, touches.step, rid, g, bid, s - 1))
