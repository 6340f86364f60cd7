"""A request as the scheduler sees it: tokens, counters, status and block hashes.

Token line of a request with async scheduling and one decode step in flight::

    prompt ......... | outputs ... | placeholder
    0                P             num_tokens    num_tokens + num_output_placeholders
    |<-------- num_computed_tokens (optimistic) ------->|
    |<- processed ->|<------ num_in_flight_tokens ----->|

`num_computed_tokens` counts tokens whose KV is computed *or scheduled*; the processed
count, `num_computed_tokens - num_in_flight_tokens`, is what freeing may trust.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from hybridserve.core.errors import RequestError
from hybridserve.core.logprobs import LogprobInfo


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_REMOTE_KVS = 1
    RUNNING = 2
    PREEMPTED = 3
    # Everything from here on is finished.
    FINISHED_STOPPED = 10
    FINISHED_LENGTH_CAPPED = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint every output must satisfy.

    kind "json": `spec` is a JSON schema as JSON text ({"type": "object"} for any object);
    "regex": a regular expression; "choice": a JSON list of strings, one of which is
    the whole output; "grammar": a Lark grammar (llguidance's dialect).
    """

    kind: str
    spec: str

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise RequestError(f"structured output kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}",
                               "structured_output")
        if not isinstance(self.spec, str) or not self.spec:
            raise RequestError("a structured output needs a non-empty spec", "structured_output")


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop: the one parameter set of a request, from the
    user's call down to the sampler. The scheduler reads max_tokens, stop_token_ids and
    ignore_eos; the executor the token-level rest; the front end (engine/outputs.py) the
    text-level options at the end, which the core carries but never reads."""

    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    # Logprobs of the prompt's own tokens (each given the tokens before it), with this
    # many top alternatives: 0 gives the prompt token's alone. The request then computes
    # its whole prompt (no prefix-cache or connector hit skips positions).
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    # Logits controls, applied in this order before temperature and the sampling filters
    # (the mainstream server's semantics): only allowed_token_ids may be produced; the last
    # token of a bad word whose other tokens end the sequence is banned; logit_bias is
    # added; repetition_penalty divides positive (multiplies negative) logits of tokens in
    # the prompt or output; frequency_penalty x count and presence_penalty x (count > 0)
    # over the output tokens are subtracted.
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    logit_bias: dict[int, float] | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # Every output token keeps the output a prefix of this constraint's language (a
    # grammar engine masks the logits); None: unconstrained.
    structured_output: StructuredOutput | None = None
    # Text-level options. n: independent choices per prompt, one engine request each
    # (`for_choice`). stop: strings that end generation; the text is cut before the
    # earliest match (kept when include_stop_str_in_output). bad_words: words never to
    # produce, tokenized (with and without a leading space) into bad_words_token_ids when
    # the request is prepared (frontend.prepare_params).
    n: int = 1
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    bad_words: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Every field is checked for type and range here, at the library's boundary: a value
        # that reaches the sampler unchecked (a NaN temperature, a token id outside int64)
        # would fail a whole batch, not just this request.
        _check_int("max_tokens", self.max_tokens, 1)
        _check_float("temperature", self.temperature, 0.0, None)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, 0, "0 disables it")
        _check_float("min_p", self.min_p, 0.0, 1.0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:  # a contradiction, not a request to honour one of them
            raise RequestError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})", "min_tokens")
        if self.seed is not None:
            _check_int("seed", self.seed, None)
            # A generator seed is 64 bits; torch wraps negatives the same way, so every seed
            # it accepted before keeps its stream and none can overflow it.
            self.seed %= 1 << 64
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise RequestError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}",
                               "stop_token_ids")
        self.stop_token_ids = tuple(self.stop_token_ids)
        for t in self.stop_token_ids:
            # The vocabulary's upper bound is the engine's to check (frontend.check_params).
            _check_int("stop_token_ids", t, 0, "token ids are never negative")
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, None, low_open=True)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise RequestError("allowed_token_ids must not be empty (no token could be produced)",
                                   "allowed_token_ids")
        self.bad_words_token_ids = tuple(_token_ids("bad_words", w) for w in self.bad_words_token_ids)
        if any(not w for w in self.bad_words_token_ids):
            raise RequestError("a bad word must have at least one token", "bad_words")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise RequestError("structured_output must be a StructuredOutput", "structured_output")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise RequestError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}", "logit_bias")
            for t, bias in self.logit_bias.items():
                _check_int("logit_bias", t, 0, "token ids are never negative")
                _check_float("logit_bias", bias, -100.0, 100.0)
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise RequestError(f"n must be an integer >= 1, got {self.n!r}", "n")
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(x, str) or not x for x in stops):
            raise RequestError("stop strings must be non-empty strings", "stop")
        self.stop = stops
        words = (self.bad_words,) if isinstance(self.bad_words, str) else tuple(self.bad_words or ())
        if any(not isinstance(w, str) or not w.strip() for w in words):
            raise RequestError("bad words must be non-empty strings", "bad_words")
        self.bad_words = words

    def for_choice(self, index: int) -> SamplingParams:
        """Parameters of choice `index` (an engine request of its own): a seeded choice i > 0
        uses seed + i, so the n choices differ and each is reproducible."""
        if index == 0 or self.seed is None:
            return self
        return replace(self, seed=(self.seed + index) % (1 << 63))

    @property
    def has_logits_controls(self) -> bool:
        return bool(self.allowed_token_ids is not None or self.bad_words_token_ids or self.logit_bias
                    or self.repetition_penalty != 1.0 or self.frequency_penalty or self.presence_penalty)

    def token_ids_to_check(self) -> list[tuple[str, int]]:
        """(parameter, id) of every token id this request carries, for the vocabulary check."""
        ids = [("stop_token_ids", t) for t in self.stop_token_ids]
        ids += [("allowed_token_ids", t) for t in self.allowed_token_ids or ()]
        ids += [("bad_words", t) for w in self.bad_words_token_ids for t in w]
        ids += [("logit_bias", t) for t in self.logit_bias or {}]
        return ids


def _token_ids(name: str, value: object) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise RequestError(f"{name} must be a list of token ids, got {value!r}", name)
    ids = tuple(value)  # type: ignore[arg-type]
    for t in ids:
        _check_int(name, t, 0, "token ids are never negative")
    return ids


def _check_int(name: str, value: object, minimum: int | None, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {value!r}", name)
    if minimum is not None and value < minimum:
        raise RequestError(f"{name} must be >= {minimum}{f' ({why})' if why else ''}, got {value}", name)


def _check_float(name: str, value: object, low: float, high: float | None, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {value!r}", name)
    if (value <= low if low_open else value < low) or (high is not None and value > high):
        interval = f"{'(' if low_open else '['}{low:g}, {'inf)' if high is None else f'{high:g}]'}"
        raise RequestError(f"{name} must be in {interval}, got {value}", name)


BlockHasher = Callable[["Request"], list[bytes]]


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: str | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_in_flight_tokens: int = 0
    num_output_placeholders: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until then
    num_external_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    stop_reason: int | str | None = None
    # Set by the scheduler: a whole-request free is fenced behind this step.
    last_scheduled_step: int = -1
    # Prompt logprobs (SamplingParams.prompt_logprobs) received from the runner and not
    # reported yet, and how many prompt tokens have received theirs (token 0 never does):
    # see output_processing.receive_prompt_logprobs.
    pending_prompt_logprobs: LogprobInfo | None = None
    num_prompt_logprobs: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise RequestError("request_id must be a non-empty string")
        self.prompt_token_ids = list(self.prompt_token_ids)
        if not self.prompt_token_ids:
            raise RequestError(f"request {self.request_id}: the prompt is empty")
        self._block_hasher: BlockHasher | None = None

    # -- tokens ---------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt plus sampled outputs (placeholders excluded)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without copying the whole sequence."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def num_processed_tokens(self) -> int:
        """Tokens whose step output has been processed: the settled basis for freeing."""
        return max(0, self.num_computed_tokens - self.num_in_flight_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.update_block_hashes()

    # -- block hashes -----------------------------------------------------------
    def set_block_hasher(self, hasher: BlockHasher) -> None:
        self._block_hasher = hasher
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))
