"""ModelRunner: executes one SchedulerOutput on a DecoderLM with the paged KV cache.

Runs in one thread, steps strictly in dispatch order. Each step's inputs are built at
execution time from runner-side state: with async scheduling the scheduler schedules a
decode before it has seen the previous step's token, and by the time this step runs
the runner has appended it (`RequestState.token_ids`).

A request computes `tokens[num_computed : num_computed + n]` where num_computed is the
runner's own count (authoritative; it trails the scheduler's after rejected drafts) and
n = num_scheduled_tokens - num_draft_tokens, followed by the drafts it proposes for the
step's draft slots (n-gram lookup, verified in the same step: see spec_decode.py)::

    scheduled   [ known tokens (n) | draft slots (num_draft_tokens) ]
    computed    [ known tokens (n) | proposed drafts (<= slots)     ]
    advance     num_computed += n + accepted drafts     (_advance: the one place)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hybridserve.core.errors import ConfigError, RequestError
from hybridserve.core.kv.spec import ChunkedLocalAttentionSpec, KVCacheConfig, SlidingWindowSpec
from hybridserve.core.sched.output import (
    LogprobInfo,
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobChunk,
    ScheduledRequest,
    SchedulerOutput,
)
from hybridserve.executor.torch.attention import StepAttention
from hybridserve.executor.torch.grammar import RequestGrammar
from hybridserve.executor.torch.kv_cache import PagedKVCache, dtype_name
from hybridserve.executor.torch.logits_controls import TokenHistory
from hybridserve.executor.torch.mamba_states import GroupSubset, MambaLayout, StepBackend, StepMambaStates
from hybridserve.executor.torch.plain_sampling import DrawParamsCache, sample_plain
from hybridserve.executor.torch.requests import BlockTables, RequestState
from hybridserve.executor.torch.sampler import (SampleRow, inv_temperatures, is_greedy, logprob_info,
                                                reads_one_span_per_row, sample_isolated, target_logprobs)
from hybridserve.executor.torch.spec_decode import NgramDrafter, num_accepted
from hybridserve.models.arch.decoder import DecoderLM
from hybridserve.models.kv_specs import cached_layers, kv_dtype_problem, layer_index
from hybridserve.models.arch.mamba_lm import MambaLM
from hybridserve.text.structured_output import GrammarBackend


# Prompt positions whose vocab logits are materialised at a time for prompt logprobs:
# 64 rows of Gemma 3's 262k vocabulary are 64 MiB of float32 (twice that with log_softmax).
PROMPT_LOGPROB_ROWS = 64


@dataclass
class StepBatch:
    """A step's flat batch, built by the runner for the model."""

    ends: np.ndarray  # [R] end of each request's tokens in the flat batch
    positions_t: torch.Tensor  # [T]
    max_position: int
    backend: StepAttention | StepBackend | None  # attention (and Mamba states) for the layers
    mamba_states: StepMambaStates | None


