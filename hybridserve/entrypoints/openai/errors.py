"""What a client is told about a failure.

Every exception a route meets is answered as an `ApiError` (OpenAI-style JSON with a
status); engine failures keep their meaning (503 with Retry-After while the engine
restarts or after it failed, 500 for one failed request), and no answer carries internal
exception text or file paths: an unexpected exception is logged here and named by its
type alone.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from fastapi.responses import JSONResponse

from hybridserve.core.errors import RequestError
from hybridserve.engine.async_llm import EngineDeadError, EngineRestartingError, RequestFailedError
from hybridserve.engine.frontend import ContextLengthError
from hybridserve.entrypoints.openai.protocol import ApiError

logger = logging.getLogger("hybridserve.server")
# Seconds a client told to come back (a full queue, a restarting engine) waits first.
RETRY_AFTER_S = 1


def error_for(exc: BaseException) -> ApiError:
    """What a client is told about a failure: never internal exception text."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, EngineRestartingError):
        return ApiError(str(exc), status=503, type_="engine_restarting", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineDeadError):
        return ApiError("the engine failed while running this request; retry it", status=503,
                        type_="engine_dead", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, RequestFailedError):  # its message is written for clients
        return ApiError(str(exc), status=500, type_="internal_error")
    if isinstance(exc, RequestError):
        return ApiError(str(exc), param=exc.param)
    logger.error("request failed", exc_info=exc)
    return ApiError(f"internal error ({type(exc).__name__})", status=500, type_="internal_error")


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def shutdown_error() -> ApiError:
    """A request the shutdown deadline aborted (see ServerContext.begin_drain)."""
    return ApiError("the server shut down before this request finished", status=503,
                    type_="service_unavailable", code="shutting_down")


def checked(fn: Callable[[], Any]) -> Any:
    """`fn()`, with the engine front end's request errors (a prompt too long, an id out of
    the vocabulary) answered as 400s that name the offending parameter."""
    try:
        return fn()
    except ContextLengthError as exc:
        raise ApiError(str(exc), param="prompt", code="context_length_exceeded") from None
    except RequestError as exc:
        raise ApiError(str(exc), param=exc.param) from None
