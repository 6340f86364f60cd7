"""uvicorn's server, with a drain between SIGTERM and the cut.

uvicorn alone, on SIGTERM, stops accepting, waits `timeout_graceful_shutdown` for open
connections, then cancels them: every open stream is cut mid-flight (the client sees a
protocol error) and each cancelled handler logs a traceback. Here SIGTERM also starts
the app's drain (ServerContext.begin_drain): open requests may finish for
`shutdown_timeout` seconds, then they are aborted and each stream ends with an error
event and [DONE] on its own, well inside uvicorn's own deadline, so nothing is cancelled.

A dead engine (out of restarts) ends the server the same way, with exit code 1, so a
supervisor restarts the process instead of it answering 503 for ever.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from types import FrameType
from typing import Any

import uvicorn

logger = logging.getLogger("hybridserve.server")
# Time for aborted streams to send their error event and close after the drain ends.
_CLOSE_GRACE_S = 5.0


class DrainingServer(uvicorn.Server):
    def __init__(self, app: Any, shutdown_timeout: float, **config: Any) -> None:
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=int(shutdown_timeout + _CLOSE_GRACE_S) + 1,
                                        **config))
        self.app_context = app.state.context
        self.shutdown_timeout = shutdown_timeout
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._start_drain()
        super().handle_exit(sig, frame)

    def exit_on_engine_death(self, reason: str) -> None:
        """AsyncLLM.on_dead: called on the engine thread."""
        logger.error("the engine is dead (%s); the server exits", reason)
        self.exit_code = 1
        self._start_drain()
        self.should_exit = True

    def _start_drain(self) -> None:
        # Runs in a signal handler or on the engine thread: hand the work to the loop.
        if self._loop is not None and self._drain is None:
            self._loop.call_soon_threadsafe(self._create_drain_task)

    def _create_drain_task(self) -> None:
        if self._drain is None:
            self._drain = asyncio.ensure_future(self.app_context.begin_drain(self.shutdown_timeout))
