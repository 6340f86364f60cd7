"""The OpenAI-compatible HTTP server: a FastAPI app around one AsyncLLM (whose engine
replicas may run in their own core processes; the app does not depend on where).

Routes, each handler given the one ServerContext (context.py) the app builds:
POST /v1/completions (completions.py) and POST /v1/chat/completions (chat.py), stream or
not; POST /tokenize and /detokenize (tokenize.py); GET /v1/models, /health and /metrics
(here).

Contracts:
- A bad request is HTTP 400 with {"error": {message, type, param, code}}; it never
  reaches the engine, so it cannot leave a request behind. Unknown routes get the
  same body shape (404/405 with Allow); an unknown model is 404 model_not_found.
- Before any route, `HttpGuard` checks the API key (401), the content type (415) and
  the body size (413). A full queue is 429 with Retry-After; n x prompts and the stop
  strings are capped (400). See limits.ServerLimits.
- Tokenizing a large prompt runs on a worker thread, so /health and every other
  stream keep being served while it runs (prepare.py).
- A request that fails inside the engine fails alone (500 / an error event). A failed
  engine step fails the open requests (503) and the engine restarts; /health is 503
  while it does, and /metrics counts restarts. Responses never carry internal
  exception text or file paths.
- Draining (SIGTERM): new requests get 503; open ones may finish until the shutdown
  timeout, then their engine requests are aborted and each open stream ends with an
  error event and [DONE] (a whole response becomes a 503).
- A client that disconnects aborts its requests: streaming responses close their body
  iterator (which aborts in AsyncLLM's generator), non-streaming handlers race the
  generation against the ASGI disconnect message (streams.py).
- n choices and several prompts become one engine request per prompt (with n
  choices each); choice index = prompt index * n + choice index, as OpenAI numbers them.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from hybridserve.engine.async_llm import AsyncLLM
from hybridserve.entrypoints.openai import protocol as P
from hybridserve.entrypoints.openai.chat import create_chat_completion
from hybridserve.entrypoints.openai.completions import create_completion
from hybridserve.entrypoints.openai.context import ServerContext
from hybridserve.entrypoints.openai.errors import error_for, error_response
from hybridserve.entrypoints.openai.guard import HttpGuard
from hybridserve.entrypoints.openai.limits import ServerLimits
from hybridserve.entrypoints.openai.metrics import CONTENT_TYPE, ReplicaSnapshot, ServerMetrics
from hybridserve.entrypoints.openai.tokenize import detokenize_ids, tokenize_text


def build_app(engine: AsyncLLM, model_name: str, metrics: ServerMetrics | None = None,
              owns_engine: bool = False, limits: ServerLimits | None = None) -> FastAPI:
    """The app: the HTTP guard around the FastAPI routes. With owns_engine the app's
    shutdown (lifespan end) stops the engine; otherwise the caller does. The routes' shared
    ServerContext is at `app.state.context` (draining is started through it)."""
    limits = limits or ServerLimits()
    metrics = metrics or ServerMetrics()
    engine.on_request_finished = metrics.on_request_finished
    ctx = ServerContext(engine=engine, model_name=model_name, metrics=metrics, limits=limits)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if owns_engine:
            await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)

    app = FastAPI(title="hybridserve", summary="OpenAI-compatible serving of hybrid-attention models",
                  docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.context = ctx
    # The last added middleware is the outermost: CORS answers preflights (which carry
    # no API key) before the guard asks for one.
    app.add_middleware(HttpGuard, limits=limits)
    if limits.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(limits.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])

    @app.exception_handler(P.ApiError)
    async def api_error(_: Request, exc: P.ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = P.ApiError(str(exc.detail), status=exc.status_code, code=str(exc.status_code),
                         headers=dict(exc.headers) if exc.headers else None)  # 405 keeps its Allow
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(P.validation_error(exc.errors()))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        return error_response(error_for(exc))

    @app.post("/v1/completions")
    async def completions(request: Request, body: P.CompletionRequest) -> Response:
        return await create_completion(ctx, request, body)

    @app.post("/v1/chat/completions")
    async def chat(request: Request, body: P.ChatRequest) -> Response:
        return await create_chat_completion(ctx, request, body)

    @app.post("/tokenize")
    async def tokenize(body: P.TokenizeRequest) -> dict[str, Any]:
        return await tokenize_text(ctx, body)

    @app.post("/detokenize")
    async def detokenize(body: P.DetokenizeRequest) -> dict[str, Any]:
        return await detokenize_ids(ctx, body)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return _models(ctx)

    @app.get("/health")
    async def health() -> Response:
        return _health(ctx)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return await _metrics(ctx)
    return app


def _models(ctx: ServerContext) -> dict[str, Any]:
    return {"object": "list", "data": [{
        "id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "hybridserve",
        "root": ctx.model_name, "max_model_len": ctx.engine.max_model_len,
    }]}


def _health(ctx: ServerContext) -> Response:
    # 503 exactly when an API request would be refused before reaching the engine.
    try:
        ctx.check_ready(None)
    except P.ApiError as err:
        return error_response(err)
    return JSONResponse({"status": "ok"})


async def _metrics(ctx: ServerContext) -> Response:
    stats = await ctx.engine.get_replica_stats()
    snapshots = [ReplicaSnapshot(s, r.serving, list(r.restart_reasons), r.num_routed)
                 for s, r in zip(stats, ctx.engine.replicas)]
    return Response(ctx.metrics.render(snapshots), media_type=CONTENT_TYPE)
