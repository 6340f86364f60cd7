"""The server's side of an engine core process (core_process.py).

A `CoreProcessReplica` keeps the replica contract of replica.py (streams, text, failure
isolation), but the engine it drives runs in a child interpreter (core_spawn.CoreProcess:
no multiprocessing, so no resource tracker beside it), talking over one connection
(pickled messages, listed in core_process.py). Two threads per replica in the server: the replica thread (commands from
the front, outputs from the core: detokenizing, stop strings, publishing) and a reader
that only moves the core's messages onto the replica's command queue.

A core that fails a step or whose process dies (killed, out of memory) fails that
replica's open requests; the replica starts a fresh process (a full model load) while its
restarts last, and is dead for good after. Every start bumps a generation number, so late
messages of an old process are ignored.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
import weakref
from multiprocessing.connection import Connection
from typing import Any

from hybridserve.config import EngineConfig
from hybridserve.core.errors import ConfigError, HybridServeError, RequestError
from hybridserve.core.request import Request
from hybridserve.core.sched.output import RequestOutput as CoreOutput
from hybridserve.engine.core_process import CoreInfo, core_main
from hybridserve.engine.core_spawn import CoreProcess
from hybridserve.engine.frontend import FrontEnd
from hybridserve.engine.replica import EngineReplica, ReplicaHost, Stream, reply

logger = logging.getLogger("hybridserve")

# Seconds a core may take to load its model before the start counts as failed.
CORE_START_TIMEOUT_S = 600.0
# Seconds a stopped core may take to exit before it is terminated, then killed.
CORE_EXIT_GRACE_S = 10.0


# Core processes not yet stopped. A core also exits when the server's end of its connection
# closes, but this hook ends them at the server's exit without waiting for that, and from
# then on no core starts (a replica that sees its core end then dies, not restarts).
_RUNNING: weakref.WeakSet = weakref.WeakSet()
_EXIT_LOCK = threading.Lock()
_exiting = False


@atexit.register
def _stop_running_cores() -> None:
    global _exiting
    with _EXIT_LOCK:
        _exiting = True
        running = list(_RUNNING)
    for proc in running:
        _end_process(proc, grace_s=0.0)  # nobody told it to stop: no point waiting


def _end_process(proc: Any, grace_s: float = CORE_EXIT_GRACE_S) -> None:
    """Wait `grace_s` for a core told to stop, then terminate it, then kill it."""
    proc.join(grace_s)
    if proc.is_alive():
        proc.terminate()
        proc.join(CORE_EXIT_GRACE_S)
    if proc.is_alive():
        proc.kill()
        proc.join()


class EngineCoreStartError(HybridServeError, RuntimeError):
    """An engine core process could not start (not a configuration error)."""


class CoreProcessReplica(EngineReplica):
    """A replica whose engine runs in an engine core process."""

    def __init__(self, index: int, config: EngineConfig, host: ReplicaHost, max_restarts: int,
                 progress: bool = True) -> None:
        self.process: CoreProcess | None = None
        self.conn: Connection | None = None
        self.generation = 0
        self.info: CoreInfo | None = None
        self._sent = 0  # add and abort commands sent to the current process
        self._stats_waiting: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._next_token = 0
        super().__init__(index, config, host, max_restarts, progress)

    # -- start and stop ------------------------------------------------------------------
    def _open(self, progress: bool) -> None:
        """Start the process; `wait_ready` finishes the start (so replicas load together)."""
        with _EXIT_LOCK:
            if _exiting:
                raise EngineCoreStartError("the process is exiting: no engine core starts")
            process = CoreProcess(core_main, (self.config, self.index, progress))
            _RUNNING.add(process)
        self.process = process
        self.conn, self.generation, self._sent = process.conn, self.generation + 1, 0

    def wait_ready(self) -> CoreInfo:
        """Block until the core has loaded its model; raise its start error otherwise."""
        assert self.conn is not None and self.process is not None
        try:
            if not self.conn.poll(CORE_START_TIMEOUT_S):
                raise EngineCoreStartError(f"engine core {self.index} did not start in {CORE_START_TIMEOUT_S:g} s")
            msg = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(CORE_EXIT_GRACE_S)
            raise EngineCoreStartError(f"engine core {self.index} exited while starting "
                                       f"({exit_description(self.process.exitcode)})") from None
        if msg[0] == "start_failed":
            self._close_engine()
            raise (ConfigError if msg[2] else EngineCoreStartError)(msg[1])
        self.info = msg[1]
        threading.Thread(target=self._read, args=(self.conn, self.generation), daemon=True,
                         name=f"hybridserve-core-reader-{self.index}").start()
        return self.info

    def close(self) -> None:
        """Stop a core that never served (its start failed, or a sibling's did)."""
        self._close_engine()

    def _reopen(self) -> None:
        self._open(progress=False)
        self.wait_ready()

    def _close_engine(self) -> None:
        """Stop the process (politely, then by signal) and drop its pipe."""
        proc, conn = self.process, self.conn
        self.generation += 1  # whatever the old process still says is ignored
        if conn is not None:
            try:
                conn.send(("stop",))
            except (OSError, ValueError):
                pass
        if proc is not None:
            _end_process(proc)
            _RUNNING.discard(proc)
        if conn is not None:
            conn.close()
        self.conn = None

    @property
    def front(self) -> FrontEnd:
        return self.host.front

    def _read(self, conn: Connection, generation: int) -> None:
        """Reader thread: the core's messages onto the command queue, then its end."""
        try:
            while True:
                self.commands.put(("core", generation, conn.recv()))
        except (EOFError, OSError):
            self.commands.put(("core", generation, ("lost",)))

    # -- the replica thread ---------------------------------------------------------------
    def _serve(self) -> str | None:
        while True:
            cmd = self.commands.get()
            if cmd[0] != "core":
                if not self._command(cmd):
                    return None
            elif _exiting:
                return None  # the interpreter is exiting and has ended the core: stop, do not restart
            elif cmd[1] == self.generation:
                failure = self._on_core(cmd[2])
                if failure is not None:
                    return failure

    def _on_core(self, msg: tuple[Any, ...]) -> str | None:
        """Handle one message of the core; a failure's one-line reason ends serving."""
        kind = msg[0]
        if kind == "outputs":
            self._handle_outputs(msg[2], applied_commands=msg[1])
        elif kind == "add_failed":
            stream = self._streams.get(msg[1])
            if stream is not None:
                self._reject(stream, RequestError(msg[2], msg[3]))
        elif kind == "stats":
            waiting = self._stats_waiting.pop(msg[1], None)
            if waiting is not None:
                reply(*waiting, msg[2])
        elif kind == "failed":
            logger.error("engine core %d failed a step: %s", self.index, msg[1])
            return msg[1]
        elif kind == "lost":
            assert self.process is not None
            self.process.join(CORE_EXIT_GRACE_S)
            reason = f"EngineCoreLost: the engine core process {exit_description(self.process.exitcode)}"
            logger.error("engine core %d: %s", self.index, reason)
            return reason
        return None

    def _to_core(self, message: tuple[Any, ...]) -> None:
        assert self.conn is not None
        try:
            self.conn.send(message)
        except (OSError, ValueError):
            pass  # the process is gone; the reader reports it

    def _submit(self, stream: Stream, requests: list[Request]) -> list[CoreOutput]:
        self._sent += 1
        stream.core_seq = self._sent
        self._to_core(("add", stream.tracker.request_id, requests))
        return []  # requests that finish at once come back as outputs

    def _abort_engine(self, core_ids: list[str]) -> None:
        if core_ids:
            self._sent += 1
            self._to_core(("abort", core_ids))

    def _send_stats(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future) -> None:
        self._next_token += 1
        self._stats_waiting[self._next_token] = (loop, fut)
        self._to_core(("stats", self._next_token))

    def _fail_open(self, error: Any) -> bool:
        for waiting in self._stats_waiting.values():
            reply(*waiting, None)
        self._stats_waiting.clear()
        return super()._fail_open(error)


def exit_description(exitcode: int | None) -> str:
    if exitcode is None:
        return "did not exit"
    if exitcode < 0:
        return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"
