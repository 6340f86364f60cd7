"""A request's engine inputs: its stop strings, its SamplingParams, its prompt tokens.

Everything here raises `ApiError` (400) for what the request got wrong, before the engine
sees it. Tokenizing a large prompt, and building the grammar engine's tokenizer the
first time one is needed, run on a worker thread, so the event loop (and with it /health
and every open stream) keeps being served meanwhile.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from hybridserve.core.errors import RequestError
from hybridserve.core.request import StructuredOutput
from hybridserve.engine.async_llm import AsyncLLM
from hybridserve.engine.frontend import prepare_params
from hybridserve.engine.outputs import SamplingParams
from hybridserve.entrypoints.openai import protocol as P
from hybridserve.entrypoints.openai.errors import checked
from hybridserve.entrypoints.openai.limits import ServerLimits

# Prompts longer than this are tokenized on a worker thread (shorter ones take less
# time than the hop to the thread would).
INLINE_TOKENIZE_CHARS = 8192


async def tokenized(fn: Callable[[], Any], num_chars: int) -> Any:
    """Run a prompt-preparing call, on a worker thread when the text is large."""
    if num_chars <= INLINE_TOKENIZE_CHARS:
        return checked(fn)
    return await asyncio.to_thread(checked, fn)


async def warm_grammar(engine: AsyncLLM, req: P._Sampling, forced: StructuredOutput | None = None) -> None:
    """Build the grammar engine's tokenizer (seconds for a large vocabulary) on a
    worker thread the first time a request needs it, not on the event loop."""
    grammar = engine.parts.grammar
    if grammar is not None and not grammar.ready and (forced is not None or P.structured_output(req)):
        await asyncio.to_thread(checked, lambda: grammar.ll_tokenizer)


def stop_strings(limits: ServerLimits, stop: str | list[str] | None) -> tuple[str, ...]:
    items = P.stop_strings(stop)
    if len(items) > limits.max_stop_strings:
        raise P.ApiError(f"at most {limits.max_stop_strings} stop strings, got {len(items)}", param="stop")
    longest = max((len(x) for x in items), default=0)
    if longest > limits.max_stop_string_chars:
        raise P.ApiError(f"stop strings may have at most {limits.max_stop_string_chars} characters, "
                         f"got one of {longest}", param="stop")
    return items


def sampling_params(engine: AsyncLLM, req: P._Sampling, prompt_len: int, max_tokens: int | None,
                    default_max: int | None, logprobs: int | None, stop: tuple[str, ...],
                    forced: StructuredOutput | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
    """The request's SamplingParams; `forced`: a constraint of the server's own (a forced
    tool call), which the request may not combine with one of its own."""
    limit = engine.max_model_len
    structured = P.structured_output(req)
    if forced is not None:
        if structured is not None:
            raise P.ApiError("a forced tool call cannot be combined with response_format or guided_*",
                             param="tool_choice")
        structured = forced
    if max_tokens is not None:
        if max_tokens < 1:
            raise P.ApiError(f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
        if prompt_len + max_tokens > limit:
            raise P.ApiError(
                f"this model's maximum context length is {limit} tokens; the request asks for "
                f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} for the completion)",
                param="max_tokens", code="context_length_exceeded")
    else:
        max_tokens = min(default_max or limit, limit - prompt_len)
    seed = None if req.seed is None else req.seed % (1 << 63)
    temperature = 1.0 if req.temperature is None else req.temperature
    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0, min_p=req.min_p or 0.0, seed=seed, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, n=req.n, stop=stop,
            stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens, presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=P.logit_bias(req.logit_bias),
            allowed_token_ids=None if req.allowed_token_ids is None else tuple(req.allowed_token_ids),
            bad_words=tuple(req.bad_words or ()), structured_output=structured,
        )
        return prepare_params(engine.parts, params)
    except RequestError as exc:
        raise P.ApiError(str(exc), param=exc.param) from None
