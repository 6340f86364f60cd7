"""How generations reach the client: engine generators merged as their outputs arrive,
sent as server-sent events or collected into one response, and a client that leaves
aborts them.

Invariants:
- Closing a merge closes (aborts) every generator in it; a stream's body is closed when
  its response ends for any reason, so an abandoned stream aborts its engine requests
  now rather than at garbage collection.
- A stream always ends with `data: [DONE]`; a failure before that is one error event.
- A whole (non-streamed) response is raced against the ASGI disconnect message, and
  cancelled, with its generators, when the client goes away first.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from hybridserve.engine.outputs import GenerationOutput
from hybridserve.entrypoints.openai.context import ServerContext
from hybridserve.entrypoints.openai.errors import error_for, shutdown_error
from hybridserve.entrypoints.openai.sse_chunks import sse_line

_DONE = object()


class SSEResponse(StreamingResponse):
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


async def sse_events(chunks: AsyncIterator[dict[str, Any] | str]) -> AsyncIterator[str]:
    """`chunks` (dicts, or event lines a ChunkTemplate rendered) as server-sent events,
    then [DONE]; a failure ends them with an error event first. Closing this closes
    `chunks` (and so aborts their generators) at once."""
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield chunk if isinstance(chunk, str) else sse_line(chunk)
    except Exception as exc:  # noqa: BLE001 - every failure ends the stream with an error event
        yield sse_line(error_for(exc).body())
    yield "data: [DONE]\n\n"


def merge(gens: list[AsyncIterator[GenerationOutput]]) -> AsyncIterator[GenerationOutput]:
    """Several generators' outputs as they arrive; closing this closes (aborts) them all.
    One generator is returned as it is: no hop of its own for every output streamed."""
    return gens[0] if len(gens) == 1 else _interleave(gens)


async def _interleave(gens: list[AsyncIterator[GenerationOutput]]) -> AsyncIterator[GenerationOutput]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(gen: Any) -> None:
        try:
            async with contextlib.aclosing(gen):
                async for item in gen:
                    queue.put_nowait(item)
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(_DONE)

    tasks = [asyncio.ensure_future(pump(g)) for g in gens]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(ctx: ServerContext, gens: list, request_ids: list[str],
                  prompts: dict[int, GenerationOutput] | None = None) -> dict[tuple[int, int], Any]:
    """Each choice's final output by (prompt, choice), prompt i being the generator of
    request_ids[i]; `prompts` gets each prompt's last output (its prompt logprobs)."""
    finals: dict[tuple[int, int], Any] = {}
    prompt_index = {rid: i for i, rid in enumerate(request_ids)}
    try:
        async with contextlib.aclosing(merge(gens)) as merged:
            async for out in merged:
                pi = prompt_index[out.request_id]
                if prompts is not None:
                    prompts[pi] = out
                for c in out.outputs:
                    finals[(pi, c.index)] = c
    except Exception as exc:  # noqa: BLE001 - mapped to an OpenAI-style error
        raise error_for(exc) from None
    if any(ctx.ended_by_shutdown(c) for c in finals.values()):
        raise shutdown_error()
    return finals


async def until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
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
