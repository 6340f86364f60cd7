"""The OpenAI-compatible HTTP server: a FastAPI app around one AsyncLLM (whose engine
replicas may run in their own core processes; the app does not depend on where).

Routes: POST /v1/completions, POST /v1/chat/completions (stream or not), GET /v1/models,
GET /health, GET /metrics.

Contracts:
- A bad request is HTTP 400 with {"error": {message, type, param, code}}; it never
  reaches the engine, so it cannot leave a request behind. Unknown routes get the
  same body shape (404/405 with Allow); an unknown model is 404 model_not_found.
- Before any route, `HttpGuard` checks the API key (401), the content type (415) and
  the body size (413). A full queue is 429 with Retry-After; n x prompts and the stop
  strings are capped (400). See server_limits.ServerLimits.
- Tokenizing a large prompt runs on a worker thread, so /health and every other
  stream keep being served while it runs.
- A request that fails inside the engine fails alone (500 / an error event). A failed
  engine step fails the open requests (503) and the engine restarts; /health is 503
  while it does, and /metrics counts restarts. Responses never carry internal
  exception text or file paths.
- Draining (SIGTERM): new requests get 503; open ones may finish until the shutdown
  timeout, then their engine requests are aborted and each open stream ends with an
  error event and [DONE] (a whole response becomes a 503).
- A client that disconnects aborts its requests: streaming responses close their body
  iterator (which aborts in AsyncLLM's generator), non-streaming handlers race the
  generation against the ASGI disconnect message.
- n choices and several prompts become one engine request per prompt (with n
  choices each); choice index = prompt index * n + choice index, as OpenAI numbers them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from hybridserve.core.errors import RequestError
from hybridserve.core.request import StructuredOutput
from hybridserve.engine.async_llm import AsyncLLM, EngineDeadError, EngineRestartingError, RequestFailedError
from hybridserve.engine.frontend import (
    ContextLengthError,
    check_in_vocabulary,
    prepare_chat,
    prepare_params,
    prepare_prompt,
)
from hybridserve.engine.outputs import CompletionOutput, GenerationOutput, SamplingParams
from hybridserve.entrypoints import openai_protocol as P
from hybridserve.entrypoints.http_guard import HttpGuard
from hybridserve.entrypoints.metrics import CONTENT_TYPE, ReplicaSnapshot, ServerMetrics
from hybridserve.entrypoints.server_limits import ServerLimits
from hybridserve.entrypoints.tool_calls import ToolError, forced_call_schema, functions, parse_tool_calls

logger = logging.getLogger("hybridserve.server")
_DONE = object()


class _SSEResponse(StreamingResponse):
    """StreamingResponse that always closes its body iterator, so an abandoned stream
    runs its cleanup (the engine abort) now rather than at garbage collection, and then
    runs `on_close` (even when the body never started)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                self.on_close()


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _prompt_only(out: CompletionOutput) -> CompletionOutput:
    """A choice of a max_tokens 0 completion: the one token generated is dropped."""
    no_logprobs = None if out.logprobs is None else []
    reason = "length" if out.finish_reason in ("stop", "length") else out.finish_reason  # abort stays abort
    return replace(out, text="", token_ids=[], logprobs=no_logprobs, delta_text="", delta_token_ids=[],
                   delta_logprobs=no_logprobs, finish_reason=reason, stop_reason=None)


async def _merge(gens: list[AsyncIterator[GenerationOutput]]) -> AsyncIterator[tuple[int, GenerationOutput]]:
    """Interleave several generators as items arrive; closing this closes (aborts) them all."""
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: Any) -> None:
        try:
            async with contextlib.aclosing(gen):
                async for item in gen:
                    queue.put_nowait((i, item))
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, _DONE))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run `work`; if the client goes away first, cancel it (its generators abort)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        return await task
    return Response(status_code=499)  # client closed the request; nobody reads this


# Prompts longer than this are tokenized on a worker thread (shorter ones take less
# time than the hop to the thread would).
INLINE_TOKENIZE_CHARS = 8192
RETRY_AFTER_S = 1