class ModelRunner:
    """Owns the KV cache, the per-request state and the block tables; runs one step at a time.

    Invariants: steps execute in dispatch order; a request's state exists from the step
    that carries its NewRequestData until a step lists it as finished or preempted; every
    request has a sampling seed (its own, or one drawn from the runner's generator when
    it first arrives, kept across preemption), and its draws are keyed by (seed, token
    position), so they continue unchanged after a preemption.
    """

    def __init__(self, model: DecoderLM | MambaLM, kv_cache_config: KVCacheConfig, device: torch.device,
                 seed: int = 0, drafter: NgramDrafter | None = None, grammar: GrammarBackend | None = None,
                 layers: range | None = None) -> None:
        """layers: the model layers this runner computes and holds K/V for (all by
        default; a pipeline stage's own range, see executor/distributed)."""
        self.model = model
        # Compiles structured-output constraints into matchers (None: the engine has no tokenizer).
        self.grammar = grammar
        # Fills the draft slots the scheduler reserves (it reserves none unless
        # num_speculative_tokens > 0).
        self.drafter = drafter if drafter is not None else NgramDrafter()
        self.device = device
        self.kv = PagedKVCache(kv_cache_config, device)
        expected = cached_layers(model.cfg, layers)
        got = {layer_index(n) for n in self.kv.layer_group}
        if got != expected:
            raise ConfigError(f"KV cache config covers layers {sorted(got)}, the model has {sorted(expected)}")
        problem = kv_dtype_problem(dtype_name(self.kv.buffers[0].dtype), dtype_name(model.dtype), model.cfg)
        if problem:
            raise ConfigError(problem)
        # Mamba layers (Mamba2, Bamba): their state blocks, and attention over its own groups.
        self.mamba = MambaLayout(kv_cache_config, self.kv, model.cfg.num_layers) if self.kv.state_pages else None
        if self.mamba is not None:
            self.layers = self.mamba.attn_layers
            attn_groups = [kv_cache_config.groups[g] for g in self.mamba.attn_groups]
        else:
            self.layers = [(-1, torch.empty(0))] * model.cfg.num_layers
            for name, g in self.kv.layer_group.items():
                self.layers[layer_index(name)] = (g, self.kv.layer_view[name])
            attn_groups = list(kv_cache_config.groups)
        self.group_windows: list[int | None] = [
            g.spec.sliding_window if isinstance(g.spec, SlidingWindowSpec) else None for g in attn_groups
        ]
        self.group_chunks: list[int | None] = [
            g.spec.attention_chunk_size if isinstance(g.spec, ChunkedLocalAttentionSpec) else None
            for g in attn_groups
        ]
        self.tables = BlockTables(len(kv_cache_config.groups))
        self.states: dict[str, RequestState] = {}
        # The draw parameters of the last batch of plain sampled rows (plain_sampling.py)
        self._draw_params = DrawParamsCache(model.cfg.vocab_size)
        # Seeds of preempted requests, so a resumed request keeps its draws.
        self._parked_seeds: dict[str, int] = {}
        # Draws the seeds of requests that bring none (every tensor-parallel rank draws the
        # same ones: the same seed, and requests arrive in the same order).
        self.seed_generator = torch.Generator()
        self.seed_generator.manual_seed(seed)

    # -- request state ----------------------------------------------------------
    def _drop(self, req_id: str, preempted: bool) -> None:
        state = self.states.pop(req_id, None)
        if state is None:
            if not preempted:
                self._parked_seeds.pop(req_id, None)
            return
        self.tables.free_row(state.row)
        if preempted:
            self._parked_seeds[req_id] = state.seed

    def _add(self, new: NewRequestData, num_computed: int) -> RequestState:
        if new.request_id in self.states:
            raise RequestError(f"request {new.request_id} is already running on the runner")
        p = new.sampling_params
        seed = self._parked_seeds.pop(new.request_id, p.seed)
        if seed is None:
            seed = int(torch.randint(0, 1 << 62, (1,), generator=self.seed_generator))
        plain = (p.logprobs is None and not p.min_tokens and not p.has_logits_controls
                 and p.structured_output is None)
        state = RequestState(
            req_id=new.request_id, token_ids=list(new.token_ids), num_computed=num_computed,
            params=new.sampling_params, row=self.tables.alloc_row(), seed=seed,
            num_prompt_tokens=len(new.prompt_token_ids), eos_token_id=new.eos_token_id,
            plain=plain, plain_greedy=plain and is_greedy(p),
        )
        if p.structured_output is not None and self.samples:
            self._attach_grammar(state)
        self.states[new.request_id] = state
        return state

    #: Whether this runner samples (a pipeline stage before the last does not: it has no
    #: use for grammars, penalties or generators beyond keeping their state in step).
    samples = True

    def _attach_grammar(self, state: RequestState) -> None:
        if self.grammar is None:
            raise RequestError(f"request {state.req_id}: structured outputs need a tokenizer")
        assert state.params.structured_output is not None
        grammar = RequestGrammar(self.grammar.matcher(state.params.structured_output), self.model.cfg.vocab_size)
        # A resumed (preempted) request continues from the outputs it already has.
        reason = grammar.advance(state.token_ids[state.num_prompt_tokens:])
        if reason is not None:
            raise RequestError(f"request {state.req_id}: {reason}")
        state.extra["grammar"] = grammar

    def _update_tables(self, sr: ScheduledRequest, state: RequestState) -> None:
        in_place = self.mamba.in_place_groups if self.mamba is not None and sr.new is None else ()
        for g, ids in enumerate(sr.new_block_ids):
            if ids:
                if g in in_place:
                    self.tables.insert_before_last(g, state.row, ids)
                else:
                    self.tables.append(g, state.row, ids)
        if any(sr.num_null_blocks):
            for g, num_null in enumerate(sr.num_null_blocks):
                if num_null:
                    self.tables.set_null_prefix(g, state.row, num_null)

    def _sample_plain(self, states: list[RequestState], hidden: torch.Tensor
                      ) -> tuple[list[int], dict[int, str]] | None:
        """plain_sampling's (tokens, failed rows) for plain states sampling one row each
        (hidden's rows, in order); None where it cannot run or fails: the general path then
        samples them, confining a fault to its rows."""
        dp = self._draw_params.of(states)
        positions = [len(s.token_ids) for s in states]
        try:
            return sample_plain(self.model.span_logits(hidden, dp.inv_t, stored=dp.stored), dp, positions)
        except Exception:  # noqa: BLE001 - sampled again by the general path, row by row if it must
            return None

    @staticmethod
    def _banned(state: RequestState, ahead: int = 0) -> tuple[int, ...]:
        """EOS and stop tokens are masked until the request has min_tokens outputs
        (`ahead`: tokens before this position that are not appended yet, i.e. drafts)."""
        p = state.params
        if not p.min_tokens or len(state.token_ids) + ahead - state.num_prompt_tokens >= p.min_tokens:
            return ()
        eos = () if state.eos_token_id is None or p.ignore_eos else (state.eos_token_id,)
        return tuple(p.stop_token_ids) + eos

    @staticmethod
    def _history(state: RequestState, drafts: list[int], ahead: int) -> TokenHistory | None:
        """What the logits controls of the row `ahead` drafts past the known tokens see."""
        if not state.params.has_logits_controls:
            return None
        tokens = state.token_ids + drafts[:ahead] if ahead else state.token_ids
        return TokenHistory(tokens, state.num_prompt_tokens)

    # -- one step -----------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._drop_ended(so)
        if not so.requests:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        states, starts, counts, ids, drafts = self._prepare(so)
        batch = self._batch(states, starts, counts, drafts)
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
        hidden = self.model(ids_t, batch.positions_t, batch.max_position, batch.backend)
        return self._sample_and_advance(so, states, counts, drafts, hidden, batch)

    def _drop_ended(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self._drop(rid, preempted=False)
        for rid in so.preempted_req_ids:
            self._drop(rid, preempted=True)

    def _batch(self, states: list[RequestState], starts_l: list[int], counts_l: list[int],
               drafts: list[list[int]]) -> StepBatch:
        """Positions and the attention / Mamba state backend of a step's flat batch."""
        starts = np.array(starts_l, dtype=np.int64)
        counts = np.array(counts_l, dtype=np.int64)
        rows = np.array([s.row for s in states], dtype=np.int64)
        ends, positions, max_position = step_positions(starts_l, counts_l)
        cfg = self.model.cfg
        attn: StepAttention | StepBackend | None = None
        if self.group_windows:
            tables = self.tables if self.mamba is None else GroupSubset(self.tables, self.mamba.attn_groups)
            attn = StepAttention(self.layers, self.group_windows, tables, self.kv.block_size,  # type: ignore[arg-type]
                                 rows, starts, counts, cfg.attn_scale, cfg.attn_softcap, self.device, self.model.dtype,
                                 self.group_chunks, per_token=self.model.batch_invariant, num_tokens=sum(counts_l))
        mamba_states: StepMambaStates | None = None
        if self.mamba is not None:
            # Requests verifying drafts keep the state after every token, so a rejected
            # draft can fall back to the state after the last accepted one (commit below).
            verify = [i for i, d in enumerate(drafts) if d]
            from_source = np.array([s.extra.pop("mamba_from_source", False) for s in states], dtype=bool)
            mamba_states = StepMambaStates.build(self.mamba, self.tables, rows, starts, counts_l, self.device,
                                                 verify, from_source)
            attn = StepBackend(attn, mamba_states)
        return StepBatch(ends, torch.from_numpy(positions).to(self.device), max_position, attn, mamba_states)

    def _sample_and_advance(self, so: SchedulerOutput, states: list[RequestState], counts: list[int],
                            drafts: list[list[int]], hidden: torch.Tensor, batch: StepBatch) -> ModelRunnerOutput:
        failed: dict[str, str] = {}
        prompt_logprobs = self._prompt_logprobs(states, counts, drafts, hidden, batch.ends)
        sampled, logprobs = self._sample(so, states, hidden, batch.ends, drafts, failed)
        self._advance_all(states, counts, drafts, sampled, batch.mamba_states)
        proposed = {sr.request_id: len(d) for sr, d in zip(so.requests, drafts) if sr.num_draft_tokens}
        return ModelRunnerOutput(req_ids=[s.req_id for s in states], sampled_token_ids=sampled, logprobs=logprobs,
                                 num_draft_tokens=proposed, failed_req_ids=failed, prompt_logprobs=prompt_logprobs)

    def _prompt_logprobs(self, states: list[RequestState], counts: list[int], drafts: list[list[int]],
                         hidden: torch.Tensor, ends: np.ndarray) -> dict[str, PromptLogprobChunk]:
        """For the requests that ask for prompt logprobs, the logprob of each prompt token
        that this step's positions predict: position p's logits give token p + 1's (the
        last prompt position's logits sample the first output, as for every request).
        Called before _advance_all, while num_computed is still the step's start."""
        out: dict[str, PromptLogprobChunk] = {}
        for i, state in enumerate(states):
            n_top = state.params.prompt_logprobs
            if n_top is None:  # nearly every request: nothing more to look at
                continue
            start = state.num_computed
            stop = min(start + counts[i] - len(drafts[i]), state.num_prompt_tokens - 1)
            if start >= stop:
                continue
            first_row = int(ends[i]) - counts[i]
            values: list[float] = []
            tops: list[list[tuple[int, float]]] = []
            for a in range(start, stop, PROMPT_LOGPROB_ROWS):
                b = min(a + PROMPT_LOGPROB_ROWS, stop)
                rows = hidden[first_row + a - start : first_row + b - start]
                targets = torch.tensor(state.token_ids[a + 1 : b + 1], dtype=torch.long, device=self.device)
                info = target_logprobs(self.model.logits(rows), targets, n_top)
                values += info.token_logprobs
                tops += info.top_logprobs or []
            out[state.req_id] = PromptLogprobChunk(start + 1, LogprobInfo(values, tops if n_top else None))
        return out

    def _advance_all(self, states: list[RequestState], counts: list[int], drafts: list[list[int]],
                     sampled: list[list[int]], mamba_states: StepMambaStates | None) -> None:
        """After a step's tokens are known: computed counts, and Mamba states rolled back
        to the last accepted draft."""
        for state, count, d, out in zip(states, counts, drafts, sampled):
            # out = accepted drafts + bonus when the step sampled; [] for a mid-prompt chunk.
            self._advance(state, count - len(d), len(d), len(out) - 1 if out else 0)
        if mamba_states is not None and mamba_states.verify:
            mamba_states.commit([counts[i] - len(drafts[i]) + len(sampled[i]) - 1 for i in mamba_states.verify])

    def _advance(self, state: RequestState, num_known: int, num_proposed: int, num_accepted: int) -> None:
        """The step computed num_known known tokens then num_proposed drafts, of which the
        first num_accepted were accepted: only those count as computed. The K/V written
        for the rejected drafts stays in the blocks and is overwritten later.

        Recurrent (Mamba) states are rolled back to the same point by
        StepMambaStates.commit in execute().
        """
        state.num_computed += num_known + num_accepted

    def _apply_scheduled(self, sr: ScheduledRequest) -> RequestState:
        """The request's state after this step's news: added (or re-added) when it comes
        with NewRequestData, its block tables extended by the step's deltas."""
        state = self.states.get(sr.request_id)
        if sr.new is not None:
            if state is not None:  # resumed under the same id without a preemption notice
                self._drop(sr.request_id, preempted=True)
            state = self._add(sr.new, sr.num_computed_tokens)
            if self.mamba is not None:
                self.mamba.check_start(sr.request_id, state.num_computed)
                state.extra["mamba_from_source"] = True  # its first step reads block (s-1)//bs
        elif state is None:
            raise RequestError(f"request {sr.request_id} scheduled but unknown to the runner")
        self._update_tables(sr, state)
        return state

    def _prepare(self, so: SchedulerOutput
                 ) -> tuple[list[RequestState], list[int], list[int], list[int], list[list[int]]]:
        """Apply new requests and block-table deltas; the tokens each request computes
        (counts include the proposed drafts) and the drafts per request."""
        states: list[RequestState] = []
        starts: list[int] = []
        counts: list[int] = []
        ids: list[int] = []
        drafts: list[list[int]] = []
        for sr in so.requests:
            state = self._apply_scheduled(sr)
            count = sr.num_scheduled_tokens - sr.num_draft_tokens
            start = state.num_computed
            if count < 1 or start + count > len(state.token_ids):
                raise RequestError(
                    f"request {sr.request_id}: {count} tokens scheduled from position {start}, "
                    f"but the runner knows only {len(state.token_ids)} tokens"
                )
            # Draft only after the last known token: a sampling step that ends there.
            d = (self.drafter.propose(state.token_ids, sr.num_draft_tokens)
                 if sr.num_draft_tokens and sr.samples and start + count == len(state.token_ids) else [])
            states.append(state)
            starts.append(start)
            counts.append(count + len(d))
            drafts.append(d)
            ids += state.token_ids[start : start + count]
            ids += d
        return states, starts, counts, ids, drafts

    def _sample(self, so: SchedulerOutput, states: list[RequestState], hidden: torch.Tensor, ends: np.ndarray,
                drafts: list[list[int]], failed: dict[str, str]) -> tuple[list[list[int]], dict[str, LogprobInfo]]:
        """Sample for the requests the scheduler marked, verify their drafts; append the
        output tokens (accepted drafts + bonus) to their state. Requests whose sampling
        failed are added to `failed` (id -> reason), with stand-in tokens.

        Such a step must reach the end of the runner's known tokens: a token sampled
        mid-sequence would be silently lost. A request with p drafts samples at its last
        p + 1 rows (the known token's and each draft's).
        """
        samplers = [i for i, sr in enumerate(so.requests) if sr.samples]
        sampled: list[list[int]] = [[] for _ in states]
        logprobs: dict[str, LogprobInfo] = {}
        if not samplers:
            return sampled, logprobs
        for i in samplers:
            if states[i].num_computed + so.requests[i].num_scheduled_tokens - so.requests[i].num_draft_tokens \
                    != len(states[i].token_ids):
                raise RequestError(f"request {states[i].req_id}: a sampling step ends before its last known token")
        widths = [1 + len(drafts[i]) for i in samplers]  # logits rows per sampler
        if sum(widths) != hidden.shape[0]:  # else every row samples (decodes, with or without drafts)
            rows = np.concatenate([np.arange(ends[i] - w, ends[i]) for i, w in zip(samplers, widths)])
            hidden = hidden[torch.from_numpy(rows).to(self.device)]
        lps: list = []
        failed_rows: dict[int, str] = {}
        # one row per sampler (no drafts), each plain: plain_sampling's fast path
        plain_rows = len(samplers) == hidden.shape[0] and all(states[i].plain for i in samplers)
        if all(states[i].plain_greedy for i in samplers):
            tokens = self.model.greedy_tokens(hidden)  # no full logits tensor
        elif plain_rows and (plain := self._sample_plain([states[i] for i in samplers], hidden)) is not None:
            tokens, failed_rows = plain
        else:
            masks = {i: g.masks(drafts[i], w) for i, w in zip(samplers, widths)
                     if (g := states[i].extra.get("grammar")) is not None}
            rows_info = [SampleRow(states[i].params, states[i].seed, len(states[i].token_ids) + j,
                                   self._banned(states[i], j), self._history(states[i], drafts[i], j),
                                   masks[i][j] if i in masks else None)
                         for i, w in zip(samplers, widths) for j in range(w)]
            inv_t = inv_temperatures(rows_info)
            stored = not reads_one_span_per_row(rows_info, self.model.cfg.vocab_size)
            tokens, lps, failed_rows = sample_isolated(
                lambda r: self.model.span_logits(*_rows_of(r, hidden, inv_t), stored=stored), rows_info)
        if failed_rows:
            row_owner = [i for i, w in zip(samplers, widths) for _ in range(w)]
            for r, reason in failed_rows.items():
                failed.setdefault(states[row_owner[r]].req_id, reason)
        at = 0
        for i, w in zip(samplers, widths):
            targets = tokens[at : at + w]
            a = num_accepted(drafts[i], targets) if w > 1 else 0
            out = targets[: a + 1]
            sampled[i] = out
            states[i].token_ids += out
            grammar = states[i].extra.get("grammar")
            if grammar is not None and (reason := grammar.advance(out)) is not None:
                failed.setdefault(states[i].req_id, reason)
            if lps and lps[at] is not None:
                logprobs[states[i].req_id] = logprob_info(lps[at : at + a + 1])
            at += w
        return sampled, logprobs


def step_positions(starts: list[int], counts: list[int]) -> tuple[np.ndarray, np.ndarray, int]:
    """(ends [R]: the end of each request's tokens in the flat batch, positions [T]: each
    token's position, the largest position) of requests whose counts[i] tokens start at
    position starts[i]. A decode step (one token each) is most steps: its positions are the
    starts, without the general path's five numpy calls (tests/executor/
    test_step_positions.py: the same arrays)."""
    n = len(counts)
    if counts.count(1) == n:
        return np.arange(1, n + 1, dtype=np.int64), np.array(starts, dtype=np.int64), max(starts)
    return step_positions_general(np.array(starts, dtype=np.int64), np.array(counts, dtype=np.int64))


def step_positions_general(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """step_positions for any step (int64 starts and counts)."""
    ends = np.cumsum(counts)
    positions = np.repeat(starts - (ends - counts), counts) + np.arange(int(ends[-1]))
    return ends, positions, int(positions.max())


def _rows_of(rows: list[int], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each tensor's `rows`: the tensors themselves where those are all their rows in order
    (no copy)."""
    if rows == list(range(tensors[0].shape[0])):
        return tensors
    return tuple(t[rows] for t in tensors)
