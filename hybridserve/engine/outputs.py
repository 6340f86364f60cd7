"""What users get back: generation outputs, built from the engine's token-level outputs.

Users pass a `SamplingParams` (core/request.py, re-exported here and as
`hybridserve.SamplingParams`). The core scheduler works in token ids. Everything text-level
(the text options of SamplingParams included) is applied here, shared by the
blocking `LLM`, the `AsyncLLM` and the server, so all three produce the same text:
incremental detokenizing, stop strings, n choices (one engine request each),
logprobs and per-request timing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Sequence

from hybridserve.core.errors import RequestError
from hybridserve.core.request import Request, SamplingParams
from hybridserve.core.sched.output import LogprobInfo
from hybridserve.core.sched.output import RequestOutput as CoreOutput
from hybridserve.text.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None = None  # the top-n (token id, logprob), most likely first


@dataclass
class CompletionOutput:
    """One choice. text/token_ids/logprobs are cumulative; delta_* is what is new in this output."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that matched
    logprobs: list[TokenLogprob] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class GenerationOutput:
    """One prompt's result (from LLM.generate) or an incremental update (from AsyncLLM)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # Per choice timing, in final outputs of LLM.generate (None in incremental outputs).
    metrics: list[RequestMetrics] | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first
    # (nothing precedes it), the others each given the tokens before it. Complete once the
    # prompt is computed (from the first output with a token on).
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass
class RequestMetrics:
    """Timing of one finished choice (time.monotonic seconds)."""

    arrival_time: float
    first_token_time: float | None
    finish_time: float
    num_prompt_tokens: int
    num_generation_tokens: int
    finish_reason: str

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token_time is None or self.num_generation_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_generation_tokens - 1)


class SequenceState:
    """One choice's text state. Invariant: text[:emitted] has been handed out and never changes."""

    def __init__(self, index: int, prompt_token_ids: Sequence[int], params: SamplingParams,
                 tokenizer: Tokenizer | None) -> None:
        self.index = index
        self.params = params
        # `is not None`, not truth: a tokenizer's len() counts its vocabulary, a cost per request.
        self.detok: IncrementalDetokenizer | None = (
            tokenizer.detokenizer(prompt_token_ids, params.skip_special_tokens) if tokenizer is not None else None
        )
        self.max_stop_len = max((len(s) for s in params.stop), default=0)
        self.token_ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.pending_ids: list[int] = []
        self.pending_logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.changed = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, out: CoreOutput, now: float) -> bool:
        """Apply one engine output. True when a stop string ended the choice (abort it)."""
        if self.finished:
            return False
        new = out.new_token_ids
        if new and self.first_token_time is None:
            self.first_token_time = now
        self.token_ids.extend(new)
        self.pending_ids.extend(new)
        if self.logprobs is not None and out.logprobs is not None:
            lps = _logprobs(new, out.logprobs)
            self.logprobs.extend(lps)
            self.pending_logprobs.extend(lps)
        self.changed = self.changed or bool(new) or out.finished
        stop_hit = False
        if self.detok is not None:
            before = len(self.text)
            self.text += self.detok.push(new)
            if out.finished:
                self.text += self.detok.finish()
            stop_hit = self._check_stop_strings(before)
        if out.finished and not stop_hit:
            self._finish(out.finish_reason or "stop", out.stop_reason, now)
        elif stop_hit:
            self.finish_time = now
        return stop_hit

    def _check_stop_strings(self, checked_before: int) -> bool:
        if not self.max_stop_len or len(self.text) == checked_before:
            return False
        start = max(0, checked_before - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in self.params.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.text = self.text[: i + len(s)] if self.params.include_stop_str_in_output else self.text[:i]
        self.finish_reason, self.stop_reason = "stop", s
        self.changed = True
        return True

    def _finish(self, reason: str, stop_reason: int | str | None, now: float) -> None:
        self.finish_reason, self.stop_reason, self.finish_time = reason, stop_reason, now

    def abort(self, now: float) -> None:
        if not self.finished:
            self._finish("abort", None, now)
            self.changed = True

    def take_delta(self) -> CompletionOutput | None:
        """What is new since the last call, or None. While unfinished, the last
        max_stop_len - 1 characters stay back (they may begin a stop string)."""
        if not self.changed:
            return None
        self.changed = False
        end = len(self.text) if self.finished else max(self.emitted, len(self.text) - max(0, self.max_stop_len - 1))
        delta = self.text[self.emitted:end]
        if not delta and not self.finished and self.detok is not None:
            self.changed = bool(self.pending_ids)  # keep the tokens for the next delta
            return None
        self.emitted = end
        ids, self.pending_ids = self.pending_ids, []
        lps, self.pending_logprobs = self.pending_logprobs, []
        return CompletionOutput(
            self.index, self.text[:end], list(self.token_ids), self.finish_reason, self.stop_reason,
            self.logprobs, delta, ids, lps if self.logprobs is not None else None,
        )

    def snapshot(self) -> CompletionOutput:
        return CompletionOutput(self.index, self.text, list(self.token_ids), self.finish_reason, self.stop_reason,
                                self.logprobs)


def _logprobs(token_ids: list[int], info: LogprobInfo) -> list[TokenLogprob]:
    tops = info.top_logprobs
    return [
        TokenLogprob(t, lp, list(tops[k]) if tops is not None and tops[k] is not None else None)
        for k, (t, lp) in enumerate(zip(token_ids, info.token_logprobs))
    ]


class GenerationTracker:
    """One prompt with its n choices; choice i runs as engine request `core_ids[i]`."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer: Tokenizer | None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.arrival_time = time.monotonic()
        self.core_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        self.seqs = [SequenceState(i, prompt_token_ids, params.for_choice(i), tokenizer) for i in range(params.n)]
        self.by_core_id = dict(zip(self.core_ids, self.seqs))
        self.num_cached_tokens = 0
        # Every choice's engine request computes them and reports them whole with its first
        # token (core/sched/output_processing.py); the first report is kept.
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )

    @property
    def finished(self) -> bool:
        for s in self.seqs:  # a plain loop: read for every output streamed
            if s.finish_reason is None:
                return False
        return True

    def core_requests(self, eos_token_id: int | None, model_stop_ids: Sequence[int]) -> list[Request]:
        out = []
        for core_id, seq in zip(self.core_ids, self.seqs):
            p = seq.params
            extra = [t for t in model_stop_ids if t not in p.stop_token_ids] if not p.ignore_eos else []
            if extra:
                p = replace(p, stop_token_ids=tuple(p.stop_token_ids) + tuple(extra))
            out.append(Request(core_id, self.prompt_token_ids, p, eos_token_id=eos_token_id,
                               arrival_time=self.arrival_time))
        return out

    def process(self, out: CoreOutput, now: float) -> bool:
        """Apply an engine output of one of the choices; True if that choice must be aborted."""
        if out.num_cached_tokens:
            self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.prompt_logprobs is not None and self.prompt_logprobs == [None]:
            self.prompt_logprobs += _logprobs(self.prompt_token_ids[1:], out.prompt_logprobs)
        return self.by_core_id[out.request_id].update(out, now)

    def metrics(self, core_id: str) -> RequestMetrics:
        seq = self.by_core_id[core_id]
        return RequestMetrics(self.arrival_time, seq.first_token_time, seq.finish_time or time.monotonic(),
                              len(self.prompt_token_ids), len(seq.token_ids), seq.finish_reason or "abort")

    def take_output(self) -> GenerationOutput | None:
        """The choices that changed since the last call (delta_* filled), or None."""
        deltas = [d for d in (s.take_delta() for s in self.seqs) if d is not None]
        if not deltas:
            return None
        return GenerationOutput(self.request_id, self.prompt, self.prompt_token_ids, deltas, self.finished,
                                self.num_cached_tokens, prompt_logprobs=self.prompt_logprobs)

    def final_output(self) -> GenerationOutput:
        return GenerationOutput(self.request_id, self.prompt, self.prompt_token_ids,
                                [s.snapshot() for s in self.seqs], self.finished, self.num_cached_tokens,
                                [self.metrics(cid) for cid in self.core_ids], self.prompt_logprobs)


def as_sampling_params(params: SamplingParams | None) -> SamplingParams:
    """The request's params: the defaults for None; a one-line RequestError for anything else."""
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    raise RequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
