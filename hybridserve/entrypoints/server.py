"""The OpenAI-compatible HTTP server: a FastAPI app around one AsyncLLM.

Routes: POST /v1/completions, POST /v1/chat/completions (stream or not), GET /v1/models,
GET /health, GET /metrics.

Contracts:
- A bad request is HTTP 400 with {"error": {message, type, param, code}}; it never
  reaches the engine, so it cannot leave a request behind. Unknown routes get the
  same body shape (404/405). A dead engine answers 503.
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
from typing import Any, AsyncIterator, Awaitable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridserve.core.errors import RequestError
from hybridserve.engine.async_llm import AsyncLLM, EngineDeadError
from hybridserve.engine.frontend import ContextLengthError, prepare_chat, prepare_prompt
from hybridserve.engine.outputs import GenerationOutput, SamplingParams
from hybridserve.entrypoints import openai_protocol as P
from hybridserve.entrypoints.metrics import CONTENT_TYPE, ServerMetrics

logger = logging.getLogger("hybridserve.server")
_DONE = object()


class _SSEResponse(StreamingResponse):
    """StreamingResponse that always closes its body iterator, so an abandoned stream
    runs its cleanup (the engine abort) now rather than at garbage collection."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


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


class OpenAIServer:
    def __init__(self, engine: AsyncLLM, model_name: str, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.created = int(time.time())

    # -- shared checks ------------------------------------------------------------
    def check_ready(self, model: str | None) -> None:
        if self.engine.dead_error is not None:
            raise P.ApiError(str(self.engine.dead_error), status=503, type_="engine_dead")
        if model is not None and model != self.model_name:
            raise P.ApiError(f"the model `{model}` does not exist; this server serves `{self.model_name}`",
                             param="model", code="model_not_found")

    def params(self, req: P._Sampling, prompt_len: int, max_tokens: int | None, default_max: int | None,
               logprobs: int | None, stop: tuple[str, ...]) -> SamplingParams:
        limit = self.engine.max_model_len
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
            return SamplingParams(
                max_tokens=max_tokens, temperature=temperature, top_p=1.0 if req.top_p is None else req.top_p,
                top_k=req.top_k or 0, min_p=req.min_p or 0.0, seed=seed, logprobs=logprobs, n=req.n, stop=stop,
                stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                min_tokens=req.min_tokens,
            )
        except RequestError as exc:
            raise P.ApiError(str(exc)) from None

    # -- /v1/completions ------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        req = P.parse_body(P.CompletionRequest, await request.body())
        P.check_unsupported(req)
        self.check_ready(req.model)
        if req.logprobs is not None and not 0 <= req.logprobs <= P.MAX_LOGPROBS:
            raise P.ApiError(f"logprobs must be between 0 and {P.MAX_LOGPROBS}", param="logprobs")
        prompts: list[Any]
        if isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], int)):
            prompts = [req.prompt]
        else:
            prompts = list(req.prompt)
        if not prompts:
            raise P.ApiError("prompt must not be empty", param="prompt")
        stop = P.stop_strings(req.stop)
        prepared = []
        for p in prompts:
            text, ids = _checked(lambda: prepare_prompt(self.engine.parts, p))
            prepared.append((text, ids, self.params(req, len(ids), req.max_tokens, 16, req.logprobs, stop)))
        rid = f"cmpl-{uuid.uuid4().hex}"
        gens = [self.engine.generate_tokens(ids, sp, f"{rid}-{i}", text) for i, (text, ids, sp) in enumerate(prepared)]
        echo = [(text if text is not None else self._decode(ids)) if req.echo else "" for text, ids, _ in prepared]
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name}
        prompt_tokens = sum(len(ids) for _, ids, _ in prepared)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _SSEResponse(self._stream_completion(gens, head, req, echo, prompt_tokens, include_usage),
                                media_type="text/event-stream")
        return await _until_disconnect(request, self._full_completion(gens, head, req, echo, prompt_tokens))

    def _decode(self, ids: list[int]) -> str:
        tok = self.engine.tokenizer
        return tok.decode(ids) if tok is not None else ""

    def _cmpl_logprobs(self, entries: Any, offset: int) -> dict[str, Any] | None:
        if entries is None or self.engine.tokenizer is None:
            return None
        return P.completion_logprobs(self.engine.tokenizer, entries, offset)

    async def _full_completion(self, gens: list, head: dict, req: P.CompletionRequest, echo: list[str],
                               prompt_tokens: int) -> Response:
        finals = await _collect(gens)
        choices, completion_tokens = [], 0
        for (pi, ci), out in sorted(finals.items()):
            completion_tokens += len(out.token_ids)
            lp = self._cmpl_logprobs(out.logprobs, len(echo[pi]))
            choices.append(P.completion_choice(pi * req.n + ci, echo[pi] + out.text, out, lp))
        return JSONResponse({**head, "choices": choices, "usage": P.usage(prompt_tokens, completion_tokens)})

    async def _stream_completion(self, gens: list, head: dict, req: P.CompletionRequest, echo: list[str],
                                 prompt_tokens: int, include_usage: bool) -> AsyncIterator[str]:
        offsets: dict[tuple[int, int], int] = {}
        completion_tokens = 0
        try:
            async with contextlib.aclosing(_merge(gens)) as merged:
                async for pi, out in merged:
                    for c in out.outputs:
                        key = (pi, c.index)
                        first = key not in offsets
                        text = (echo[pi] if first else "") + c.delta_text
                        offset = offsets.get(key, 0)
                        offsets[key] = offset + len(text)
                        completion_tokens += len(c.delta_token_ids)
                        if not text and not c.finished:
                            continue
                        lp = self._cmpl_logprobs(c.delta_logprobs, offset + (len(echo[pi]) if first else 0))
                        yield _sse({**head, "choices": [P.completion_choice(pi * req.n + c.index, text, c, lp)]})
            if include_usage:
                yield _sse({**head, "choices": [], "usage": P.usage(prompt_tokens, completion_tokens)})
        except (RequestError, EngineDeadError) as exc:
            yield _sse(_error_body(exc))
        yield "data: [DONE]\n\n"

    # -- /v1/chat/completions -------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        req = P.parse_body(P.ChatRequest, await request.body())
        P.check_unsupported(req)
        self.check_ready(req.model)
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= P.MAX_LOGPROBS:
            raise P.ApiError(f"top_logprobs must be between 0 and {P.MAX_LOGPROBS}", param="top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise P.ApiError("top_logprobs needs logprobs=true", param="top_logprobs")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": _content_text(m)}
                    for m in req.messages]
        stop = P.stop_strings(req.stop)
        base = SamplingParams(stop=stop)  # the chat helper may add the plain template's stop
        text, ids, base = _checked(lambda: prepare_chat(self.engine.parts, messages, base))
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top_n = req.top_logprobs or 0
        sp = self.params(req, len(ids), max_tokens, None, top_n if req.logprobs else None, tuple(base.stop))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        gen = self.engine.generate_tokens(ids, sp, rid, text)
        head = {"id": rid, "created": int(time.time()), "model": self.model_name}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _SSEResponse(self._stream_chat(gen, head, req, len(ids), top_n, include_usage),
                                media_type="text/event-stream")
        return await _until_disconnect(request, self._full_chat(gen, head, req, len(ids), top_n))

    def _chat_logprobs(self, entries: Any, top_n: int) -> dict[str, Any] | None:
        if entries is None or self.engine.tokenizer is None:
            return None
        return P.chat_logprobs(self.engine.tokenizer, entries, top_n)

    async def _full_chat(self, gen: Any, head: dict, req: P.ChatRequest, prompt_tokens: int, top_n: int) -> Response:
        finals = await _collect([gen])
        choices = [P.chat_choice(out, ci, self._chat_logprobs(out.logprobs, top_n)) for (_, ci), out in sorted(finals.items())]
        completion_tokens = sum(len(out.token_ids) for out in finals.values())
        return JSONResponse({**head, "object": "chat.completion", "choices": choices,
                             "usage": P.usage(prompt_tokens, completion_tokens)})

    async def _stream_chat(self, gen: Any, head: dict, req: P.ChatRequest, prompt_tokens: int, top_n: int,
                           include_usage: bool) -> AsyncIterator[str]:
        head = {**head, "object": "chat.completion.chunk"}
        completion_tokens = 0
        try:
            for i in range(req.n):
                delta = {"role": "assistant", "content": ""}
                yield _sse({**head, "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]})
            async with contextlib.aclosing(_merge([gen])) as merged:
                async for _, out in merged:
                    for c in out.outputs:
                        completion_tokens += len(c.delta_token_ids)
                        if not c.delta_text and not c.finished:
                            continue
                        choice = {"index": c.index, "delta": {"content": c.delta_text} if c.delta_text else {},
                                  "logprobs": self._chat_logprobs(c.delta_logprobs, top_n),
                                  "finish_reason": P.finish_reason(c.finish_reason)}
                        yield _sse({**head, "choices": [choice]})
            if include_usage:
                yield _sse({**head, "choices": [], "usage": P.usage(prompt_tokens, completion_tokens)})
        except (RequestError, EngineDeadError) as exc:
            yield _sse(_error_body(exc))
        yield "data: [DONE]\n\n"

    # -- the rest ------------------------------------------------------------------------
    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "hybridserve",
            "root": str(self.engine.parts.model_path), "max_model_len": self.engine.max_model_len,
        }]}

    async def render_metrics(self) -> Response:
        stats = await self.engine.get_stats()
        body = self.metrics.render(stats, self.engine.dead_error is None)
        return Response(body, media_type=CONTENT_TYPE)


