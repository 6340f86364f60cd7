"""AsyncLLM: the engine off the event loop, for servers.

    llm = AsyncLLM("path/to/hf_dir")
    async for out in llm.generate("Hello", SamplingParams(max_tokens=32), request_id="r1"):
        print(out.outputs[0].delta_text, end="")
    await llm.abort("r1")          # from anywhere; the stream ends with finish_reason "abort"
    llm.shutdown()

The caller's event loop tokenizes, picks a replica (router.py) and queues commands (add,
abort, stats) to it; each replica's thread owns its streams: submits, detokenizes, hands
each stream its outputs (replica.py). Where the engine runs:
- `core_process=False` (the default here): one engine, stepped on the replica's thread
  in this process (it shares the interpreter, and the GIL, with the event loop);
- `core_process=True` (the server's default): each of `data_parallel_size` replicas
  drives an engine core in its own process (core_client.py, core_process.py); this
  process keeps only the tokenizer. Replica processes load their models together.
  They are spawned (multiprocessing): a script that builds one needs the usual
  `if __name__ == "__main__":` guard.

Failure contract, narrowest scope first:
- A request whose own sampling, detokenizing or stop matching fails raises
  RequestFailedError on its stream alone; its engine requests are aborted (blocks freed)
  and every other request goes on.
- A failure of an engine step, or the death of a core process, fails every open stream of
  that replica with EngineDeadError, then the engine is rebuilt (a fresh core process)
  at most `max_restarts` times per replica; while no replica serves, new requests raise
  EngineRestartingError. A replica past its restarts is dead for good and leaves the
  routing; once every replica is dead, later calls raise EngineDeadError at once and
  `on_dead` is told, so a server can exit for its supervisor.
Nothing hangs. A consumer that stops iterating (client gone, task cancelled) aborts its
request, so its blocks return to the pool.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from contextlib import aclosing
from dataclasses import replace
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence

from hybridserve.config import EngineConfig
from hybridserve.core.errors import ConfigError, RequestError
from hybridserve.core.request import SamplingParams as CoreSamplingParams
from hybridserve.engine.frontend import FrontEnd, Prompt, check_params, new_request_id
from hybridserve.engine.frontend import grammar_backend, load_tokenizer, prepare_chat, prepare_params, prepare_prompt
from hybridserve.engine.inbox import Inbox
from hybridserve.engine.outputs import GenerationOutput, GenerationTracker, RequestMetrics, as_sampling_params
from hybridserve.engine.replica import (  # noqa: F401 - re-exported: the public names live here
    SHUT_DOWN,
    EngineDeadError,
    EngineReplica,
    EngineRestartingError,
    EngineStats,
    RequestFailedError,
    Stream,
    group_label,
)
from hybridserve.engine.router import Router
from hybridserve.models.loaders.default_model import tokenizer_dir_at_hand

logger = logging.getLogger("hybridserve")


DEFAULT_MAX_RESTARTS = 3


class AsyncLLM:
    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, progress: bool = True,
                 on_request_finished: Callable[[RequestMetrics], None] | None = None,
                 max_restarts: int = DEFAULT_MAX_RESTARTS, core_process: bool = False,
                 routing: str = "prefix", **engine_args: Any) -> None:
        self.config = config or EngineConfig.from_kwargs(model=model, **engine_args)
        num = self.config.data_parallel_size
        if num > 1 and not core_process:
            raise ConfigError(f"data_parallel_size={num} runs each replica in an engine core process: "
                              "AsyncLLM(core_process=True), serve's --engine-core-process (its default)")
        self.on_request_finished = on_request_finished
        # Called once, on a replica thread, when every replica is dead for good.
        self.on_dead: Callable[[str], None] | None = None
        self.core_process = core_process
        self.lock = threading.Lock()
        # Open requests: id -> (replica, engine requests). Under lock.
        self._active: dict[str, tuple[EngineReplica, int]] = {}
        self._dead: EngineDeadError | None = None
        self.router = Router(num, self.config.block_size, self.config.max_num_seqs, routing)
        if core_process:
            # The tokenizer first where its folder is at hand: parsing it briefly takes several
            # times what it then holds (Gemma 3's: ~400 MB, then ~100 MB), better paid before
            # the cores hold the model than beside them.
            at_hand = self.config.tokenizer or tokenizer_dir_at_hand(self.config.model)
            tokenizer = load_tokenizer(self.config, Path(at_hand)) if at_hand is not None else None
            self.replicas = _start_core_replicas(self.config, self, max_restarts, progress)
            info = self.replicas[0].info
            self.router.record_blocks = info.num_blocks
            try:
                if at_hand is None:
                    tokenizer = load_tokenizer(self.config, info.model_path)
            except BaseException:
                for r in self.replicas:
                    r.close()
                raise
            self._front = FrontEnd(self.config, tokenizer, info.model_path, info.model_config, info.max_model_len,
                                   info.eos_token_id, info.model_stop_ids, grammar_backend(tokenizer, info.model_config))
        else:
            self.replicas = [EngineReplica(0, self.config, self, max_restarts, progress)]
        for r in self.replicas:
            r.start()

    # -- caller side -----------------------------------------------------------------
    @property
    def front(self) -> FrontEnd:
        """The tokenizer and model limits (ReplicaHost)."""
        return self._front if self.core_process else self.replicas[0].parts

    @property
    def parts(self) -> Any:
        """The front end; in-process, the running engine's EngineParts (the engine included)."""
        return self.front

    @property
    def tokenizer(self) -> Any:
        return self.front.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.front.max_model_len

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Set once every replica is dead for good (shut down, or out of restarts)."""
        return self._dead

    @property
    def restarting(self) -> bool:
        """True while no replica serves and one is being rebuilt."""
        return self._dead is None and not any(r.serving for r in self.replicas)

    @property
    def restart_reasons(self) -> list[str]:
        return [reason for r in self.replicas for reason in r.restart_reasons]

    async def generate(self, prompt: Prompt, params: CoreSamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[GenerationOutput]:
        """Incremental outputs of one prompt (its n choices); the last has finished=True."""
        p = prepare_params(self.front, as_sampling_params(params))
        text, ids = prepare_prompt(self.front, prompt)
        # aclosing: closing this generator must close (and so abort) the inner one now, not at GC.
        async with aclosing(self.generate_tokens(ids, p, request_id, text)) as outs:
            async for out in outs:
                yield out

    async def chat(self, messages: Sequence[dict[str, str]], params: CoreSamplingParams | None = None,
                   request_id: str | None = None) -> AsyncIterator[GenerationOutput]:
        """Like generate, for a conversation (chat template, else the plain template)."""
        p = prepare_params(self.front, as_sampling_params(params))
        text, ids, p = prepare_chat(self.front, messages, p)
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
        check_params(self.front, params)  # cheap, and the sampler must never see an unchecked id
        tracker = GenerationTracker(rid, text, ids, params, self.front.tokenizer)
        loop = asyncio.get_running_loop()
        stream = Stream(tracker, loop, Inbox(loop))
        with self.lock:
            if self._dead is not None:
                raise EngineDeadError(str(self._dead))
            if rid in self._active:
                raise RequestError(f"duplicate request id {rid!r}")
            serving = [r for r in self.replicas if r.serving]
            if not serving:
                # A replica dies (under this lock) a moment before the front hears of it.
                dead = [r.dead for r in self.replicas if r.dead is not None]
                if len(dead) == len(self.replicas):
                    raise EngineDeadError(str(dead[-1]))
                raise EngineRestartingError("the engine is restarting after a failure; retry shortly")
            replica = self.router.choose(ids, serving)
            self._active[rid] = (replica, params.n)
            replica.num_unfinished += params.n
            replica.num_routed += 1
            replica.commands.put(("add", stream))
        finished = False
        inbox, items = stream.inbox, stream.inbox.items
        try:
            while True:
                if not items:
                    await inbox.wait()
                    continue
                item = items.popleft()
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
                with self.lock:
                    if replica.dead is None:
                        replica.commands.put(("abort", [rid]))
                    self._release_locked(rid)

    async def abort(self, request_id: str | Sequence[str]) -> None:
        """Abort requests by id (unknown or finished ids are ignored)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self.lock:
            for rid in ids:
                entry = self._active.get(rid)
                if entry is not None and entry[0].dead is None:
                    entry[0].commands.put(("abort", [rid]))

    async def get_stats(self, replica: int = 0) -> EngineStats | None:
        """A snapshot of one replica's engine, taken between steps (None while it is not serving)."""
        r = self.replicas[replica]
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[EngineStats | None] = loop.create_future()
        with self.lock:
            if not r.serving:
                return None
            r.commands.put(("stats", loop, fut))
        return await fut

    async def get_replica_stats(self) -> list[EngineStats | None]:
        """get_stats of every replica, in index order."""
        return list(await asyncio.gather(*(self.get_stats(i) for i in range(len(self.replicas)))))

    def prepare_large_steps(self) -> None:
        """Build the compiled kernels of large steps now (a server's start-up), not in the
        first burst of prompts (seconds of compiling inside a step): what each engine core
        process does before it reports ready, done here for the replicas in this process."""
        if not self.core_process:
            for replica in self.replicas:
                replica.parts.engine.executor.prepare_large_steps()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop every replica (and its core process); open streams fail with EngineDeadError."""
        for r in self.replicas:
            r.stop()
        for r in self.replicas:
            r.join(timeout)

    # -- ReplicaHost: called on replica threads ------------------------------------------
    def release(self, request_id: str) -> None:
        with self.lock:
            self._release_locked(request_id)

    def _release_locked(self, request_id: str) -> None:
        entry = self._active.pop(request_id, None)
        if entry is not None:
            entry[0].num_unfinished -= entry[1]

    def replica_failed(self, replica: EngineReplica) -> None:
        self.router.forget(replica.index)

    def replica_died(self, replica: EngineReplica, reason: str) -> None:
        with self.lock:
            if any(r.dead is None for r in self.replicas):
                if reason != SHUT_DOWN:
                    logger.error("engine replica %d is dead (%s); the other replicas serve on", replica.index,
                                 reason)
                return
            self._dead = EngineDeadError(reason)
        if self.on_dead is not None and reason != SHUT_DOWN:
            try:
                self.on_dead(reason)
            except Exception:  # noqa: BLE001 - a hook must not hide the death
                logger.exception("on_dead hook failed")


def replica_config(config: EngineConfig) -> EngineConfig:
    """Each replica's config: without num_threads, the CPU cores are split between replicas
    (torch's default, every core per process, would oversubscribe them D times)."""
    num = config.data_parallel_size
    if num == 1 or config.num_threads is not None or config.device not in (None, "cpu"):
        return config
    return replace(config, num_threads=max(1, (os.cpu_count() or 1) // num))


def _start_core_replicas(config: EngineConfig, host: Any, max_restarts: int, progress: bool) -> list[Any]:
    """Spawn every replica's core process, then wait until all have loaded the model."""
    from hybridserve.engine.core_client import CoreProcessReplica

    per_replica = replica_config(config)
    replicas: list[CoreProcessReplica] = []
    try:
        for i in range(config.data_parallel_size):
            replicas.append(CoreProcessReplica(i, per_replica, host, max_restarts, progress and i == 0))
        for r in replicas:
            r.wait_ready()
    except BaseException:
        for r in replicas:
            r.close()
        raise
    return replicas