class OpenAIServer:
    def __init__(self, engine: AsyncLLM, model_name: str, metrics: ServerMetrics,
                 limits: ServerLimits | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.limits = limits or ServerLimits()
        self.created = int(time.time())
        # Engine requests (choices) admitted by this server and not yet answered. Counted
        # here, synchronously at admission, so concurrent arrivals cannot overshoot the queue.
        self.num_admitted = 0
        self.live_request_ids: set[str] = set()
        self.draining = False  # SIGTERM: no new requests
        self.stopping = False  # past the shutdown timeout: open requests were aborted

    # -- shared checks ------------------------------------------------------------
    def check_ready(self, model: str | None) -> None:
        if self.draining:
            raise P.ApiError("the server is shutting down", status=503, type_="service_unavailable",
                             code="shutting_down")
        if self.engine.dead_error is not None:
            raise P.ApiError("the engine has stopped after repeated failures", status=503, type_="engine_dead")
        if self.engine.restarting:
            raise P.ApiError("the engine is restarting after a failure; retry shortly", status=503,
                             type_="engine_restarting", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.check_model(model)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise P.ApiError(f"the model `{model}` does not exist; this server serves `{self.model_name}`",
                             status=404, param="model", code="model_not_found")

    def admit(self, num_choices: int) -> Callable[[], None]:
        """Reserve queue room for a request's engine requests; returns the release."""
        cap = self.limits.max_choices_per_request
        if num_choices > cap:
            raise P.ApiError(f"n x the number of prompts is {num_choices}; this server allows at most {cap} "
                             "per request", param="n")
        slots = self.engine.config.max_num_seqs * self.engine.config.data_parallel_size
        limit = self.limits.waiting_limit(slots)
        waiting_after = self.num_admitted + num_choices - slots
        # An idle server always takes one request, so no request is refused for its size alone.
        if self.num_admitted and waiting_after > limit:
            raise P.ApiError(f"the server is at capacity ({self.num_admitted} requests in progress, at most {limit} "
                             "waiting); retry later", status=429, type_="rate_limit_error", code="queue_full",
                             headers={"Retry-After": str(RETRY_AFTER_S)})
        self.num_admitted += num_choices
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.num_admitted -= num_choices

        return release

    def stop_strings(self, stop: str | list[str] | None) -> tuple[str, ...]:
        items = P.stop_strings(stop)
        if len(items) > self.limits.max_stop_strings:
            raise P.ApiError(f"at most {self.limits.max_stop_strings} stop strings, got {len(items)}", param="stop")
        longest = max((len(x) for x in items), default=0)
        if longest > self.limits.max_stop_string_chars:
            raise P.ApiError(f"stop strings may have at most {self.limits.max_stop_string_chars} characters, "
                             f"got one of {longest}", param="stop")
        return items

    def params(self, req: P._Sampling, prompt_len: int, max_tokens: int | None, default_max: int | None,
               logprobs: int | None, stop: tuple[str, ...], forced: StructuredOutput | None = None,
               prompt_logprobs: int | None = None) -> SamplingParams:
        """The request's SamplingParams; `forced`: a constraint of the server's own (a forced
        tool call), which the request may not combine with one of its own."""
        limit = self.engine.max_model_len
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
            return prepare_params(self.engine.parts, params)
        except RequestError as exc:
            raise P.ApiError(str(exc), param=exc.param) from None

    async def warm_grammar(self, req: P._Sampling, forced: StructuredOutput | None = None) -> None:
        """Build the grammar engine's tokenizer (seconds for a large vocabulary) on a
        worker thread the first time a request needs it, not on the event loop."""
        grammar = self.engine.parts.grammar
        if grammar is not None and not grammar.ready and (forced is not None or P.structured_output(req)):
            await asyncio.to_thread(_checked, lambda: grammar.ll_tokenizer)

    async def tokenize(self, fn: Callable[[], Any], num_chars: int) -> Any:
        """Run a prompt-preparing call, on a worker thread when the text is large."""
        if num_chars <= INLINE_TOKENIZE_CHARS:
            return _checked(fn)
        return await asyncio.to_thread(_checked, fn)

    def token_ids_shown(self, req: P._Sampling) -> bool:
        return req.return_token_ids or self.engine.tokenizer is None

    def track(self, request_ids: list[str], release: Callable[[], None]) -> Callable[[], None]:
        """Register engine request ids as live (aborted at the shutdown deadline); returns the cleanup."""
        self.live_request_ids.update(request_ids)

        def done() -> None:
            self.live_request_ids.difference_update(request_ids)
            release()

        return done

    async def begin_drain(self, timeout: float) -> None:
        """Refuse new requests; after `timeout` s abort what is still open (its streams then
        end with an error event, see _shutdown_error)."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.live_request_ids and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.live_request_ids:
            self.stopping = True
            logger.warning("shutdown timeout: ending %d open requests", len(self.live_request_ids))
            await self.engine.abort(list(self.live_request_ids))

    def _shutdown_error(self) -> P.ApiError:
        return P.ApiError("the server shut down before this request finished", status=503,
                          type_="service_unavailable", code="shutting_down")

    # -- /v1/completions ------------------------------------------------------------
    async def completions(self, request: Request, req: P.CompletionRequest) -> Response:
        P.check_unsupported(req)
        self.check_ready(req.model)
        P.check_logprob_count(req.logprobs, "logprobs")
        P.check_logprob_count(req.prompt_logprobs, "prompt_logprobs")
        if req.max_tokens == 0 and not req.echo:
            raise P.ApiError("max_tokens 0 needs echo: true (the prompt scored alone)", param="max_tokens")
        # An echoed prompt with logprobs is scored too, with the completion's alternatives.
        scored_echo = req.logprobs if req.echo else None
        prompt_top = max((n for n in (scored_echo, req.prompt_logprobs) if n is not None), default=None)
        # max_tokens 0: one token is generated (the engine always samples after the prompt)
        # and dropped from the reply.
        max_tokens = 1 if req.max_tokens == 0 else req.max_tokens
        prompts: list[Any]
        if isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], int)):
            prompts = [req.prompt]
        else:
            prompts = list(req.prompt)
        if not prompts:
            raise P.ApiError("prompt must not be empty", param="prompt")
        stop = self.stop_strings(req.stop)
        release = self.admit(len(prompts) * req.n)  # refuse before the costly part: tokenizing
        try:
            prepared = []
            for p in prompts:
                text, ids = await self.tokenize(lambda p=p: prepare_prompt(self.engine.parts, p),
                                                len(p) if isinstance(p, str) else 0)
                prepared.append((text, ids, self.params(req, len(ids), max_tokens, 16, req.logprobs, stop,
                                                        prompt_logprobs=prompt_top)))
            self.check_ready(req.model)  # the engine may have failed while we tokenized
        except BaseException:
            release()
            raise
        rid = f"cmpl-{uuid.uuid4().hex}"
        rids = [f"{rid}-{i}" for i in range(len(prepared))]
        done = self.track(rids, release)
        gens = [self.engine.generate_tokens(ids, sp, r, text) for r, (text, ids, sp) in zip(rids, prepared)]
        echo = [(text if text is not None else self._decode(ids)) if req.echo else "" for text, ids, _ in prepared]
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name}
        prompt_tokens = sum(len(ids) for _, ids, _ in prepared)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _SSEResponse(self._stream_completion(gens, head, req, echo, prompt_tokens, include_usage), done)
        try:
            return await _until_disconnect(request, self._full_completion(gens, head, req, echo, prompt_tokens))
        finally:
            done()

    def _decode(self, ids: list[int]) -> str:
        tok = self.engine.tokenizer
        return tok.decode(ids) if tok is not None else ""

    def _cmpl_logprobs(self, entries: Any, offset: int) -> dict[str, Any] | None:
        if entries is None:
            return None
        return P.completion_logprobs(P.token_text_of(self.engine.tokenizer), entries, offset)

    def _first_cmpl_choice(self, req: P.CompletionRequest, index: int, text: str, out: CompletionOutput,
                           prompt: GenerationOutput) -> dict[str, Any]:
        """A choice's first piece (the whole choice when not streamed): `text` is the echoed
        prompt, if any, then out.delta_text. An echoed prompt's logprobs lead the choice's
        logprobs, and `prompt_logprobs` rides along when asked for."""
        token_text = P.token_text_of(self.engine.tokenizer)
        lp = self._cmpl_logprobs(out.delta_logprobs, len(text) - len(out.delta_text))
        scored = prompt.prompt_logprobs
        if scored is not None and req.echo and req.logprobs is not None:
            echoed = P.completion_logprobs(token_text, scored[1:], 0, prompt.prompt_token_ids[0])  # type: ignore[arg-type]
            lp = P.joined_logprobs(echoed, lp)
        choice = P.completion_choice(index, text, out, lp, out.delta_token_ids if self.token_ids_shown(req) else None)
        if scored is not None and req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = P.prompt_logprobs_field(token_text, scored)
        return choice

    async def _full_completion(self, gens: list, head: dict, req: P.CompletionRequest, echo: list[str],
                               prompt_tokens: int) -> Response:
        prompts: dict[int, GenerationOutput] = {}
        finals = await self._collect(gens, prompts)
        choices, completion_tokens = [], 0
        for (pi, ci), out in sorted(finals.items()):
            if req.max_tokens == 0:
                out = _prompt_only(out)
            out = replace(out, delta_text=out.text, delta_token_ids=out.token_ids, delta_logprobs=out.logprobs)
            completion_tokens += len(out.token_ids)
            choices.append(self._first_cmpl_choice(req, pi * req.n + ci, echo[pi] + out.text, out, prompts[pi]))
        return JSONResponse({**head, "choices": choices, "usage": P.usage(prompt_tokens, completion_tokens)})

    async def _stream_completion(self, gens: list, head: dict, req: P.CompletionRequest, echo: list[str],
                                 prompt_tokens: int, include_usage: bool) -> AsyncIterator[str]:
        offsets: dict[tuple[int, int], int] = {}
        completion_tokens = 0
        show_ids = self.token_ids_shown(req)
        try:
            async with contextlib.aclosing(_merge(gens)) as merged:
                async for pi, out in merged:
                    for c in out.outputs:
                        if self.stopping and c.finish_reason == "abort":
                            raise self._shutdown_error()
                        if req.max_tokens == 0:
                            c = _prompt_only(c)
                        key = (pi, c.index)
                        first = key not in offsets  # no chunk of this choice sent yet
                        text = (echo[pi] if first else "") + c.delta_text
                        completion_tokens += len(c.delta_token_ids)
                        if not text and not c.finished and not (show_ids and c.delta_token_ids):
                            continue
                        offset = offsets.get(key, 0)
                        offsets[key] = offset + len(text)
                        if first:
                            choice = self._first_cmpl_choice(req, pi * req.n + c.index, text, c, out)
                        else:
                            lp = self._cmpl_logprobs(c.delta_logprobs, offset)
                            choice = P.completion_choice(pi * req.n + c.index, text, c, lp,
                                                         c.delta_token_ids if show_ids else None)
                        yield _sse({**head, "choices": [choice]})
            if include_usage:
                yield _sse({**head, "choices": [], "usage": P.usage(prompt_tokens, completion_tokens)})
        except Exception as exc:  # noqa: BLE001 - every failure ends the stream with an error event
            yield _sse(_error_for(exc).body())
        yield "data: [DONE]\n\n"

    # -- /v1/chat/completions -------------------------------------------------------------
    async def chat(self, request: Request, req: P.ChatRequest) -> Response:
        P.check_unsupported(req)
        self.check_ready(req.model)
        P.check_logprob_count(req.top_logprobs, "top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise P.ApiError("top_logprobs needs logprobs=true", param="top_logprobs")
        P.check_logprob_count(req.prompt_logprobs, "prompt_logprobs")
        messages = [_message(m, model=self.model_name) for m in req.messages]
        stop = self.stop_strings(req.stop)
        tools = self.tool_plan(req)
        release = self.admit(req.n)
        try:
            base = SamplingParams(stop=stop)  # the chat helper may add the plain template's stop
            offered = req.tools if tools is not None else None
            text, ids, base = await self.tokenize(lambda: prepare_chat(self.engine.parts, messages, base, offered),
                                                  sum(len(m["content"] or "") for m in messages))
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            top_n = req.top_logprobs or 0
            forced = tools.forced if tools is not None else None
            await self.warm_grammar(req, forced)
            sp = self.params(req, len(ids), max_tokens, None, top_n if req.logprobs else None, tuple(base.stop),
                             forced, req.prompt_logprobs)
            self.check_ready(req.model)
        except BaseException:
            release()
            raise
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        done = self.track([rid], release)
        gen = self.engine.generate_tokens(ids, sp, rid, text)
        head = {"id": rid, "created": int(time.time()), "model": self.model_name}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _SSEResponse(self._stream_chat(gen, head, req, len(ids), top_n, include_usage, tools), done)
        try:
            return await _until_disconnect(request, self._full_chat(gen, head, req, len(ids), top_n, tools))
        finally:
            done()

    def tool_plan(self, req: P.ChatRequest) -> ToolPlan | None:
        """The tools a chat request offers and, for "required" or a named function, the
        constraint that forces a call; None without tools (or with tool_choice "none")."""
        if not req.tools or req.tool_choice == "none":
            if req.tool_choice not in (None, "none", "auto"):
                raise P.ApiError("tool_choice needs tools", param="tool_choice")
            return None
        tok = self.engine.tokenizer
        if tok is None or not tok.supports_tools:
            raise P.ApiError("this model's chat template has no tool format, so it cannot call tools", param="tools")
        try:
            funcs = functions(req.tools)
        except ToolError as exc:
            raise P.ApiError(str(exc), param="tools") from None
        try:
            schema = forced_call_schema(funcs, req.tool_choice)
        except ToolError as exc:
            raise P.ApiError(str(exc), param="tool_choice") from None
        return ToolPlan(set(funcs), None if schema is None else StructuredOutput("json", json.dumps(schema)))

    def _chat_logprobs(self, entries: Any, top_n: int) -> dict[str, Any] | None:
        if entries is None or self.engine.tokenizer is None:
            return None
        return P.chat_logprobs(self.engine.tokenizer, entries, top_n)

    async def _full_chat(self, gen: Any, head: dict, req: P.ChatRequest, prompt_tokens: int, top_n: int,
                         tools: ToolPlan | None) -> Response:
        prompts: dict[int, GenerationOutput] = {}
        finals = await self._collect([gen], prompts)
        choices = []
        for (_, ci), out in sorted(finals.items()):
            calls = parse_tool_calls(out.text, tools.names) if tools is not None else None
            choices.append(self._with_prompt_logprobs(
                P.chat_choice(out, ci, self._chat_logprobs(out.logprobs, top_n), calls), prompts[0]))
        completion_tokens = sum(len(out.token_ids) for out in finals.values())
        return JSONResponse({**head, "object": "chat.completion", "choices": choices,
                             "usage": P.usage(prompt_tokens, completion_tokens)})

    def _with_prompt_logprobs(self, choice: dict[str, Any], prompt: GenerationOutput) -> dict[str, Any]:
        """A chat choice (or a choice's first chunk) with `prompt_logprobs`, when asked for."""
        if prompt.prompt_logprobs is not None:
            choice["prompt_logprobs"] = P.prompt_logprobs_field(P.token_text_of(self.engine.tokenizer),
                                                                prompt.prompt_logprobs)
        return choice

    async def _stream_chat(self, gen: Any, head: dict, req: P.ChatRequest, prompt_tokens: int, top_n: int,
                           include_usage: bool, tools: ToolPlan | None) -> AsyncIterator[str]:
        head = {**head, "object": "chat.completion.chunk"}
        completion_tokens = 0
        started: set[int] = set()
        try:
            for i in range(req.n):
                delta = {"role": "assistant", "content": ""}
                yield _sse({**head, "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]})
            async with contextlib.aclosing(_merge([gen])) as merged:
                async for _, out in merged:
                    for c in out.outputs:
                        if self.stopping and c.finish_reason == "abort":
                            raise self._shutdown_error()
                        completion_tokens += len(c.delta_token_ids)
                        if tools is not None:
                            # A call is only known whole: the reply is held back and sent
                            # parsed, as content and tool_calls, when the choice finishes.
                            if c.finished:
                                choice = P.chat_tool_delta(c, parse_tool_calls(c.text, tools.names))
                                yield _sse({**head, "choices": [self._with_prompt_logprobs(choice, out)]})
                            continue
                        if not c.delta_text and not c.finished:
                            continue
                        choice = {"index": c.index, "delta": {"content": c.delta_text} if c.delta_text else {},
                                  "logprobs": self._chat_logprobs(c.delta_logprobs, top_n),
                                  "finish_reason": P.finish_reason(c.finish_reason)}
                        if c.index not in started:  # the choice's first chunk with content
                            started.add(c.index)
                            choice = self._with_prompt_logprobs(choice, out)
                        yield _sse({**head, "choices": [choice]})
            if include_usage:
                yield _sse({**head, "choices": [], "usage": P.usage(prompt_tokens, completion_tokens)})
        except Exception as exc:  # noqa: BLE001 - every failure ends the stream with an error event
            yield _sse(_error_for(exc).body())
        yield "data: [DONE]\n\n"

    async def _collect(self, gens: list, prompts: dict[int, GenerationOutput] | None = None
                       ) -> dict[tuple[int, int], Any]:
        """Each choice's final output by (prompt, choice); `prompts` gets each prompt's last
        output (its prompt logprobs)."""
        finals: dict[tuple[int, int], Any] = {}
        try:
            async with contextlib.aclosing(_merge(gens)) as merged:
                async for pi, out in merged:
                    if prompts is not None:
                        prompts[pi] = out
                    for c in out.outputs:
                        finals[(pi, c.index)] = c
        except Exception as exc:  # noqa: BLE001 - mapped to an OpenAI-style error
            raise _error_for(exc) from None
        if self.stopping and any(c.finish_reason == "abort" for c in finals.values()):
            raise self._shutdown_error()
        return finals

    # -- /tokenize, /detokenize (the mainstream server's extensions) ----------------------
    # They need the tokenizer alone, so they answer while the engine restarts or drains.
    def _tokenizer(self, param: str) -> Any:
        tok = self.engine.tokenizer
        if tok is None:
            raise P.ApiError("this model has no tokenizer", param=param)
        return tok

    async def tokenize_text(self, req: P.TokenizeRequest) -> dict[str, Any]:
        """A prompt's token ids, or a conversation's as chat renders it; a text longer than
        the context is counted too (`max_model_len` beside it says whether it fits)."""
        self.check_model(req.model)
        tok = self._tokenizer("prompt" if req.messages is None else "messages")
        if (req.prompt is None) == (req.messages is None):
            raise P.ApiError("give either prompt or messages", param="prompt")
        if req.messages is not None:
            messages = [_message(m, model=self.model_name) for m in req.messages]
            ids = await self.tokenize(lambda: tok.chat_prompt(messages)[1],
                                      sum(len(m["content"] or "") for m in messages))
        else:
            text = req.prompt
            ids = await self.tokenize(lambda: tok.encode(text, req.add_special_tokens, param="prompt"), len(text))
        body: dict[str, Any] = {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = [tok.token_text(t) for t in ids]
        return body

    async def detokenize_ids(self, req: P.DetokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        tok = self._tokenizer("tokens")
        _checked(lambda: check_in_vocabulary(req.tokens, self.engine.parts.vocab_size, "tokens"))
        # Special tokens kept: the text of exactly these ids, as /tokenize gave them.
        return {"prompt": await self.tokenize(lambda: tok.decode(req.tokens, skip_special_tokens=False),
                                              len(req.tokens))}

    # -- the rest ------------------------------------------------------------------------
    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "hybridserve",
            "root": self.model_name, "max_model_len": self.engine.max_model_len,
        }]}

    async def render_metrics(self) -> Response:
        stats = await self.engine.get_replica_stats()
        body = self.metrics.render([ReplicaSnapshot(s, r.serving, list(r.restart_reasons), r.num_routed)
                                    for s, r in zip(stats, self.engine.replicas)])
        return Response(body, media_type=CONTENT_TYPE)

    def health(self) -> Response:
        try:
            self.check_ready(None)
        except P.ApiError as err:
            return _error_response(err)
        return JSONResponse({"status": "ok"})


@dataclass
class ToolPlan:
    names: set[str]  # the functions offered: only calls of these are parsed
    forced: StructuredOutput | None  # tool_choice "required" or named: the reply's constraint


def _message(m: P.ChatMessage, model: str) -> dict[str, Any]:
    """A chat message as the chat template sees it (tool calls and tool results kept)."""
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                           "content": _content_text(m, model=model)}
    for key in ("tool_calls", "tool_call_id", "name"):
        value = getattr(m, key)
        if value is not None:
            out[key] = value
    return out


def _content_text(m: P.ChatMessage, model: str) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for part in m.content:
        if part.type != "text" or part.text is None:
            # Multimodal checkpoints (Gemma 3 4B-27B) are served by their language model only.
            raise P.ApiError(f"the model `{model}` takes text content parts only here: {part.type!r} parts "
                             "(images) are not supported yet", param="messages")
        parts.append(part.text)
    return "\n".join(parts)


def _checked(fn: Any) -> Any:
    try:
        return fn()
    except ContextLengthError as exc:
        raise P.ApiError(str(exc), param="prompt", code="context_length_exceeded") from None
    except RequestError as exc:
        raise P.ApiError(str(exc), param=exc.param) from None


def _error_for(exc: BaseException) -> P.ApiError:
    """What a client is told about a failure: never internal exception text."""
    if isinstance(exc, P.ApiError):
        return exc
    if isinstance(exc, EngineRestartingError):
        return P.ApiError(str(exc), status=503, type_="engine_restarting", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineDeadError):
        return P.ApiError("the engine failed while running this request; retry it", status=503,
                          type_="engine_dead", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, RequestFailedError):  # its message is written for clients
        return P.ApiError(str(exc), status=500, type_="internal_error")
    if isinstance(exc, RequestError):
        return P.ApiError(str(exc), param=exc.param)
    logger.error("request failed", exc_info=exc)
    return P.ApiError(f"internal error ({type(exc).__name__})", status=500, type_="internal_error")


def _error_response(err: P.ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def build_app(engine: AsyncLLM, model_name: str, metrics: ServerMetrics | None = None,
              owns_engine: bool = False, limits: ServerLimits | None = None) -> FastAPI:
    """The app: the HTTP guard around the FastAPI routes. With owns_engine the app's
    shutdown (lifespan end) stops the engine; otherwise the caller does. The OpenAIServer
    is at `app.state.server` (draining is started through it)."""
    limits = limits or ServerLimits()
    metrics = metrics or ServerMetrics()
    engine.on_request_finished = metrics.on_request_finished
    server = OpenAIServer(engine, model_name, metrics, limits)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if owns_engine:
            await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)

    app = FastAPI(title="hybridserve", summary="OpenAI-compatible serving of hybrid-attention models",
                  docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.server = server
    # The last added middleware is the outermost: CORS answers preflights (which carry
    # no API key) before the guard asks for one.
    app.add_middleware(HttpGuard, limits=limits)
    if limits.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(limits.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])

    @app.exception_handler(P.ApiError)
    async def api_error(_: Request, exc: P.ApiError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = P.ApiError(str(exc.detail), status=exc.status_code, code=str(exc.status_code),
                         headers=dict(exc.headers) if exc.headers else None)  # 405 keeps its Allow
        return _error_response(err)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(P.validation_error(exc.errors()))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        return _error_response(_error_for(exc))

    @app.post("/v1/completions")
    async def completions(request: Request, body: P.CompletionRequest) -> Response:
        return await server.completions(request, body)

    @app.post("/v1/chat/completions")
    async def chat(request: Request, body: P.ChatRequest) -> Response:
        return await server.chat(request, body)

    @app.post("/tokenize")
    async def tokenize(body: P.TokenizeRequest) -> dict[str, Any]:
        return await server.tokenize_text(body)

    @app.post("/detokenize")
    async def detokenize(body: P.DetokenizeRequest) -> dict[str, Any]:
        return await server.detokenize_ids(body)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return server.models()

    @app.get("/health")
    async def health() -> Response:
        return server.health()

    @app.get("/metrics")
    async def prometheus() -> Response:
        return await server.render_metrics()
    return app