def _content_text(m: P.ChatMessage) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for part in m.content:
        if part.type != "text" or part.text is None:
            raise P.ApiError(f"only text content parts are supported, got {part.type!r}", param="messages")
        parts.append(part.text)
    return "\n".join(parts)


def _checked(fn: Any) -> Any:
    try:
        return fn()
    except ContextLengthError as exc:
        raise P.ApiError(str(exc), param="prompt", code="context_length_exceeded") from None
    except RequestError as exc:
        raise P.ApiError(str(exc)) from None


async def _collect(gens: list) -> dict[tuple[int, int], Any]:
    finals: dict[tuple[int, int], Any] = {}
    try:
        async with contextlib.aclosing(_merge(gens)) as merged:
            async for pi, out in merged:
                for c in out.outputs:
                    finals[(pi, c.index)] = c
    except EngineDeadError as exc:
        raise P.ApiError(str(exc), status=503, type_="engine_dead") from None
    except RequestError as exc:
        raise P.ApiError(str(exc)) from None
    return finals


def _error_body(exc: Exception) -> dict[str, Any]:
    if isinstance(exc, EngineDeadError):
        return P.ApiError(str(exc), status=503, type_="engine_dead").body()
    return P.ApiError(str(exc)).body()


def build_app(engine: AsyncLLM, model_name: str, metrics: ServerMetrics | None = None,
              owns_engine: bool = False) -> FastAPI:
    """The FastAPI app. With owns_engine the app's shutdown (lifespan end) stops the engine;
    otherwise the caller does."""
    metrics = metrics or ServerMetrics()
    engine.on_request_finished = metrics.on_request_finished
    server = OpenAIServer(engine, model_name, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if owns_engine:
            await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)

    app = FastAPI(title="hybridserve", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(P.ApiError)
    async def api_error(_: Request, exc: P.ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = P.ApiError(str(exc.detail), status=exc.status_code, code=str(exc.status_code))
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(P.ApiError(str(exc)).body(), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error")
        err = P.ApiError(f"internal error: {type(exc).__name__}", status=500, type_="internal_error")
        return JSONResponse(err.body(), status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.completions(request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await server.chat(request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return server.models()

    @app.get("/health")
    async def health() -> Response:
        if engine.dead_error is not None:
            return JSONResponse(P.ApiError(str(engine.dead_error), 503, type_="engine_dead").body(), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return await server.render_metrics()

    return app
