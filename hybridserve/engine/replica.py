"""One engine behind AsyncLLM: its command queue, its thread and the streams it serves.

The front (AsyncLLM) tokenizes, routes and hands a replica `Stream`s; the replica's
thread owns them from then on: it submits their engine requests, turns each step's
token ids into text (detokenizing, stop strings) and hands each stream its outputs with
one `call_soon_threadsafe` per event loop and step.

`EngineReplica` steps an EngineCore on that thread (the engine lives in this process);
`CoreProcessReplica` (core_client.py) forwards to an engine core in its own process and
handles what comes back. Both keep the failure contract told in async_llm.py.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import re
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Protocol

from hybridserve.config import EngineConfig
from hybridserve.core.errors import HybridServeError, RequestError
from hybridserve.core.kv.spec import KVCacheSpec, SlidingWindowSpec
from hybridserve.core.request import Request
from hybridserve.core.sched.output import RequestOutput as CoreOutput
from hybridserve.core.sched.stats import SchedulerStats
from hybridserve.engine.frontend import EngineParts, FrontEnd, build_engine_parts
from hybridserve.engine.inbox import Inbox
from hybridserve.engine.loop import EngineCore
from hybridserve.engine.outputs import GenerationTracker, RequestMetrics

logger = logging.getLogger("hybridserve")

SHUT_DOWN = "the engine was shut down"


class EngineDeadError(HybridServeError, RuntimeError):
    """The engine failed under this request, or was shut down; see the message."""


class EngineRestartingError(EngineDeadError):
    """The engine is being rebuilt after a failure; the request may be retried shortly."""


class RequestFailedError(HybridServeError, RuntimeError):
    """This request failed inside the engine (sampling, detokenizing, stop matching);
    the engine and every other request are unaffected."""


@dataclass
class EngineStats(SchedulerStats):
    """A consistent snapshot taken between steps: the scheduler's counters (same names)
    plus what only the engine side knows."""

    group_labels: list[str] = field(default_factory=list)  # one per KV cache group, for metrics labels
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


def group_label(spec: KVCacheSpec) -> str:
    """A metrics label: "full_attention", "sliding_window_512", "mamba", ..."""
    if isinstance(spec, SlidingWindowSpec):
        return f"sliding_window_{spec.sliding_window}"
    name = type(spec).__name__.removesuffix("Spec")
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def engine_stats(engine: EngineCore) -> EngineStats:
    """The snapshot of an engine between two steps."""
    sched = engine.scheduler
    counters = {f.name: getattr(sched.make_stats(), f.name) for f in fields(SchedulerStats)}
    pcs = sched.kv.prefix_cache_stats
    return EngineStats(**{**counters, "group_kv_usage": sched.kv.group_usage()},
                       group_labels=[group_label(g.spec) for g in sched.kv.config.groups],
                       prefix_cache_queries=pcs.queries, prefix_cache_hits=pcs.hits)


def add_requests(engine: EngineCore, requests: list[Request]) -> list[CoreOutput]:
    """Add one prompt's engine requests, all or none (HybridServeError: none stay);
    returns the outputs of those that finished at once."""
    added: list[str] = []
    done = []
    try:
        for req in requests:
            out = engine.add_request(req)
            added.append(req.request_id)
            if out is not None:
                done.append(out)
    except HybridServeError:
        engine.abort_requests(added)
        raise
    return done


@dataclass(eq=False)
class Stream:
    tracker: GenerationTracker
    loop: asyncio.AbstractEventLoop
    inbox: Inbox
    reported: set[str] = field(default_factory=set)
    # Commands sent to an engine core process up to and including this stream's add: its
    # outputs come only in messages the core produced after applying that many.
    core_seq: int = 0


class ReplicaHost(Protocol):
    """What a replica needs from the front that owns it."""

    lock: threading.Lock  # guards every replica's restarting/dead and the front's request table
    front: FrontEnd
    on_request_finished: Callable[[RequestMetrics], None] | None

    def release(self, request_id: str) -> None: ...

    def replica_failed(self, replica: EngineReplica) -> None: ...

    def replica_died(self, replica: EngineReplica, reason: str) -> None: ...


class EngineReplica:
    """An EngineCore stepped on this replica's thread, in this process."""

    def __init__(self, index: int, config: EngineConfig, host: ReplicaHost, max_restarts: int,
                 progress: bool = True) -> None:
        self.index = index
        self.config = config
        self.host = host
        self.max_restarts = max_restarts
        # Why each restart happened (one line each), for logs and /metrics.
        self.restart_reasons: list[str] = []
        self.commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.restarting = False  # under host.lock
        self.dead: EngineDeadError | None = None  # under host.lock
        self.num_unfinished = 0  # engine requests routed here and not yet released (under host.lock)
        self.num_routed = 0  # requests routed here, ever (under host.lock)
        self._streams: dict[str, Stream] = {}  # replica thread only
        self._by_core: dict[str, Stream] = {}  # replica thread only
        self._thread = threading.Thread(target=self._run, name=f"hybridserve-engine-{index}", daemon=True)
        self._open(progress)

    def _open(self, progress: bool) -> None:
        self.parts: EngineParts = build_engine_parts(self.config, progress=progress)

    def start(self) -> None:
        self._thread.start()

    @property
    def front(self) -> FrontEnd:
        return self.parts

    @property
    def serving(self) -> bool:
        return self.dead is None and not self.restarting

    def stop(self) -> None:
        """Ask the thread to stop (open streams then fail with EngineDeadError)."""
        with self.host.lock:
            if self.dead is None:
                self.commands.put(("stop",))

    def join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the replica thread ----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            failure = self._serve()
            if failure is None:
                self._die(SHUT_DOWN)
                return
            if len(self.restart_reasons) >= self.max_restarts:
                self._die(f"the engine failed and is out of restarts ({self.max_restarts}); last failure: {failure}")
                return
            if not self._restart(failure):
                return

    def _serve(self) -> str | None:
        """Step the engine until a stop command (None) or a failure (its one-line reason)."""
        engine = self.parts.engine
        try:
            while True:
                if not self._drain(block=not engine.has_unfinished_requests()):
                    return None
                if engine.has_unfinished_requests():
                    _, outs = engine.step()
                    self._handle_outputs(outs)
        except BaseException as exc:  # noqa: BLE001 - the engine is rebuilt or declared dead
            logger.exception("engine step failed")
            return f"{type(exc).__name__}: {exc}"

    def _restart(self, failure: str) -> bool:
        """Fail what was open, rebuild the engine; False if it is dead instead."""
        n = len(self.restart_reasons) + 1
        logger.error("engine %d failed (%s); restarting it (%d of at most %d)", self.index, failure, n,
                     self.max_restarts)
        with self.host.lock:
            self.restarting = True
        self.host.replica_failed(self)
        # Clients see no internal error text, only that the engine failed under them.
        stop = self._fail_open(EngineDeadError("the engine failed while running this request and is restarting; "
                                               "retry it"))
        self.restart_reasons.append(failure)
        self._close_engine()
        if stop:
            self._die(SHUT_DOWN)
            return False
        try:
            self._reopen()
        except BaseException as exc:  # noqa: BLE001 - the model loaded before, so this is fatal
            logger.exception("engine restart failed")
            self._die(f"the engine failed and could not be restarted: {type(exc).__name__}")
            return False
        with self.host.lock:
            self.restarting = False
        logger.warning("engine %d restarted after: %s", self.index, failure)
        return True

    def _close_engine(self) -> None:
        try:
            self.parts.engine.shutdown()
        except Exception:  # noqa: BLE001 - its state is already untrusted; free what we can
            logger.debug("shutdown of the failed engine raised", exc_info=True)

    def _reopen(self) -> None:
        self._open(progress=False)

    def _drain(self, block: bool) -> bool:
        """Run queued commands; False on stop."""
        try:
            cmd = self.commands.get() if block else self.commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if not self._command(cmd):
                return False
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return True

    def _command(self, cmd: tuple[Any, ...]) -> bool:
        """Run one command from the front; False on stop."""
        kind = cmd[0]
        if kind == "stop":
            return False
        if kind == "add":
            self._add(cmd[1])
        elif kind == "abort":
            self._abort(cmd[1])
        elif kind == "stats":
            self._send_stats(cmd[1], cmd[2])
        return True

    def _add(self, stream: Stream) -> None:
        tracker, front = stream.tracker, self.front
        requests = tracker.core_requests(front.eos_token_id, front.model_stop_ids)
        if any(r.request_id in self._by_core for r in requests):
            self._deliver({stream.loop: [(stream, RequestError(f"duplicate request id {tracker.request_id!r}"))]})
            self.host.release(tracker.request_id)
            return
        self._streams[tracker.request_id] = stream
        for req in requests:
            self._by_core[req.request_id] = stream
        try:
            done = self._submit(stream, requests)
        except HybridServeError as exc:  # this request is bad, the engine is fine
            self._reject(stream, exc)
            return
        now = time.monotonic()
        for out in done:
            tracker.process(out, now)
        if tracker.finished:
            self._publish([stream])

    def _submit(self, stream: Stream, requests: list[Request]) -> list[CoreOutput]:
        """Add a stream's engine requests; returns those finished at once."""
        return add_requests(self.parts.engine, requests)

    def _reject(self, stream: Stream, exc: BaseException) -> None:
        """End a stream the engine refused to take."""
        self._retire(stream)
        self._deliver({stream.loop: [(stream, exc)]})

    def _abort_engine(self, core_ids: list[str]) -> None:
        self.parts.engine.abort_requests(core_ids)

    def _abort(self, request_ids: list[str]) -> None:
        now = time.monotonic()
        touched = []
        for rid in request_ids:
            stream = self._streams.get(rid)
            if stream is None:
                continue
            self._abort_choices(stream, now)
            touched.append(stream)
        self._publish(touched)

    def _abort_choices(self, stream: Stream, now: float) -> None:
        """Abort a stream's unfinished engine requests (their blocks return to the pool)."""
        live = [cid for cid, seq in stream.tracker.by_core_id.items() if not seq.finished]
        self._abort_engine(live)
        for cid in live:
            stream.tracker.by_core_id[cid].abort(now)

    def _handle_outputs(self, outs: list[CoreOutput], applied_commands: int | None = None) -> None:
        """Apply a step's outputs; with `applied_commands`, skip streams added after the
        step (their ids were reused: the outputs belong to an earlier request)."""
        now = time.monotonic()
        touched: dict[int, Stream] = {}
        failed: dict[int, tuple[Stream, RequestFailedError]] = {}
        stops = []
        for o in outs:
            stream = self._by_core.get(o.request_id)
            if stream is None or id(stream) in failed:
                continue
            if applied_commands is not None and stream.core_seq > applied_commands:
                continue
            if o.finish_reason == "error":  # the engine failed this request alone (its sampling)
                failed[id(stream)] = (stream, RequestFailedError(
                    "this request failed while its tokens were sampled; other requests are unaffected"))
                continue
            try:
                if stream.tracker.process(o, now):
                    stops.append(o.request_id)
            except Exception as exc:  # noqa: BLE001 - detokenizing or stop matching: this request only
                logger.exception("processing the output of request %s failed", stream.tracker.request_id)
                failed[id(stream)] = (stream, RequestFailedError(
                    f"this request failed while its output was processed ({type(exc).__name__}); "
                    "other requests are unaffected"))
                continue
            touched[id(stream)] = stream
        if stops:
            self._abort_engine(stops)
        for key, (stream, exc) in failed.items():
            touched.pop(key, None)
            self._fail_stream(stream, exc)
        self._publish(list(touched.values()))

    def _fail_stream(self, stream: Stream, exc: RequestFailedError) -> None:
        """End one stream with an error; abort its unfinished engine requests (blocks freed)."""
        self._abort_choices(stream, time.monotonic())
        self._report_finished(stream)
        self._reject(stream, exc)

    def _publish(self, streams: list[Stream]) -> None:
        """Hand changed streams their outputs; retire finished ones."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[Stream, Any]]] = {}
        for stream in streams:
            out = stream.tracker.take_output()
            if out is None:
                continue
            batches.setdefault(stream.loop, []).append((stream, out))
            # A choice that finishes is in the next output taken (finishing marks it changed).
            if any(c.finish_reason is not None for c in out.outputs):
                self._report_finished(stream)
                if out.finished:
                    self._retire(stream)
        self._deliver(batches)

    def _report_finished(self, stream: Stream) -> None:
        hook = self.host.on_request_finished
        if hook is None:
            return
        for cid, seq in stream.tracker.by_core_id.items():
            if seq.finished and cid not in stream.reported:
                stream.reported.add(cid)
                try:
                    hook(stream.tracker.metrics(cid))
                except Exception:  # noqa: BLE001 - a metrics hook must not kill the engine
                    logger.exception("on_request_finished hook failed")

    def _retire(self, stream: Stream) -> None:
        self._streams.pop(stream.tracker.request_id, None)
        for cid in stream.tracker.core_ids:
            self._by_core.pop(cid, None)
        self.host.release(stream.tracker.request_id)

    def _deliver(self, batches: dict[asyncio.AbstractEventLoop, list[tuple[Stream, Any]]]) -> None:
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                live = [s.tracker.request_id for s, _ in items if not s.tracker.finished]
                if live and self.dead is None:
                    self._abort(live)

    def _send_stats(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future) -> None:
        reply(loop, fut, engine_stats(self.parts.engine))

    def _fail_open(self, error: EngineDeadError) -> bool:
        """Fail every open stream and queued command with `error`; True if a stop was queued."""
        pending: list[Stream] = list(self._streams.values())
        stop = False
        while True:
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                pending.append(cmd[1])
            elif cmd[0] == "stop":
                stop = True
            elif cmd[0] == "stats":
                reply(cmd[1], cmd[2], None)
        batches: dict[asyncio.AbstractEventLoop, list[tuple[Stream, Any]]] = {}
        for stream in pending:
            batches.setdefault(stream.loop, []).append((stream, error))
            self.host.release(stream.tracker.request_id)
        self._streams.clear()
        self._by_core.clear()
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:
                pass
        return stop

    def _die(self, reason: str) -> None:
        """Dead for good: fail everything open; no command enters afterwards."""
        with self.host.lock:
            self.dead = EngineDeadError(reason)
            self.restarting = False
        self._fail_open(self.dead)
        self._close_engine()
        self.host.replica_died(self, reason)


def reply(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, value: Any) -> None:
    """Resolve a future of another thread's event loop (if that loop still runs)."""
    try:
        loop.call_soon_threadsafe(_set_result, fut, value)
    except RuntimeError:
        pass


def _put_all(items: list[tuple[Stream, Any]]) -> None:
    for stream, item in items:
        stream.inbox.put(item)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)
