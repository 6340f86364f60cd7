"""AsyncLLM: the engine on its own thread, for servers.

    llm = AsyncLLM("path/to/hf_dir")
    async for out in llm.generate("Hello", SamplingParams(max_tokens=32), request_id="r1"):
        print(out.outputs[0].delta_text, end="")
    await llm.abort("r1")          # from anywhere; the stream ends with finish_reason "abort"
    llm.shutdown()

Threads: the caller's event loop tokenizes and submits commands (add, abort, stats) to
a queue; the engine thread drains it between steps, steps the EngineCore, detokenizes
and hands each stream its outputs with one `call_soon_threadsafe` per loop and step.

Failure contract, narrowest scope first:
- A request whose own sampling, detokenizing or stop matching fails raises
  RequestFailedError on its stream alone; its engine requests are aborted (blocks freed)
  and every other request goes on.
- A failure of the engine step itself (scheduler or executor state no longer
  trustworthy) fails every open stream with EngineDeadError, then the engine is rebuilt
  from its config (at most `max_restarts` times; new requests meanwhile raise
  EngineRestartingError). Past that the engine stays dead: later calls raise
  EngineDeadError at once and `on_dead` is told, so a server can exit for its supervisor.
Nothing hangs. A consumer that stops iterating (client gone, task cancelled) aborts its
request, so its blocks return to the pool.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import re
import threading
import time
from contextlib import aclosing
from dataclasses import dataclass, field, fields
from typing import Any, AsyncIterator, Callable, Sequence

from hybridserve.config import EngineConfig
from hybridserve.core.errors import HybridServeError, RequestError
from hybridserve.core.kv.spec import KVCacheSpec, SlidingWindowSpec
from hybridserve.core.request import SamplingParams as CoreSamplingParams
from hybridserve.core.sched.output import RequestOutput as CoreOutput
from hybridserve.core.sched.stats import SchedulerStats
from hybridserve.engine.frontend import EngineParts, Prompt, build_engine_parts, check_params, new_request_id
from hybridserve.engine.frontend import prepare_chat, prepare_params, prepare_prompt
from hybridserve.engine.outputs import GenerationOutput, GenerationTracker, RequestMetrics, as_sampling_params

logger = logging.getLogger("hybridserve")


DEFAULT_MAX_RESTARTS = 3


class EngineDeadError(HybridServeError, RuntimeError):
    """The engine failed under this request, or was shut down; see the message."""


class EngineRestartingError(EngineDeadError):
    """The engine is being rebuilt after a failure; the request may be retried shortly."""


class RequestFailedError(HybridServeError, RuntimeError):
    """This request failed inside the engine (sampling, detokenizing, stop matching);
    the engine and every other request are unaffected."""


@dataclass
class EngineStats(SchedulerStats):
    """A consistent snapshot taken on the engine thread between steps: the scheduler's
    counters (same names) plus what only the engine side knows."""

    group_labels: list[str] = field(default_factory=list)  # one per KV cache group, for metrics labels
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


@dataclass(eq=False)
class _Stream:
    tracker: GenerationTracker
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    reported: set[str] = field(default_factory=set)


def group_label(spec: KVCacheSpec) -> str:
    """A metrics label: "full_attention", "sliding_window_512", "mamba", ..."""
    if isinstance(spec, SlidingWindowSpec):
        return f"sliding_window_{spec.sliding_window}"
    name = type(spec).__name__.removesuffix("Spec")
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class AsyncLLM:
    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, progress: bool = True,
                 on_request_finished: Callable[[RequestMetrics], None] | None = None,
                 max_restarts: int = DEFAULT_MAX_RESTARTS, **engine_args: Any) -> None:
        self.config = config or EngineConfig.from_kwargs(model=model, **engine_args)
        self.parts: EngineParts = build_engine_parts(self.config, progress=progress)
        self.on_request_finished = on_request_finished
        # Called once, on the engine thread, when the engine is dead for good.
        self.on_dead: Callable[[str], None] | None = None
        self.max_restarts = max_restarts
        # Why each restart happened (one line each), for logs and /metrics.
        self.restart_reasons: list[str] = []
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        # Guards _active, _restarting and _dead against the engine thread.
        self._lock = threading.Lock()
        self._active: set[str] = set()
        self._restarting = False
        self._dead: EngineDeadError | None = None
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._by_core: dict[str, _Stream] = {}  # engine thread only
        self._group_labels = [group_label(g.spec) for g in self.parts.engine.scheduler.kv.config.groups]
        self._thread = threading.Thread(target=self._run, name="hybridserve-engine", daemon=True)
        self._thread.start()

    # -- caller side -----------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.parts.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.parts.max_model_len

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Set once the engine is dead for good (shut down, or out of restarts)."""
        return self._dead

    @property
    def restarting(self) -> bool:
        return self._restarting

    async def generate(self, prompt: Prompt, params: CoreSamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[GenerationOutput]:
        """Incremental outputs of one prompt (its n choices); the last has finished=True."""
        p = prepare_params(self.parts, as_sampling_params(params))
        text, ids = prepare_prompt(self.parts, prompt)
        # aclosing: closing this generator must close (and so abort) the inner one now, not at GC.
        async with aclosing(self.generate_tokens(ids, p, request_id, text)) as outs:
            async for out in outs:
                yield out

    async def chat(self, messages: Sequence[dict[str, str]], params: CoreSamplingParams | None = None,
                   request_id: str | None = None) -> AsyncIterator[GenerationOutput]:
        """Like generate, for a conversation (chat template, else the plain template)."""
        p = prepare_params(self.parts, as_sampling_params(params))
        text, ids, p = prepare_chat(self.parts, messages, p)
        async with aclosing(self.generate_tokens(ids, p, request_id, text)) as outs:
            async for out in outs:
                yield out

    async def generate_tokens(self, prompt_token_ids: list[int], params: Any, request_id: str | None = None,
                              prompt: str | None = None) -> AsyncIterator[GenerationOutput]:
        """generate() for a prompt already tokenized and checked (see frontend.prepare_prompt),
        with front-end SamplingParams; `prompt` is only reported back."""
        text, ids = prompt, prompt_token_ids
        rid = request_id or new_request_id()
        if not isinstance(rid, str) or not rid:
            raise RequestError("request_id must be a non-empty string")
        check_params(self.parts, params)  # cheap, and the sampler must never see an unchecked id
        tracker = GenerationTracker(rid, text, ids, params, self.parts.tokenizer)
        stream = _Stream(tracker, asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(str(self._dead))
            if self._restarting:
                raise EngineRestartingError("the engine is restarting after a failure; retry shortly")
            if rid in self._active:
                raise RequestError(f"duplicate request id {rid!r}")
            self._active.add(rid)
            self._commands.put(("add", stream))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                # The abort is queued before any later command, so the id may be reused at once.
                with self._lock:
                    if self._dead is None:
                        self._commands.put(("abort", [rid]))
                    self._active.discard(rid)

    async def abort(self, request_id: str | Sequence[str]) -> None:
        """Abort requests by id (unknown or finished ids are ignored)."""
        self._abort_nowait([request_id] if isinstance(request_id, str) else list(request_id))

    def _abort_nowait(self, request_ids: list[str]) -> None:
        with self._lock:
            if self._dead is None:
                self._commands.put(("abort", request_ids))

    async def get_stats(self) -> EngineStats | None:
        """A snapshot from the engine thread (None once the engine is dead)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[EngineStats] = loop.create_future()
        with self._lock:
            if self._dead is not None:
                return None
            self._commands.put(("stats", loop, fut))
        return await fut

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread; open streams fail with EngineDeadError."""
        with self._lock:
            if self._dead is None:
                self._commands.put(("stop",))
        self._thread.join(timeout)

    # -- engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            failure = self._serve()
            if failure is None:
                self._die("the engine was shut down")
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
        logger.error("engine failed (%s); restarting it (%d of at most %d)", failure, n, self.max_restarts)
        with self._lock:
            self._restarting = True
        # Clients see no internal error text, only that the engine failed under them.
        stop = self._fail_open(EngineDeadError("the engine failed while running this request and is restarting; "
                                               "retry it"))
        self.restart_reasons.append(failure)
        try:
            self.parts.engine.shutdown()
        except Exception:  # noqa: BLE001 - its state is already untrusted; free what we can
            logger.debug("shutdown of the failed engine raised", exc_info=True)
        if stop:
            self._die("the engine was shut down")
            return False
        try:
            self.parts = build_engine_parts(self.config, progress=False)
        except BaseException as exc:  # noqa: BLE001 - the model loaded before, so this is fatal
            logger.exception("engine restart failed")
            self._die(f"the engine failed and could not be restarted: {type(exc).__name__}")
            return False
        with self._lock:
            self._restarting = False
        logger.warning("engine restarted after: %s", failure)
        return True

    def _drain(self, block: bool) -> bool:
        """Run queued commands; False on stop."""
        try:
            cmd = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind = cmd[0]
            if kind == "stop":
                return False
            if kind == "add":
                self._add(cmd[1])
            elif kind == "abort":
                self._abort(cmd[1])
            elif kind == "stats":
                self._send_stats(cmd[1], cmd[2])
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, stream: _Stream) -> None:
        engine, tracker = self.parts.engine, stream.tracker
        requests = tracker.core_requests(self.parts.eos_token_id, self.parts.model_stop_ids)
        if any(r.request_id in self._by_core for r in requests):
            self._deliver({stream.loop: [(stream, RequestError(f"duplicate request id {tracker.request_id!r}"))]})
            self._release(stream)
            return
        self._streams[tracker.request_id] = stream
        now = time.monotonic()
        added: list[str] = []
        try:
            for req in requests:
                self._by_core[req.request_id] = stream
                done = engine.add_request(req)
                added.append(req.request_id)
                if done is not None:
                    tracker.process(done, now)
        except HybridServeError as exc:  # this request is bad, the engine is fine
            engine.abort_requests(added)
            self._retire(stream)
            self._deliver({stream.loop: [(stream, exc)]})
            return
        if tracker.finished:
            self._publish([stream])

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

    def _abort_choices(self, stream: _Stream, now: float) -> None:
        """Abort a stream's unfinished engine requests (their blocks return to the pool)."""
        live = [cid for cid, seq in stream.tracker.by_core_id.items() if not seq.finished]
        self.parts.engine.abort_requests(live)
        for cid in live:
            stream.tracker.by_core_id[cid].abort(now)

    def _handle_outputs(self, outs: list[CoreOutput]) -> None:
        now = time.monotonic()
        touched: dict[int, _Stream] = {}
        failed: dict[int, tuple[_Stream, RequestFailedError]] = {}
        stops = []
        for o in outs:
            stream = self._by_core.get(o.request_id)
            if stream is None or id(stream) in failed:
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
            self.parts.engine.abort_requests(stops)
        for key, (stream, exc) in failed.items():
            touched.pop(key, None)
            self._fail_stream(stream, exc)
        self._publish(list(touched.values()))

    def _fail_stream(self, stream: _Stream, exc: RequestFailedError) -> None:
        """End one stream with an error; abort its unfinished engine requests (blocks freed)."""
        self._abort_choices(stream, time.monotonic())
        self._report_finished(stream)
        self._retire(stream)
        self._deliver({stream.loop: [(stream, exc)]})

    def _publish(self, streams: list[_Stream]) -> None:
        """Hand changed streams their outputs; retire finished ones."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, Any]]] = {}
        for stream in streams:
            out = stream.tracker.take_output()
            if out is not None:
                batches.setdefault(stream.loop, []).append((stream, out))
            self._report_finished(stream)
            if stream.tracker.finished:
                self._retire(stream)
        self._deliver(batches)

    def _report_finished(self, stream: _Stream) -> None:
        if self.on_request_finished is None:
            return
        for cid, seq in stream.tracker.by_core_id.items():
            if seq.finished and cid not in stream.reported:
                stream.reported.add(cid)
                try:
                    self.on_request_finished(stream.tracker.metrics(cid))
                except Exception:  # noqa: BLE001 - a metrics hook must not kill the engine
                    logger.exception("on_request_finished hook failed")

    def _retire(self, stream: _Stream) -> None:
        self._streams.pop(stream.tracker.request_id, None)
        for cid in stream.tracker.core_ids:
            self._by_core.pop(cid, None)
        self._release(stream)

    def _release(self, stream: _Stream) -> None:
        with self._lock:
            self._active.discard(stream.tracker.request_id)

    def _deliver(self, batches: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, Any]]]) -> None:
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                live = [s.tracker.request_id for s, _ in items if not s.tracker.finished]
                if live and self._dead is None:
                    self._abort(live)

    def _send_stats(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future) -> None:
        sched = self.parts.engine.scheduler
        counters = {f.name: getattr(sched.make_stats(), f.name) for f in fields(SchedulerStats)}
        pcs = sched.kv.prefix_cache_stats
        stats = EngineStats(**{**counters, "group_kv_usage": sched.kv.group_usage()},
                            group_labels=list(self._group_labels), prefix_cache_queries=pcs.queries,
                            prefix_cache_hits=pcs.hits)
        try:
            loop.call_soon_threadsafe(_set_result, fut, stats)
        except RuntimeError:
            pass

    def _fail_open(self, error: EngineDeadError) -> bool:
        """Fail every open stream and queued command with `error`; True if a stop was queued."""
        with self._lock:
            self._active.clear()
        pending: list[_Stream] = list(self._streams.values())
        stop = False
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                pending.append(cmd[1])
            elif cmd[0] == "stop":
                stop = True
            elif cmd[0] == "stats":
                try:
                    cmd[1].call_soon_threadsafe(_set_result, cmd[2], None)
                except RuntimeError:
                    pass
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, Any]]] = {}
        for stream in pending:
            batches.setdefault(stream.loop, []).append((stream, error))
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
        with self._lock:
            self._dead = EngineDeadError(reason)
            self._restarting = False
        self._fail_open(self._dead)
        try:
            self.parts.engine.shutdown()
        except Exception:  # noqa: BLE001 - already dead; the first error was logged
            logger.debug("engine shutdown after failure raised", exc_info=True)
        if self.on_dead is not None and reason != "the engine was shut down":
            try:
                self.on_dead(reason)
            except Exception:  # noqa: BLE001 - a hook must not hide the death
                logger.exception("on_dead hook failed")


def _put_all(items: list[tuple[_Stream, Any]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)
