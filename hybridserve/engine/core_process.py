"""The engine core process: scheduler + executor, stepping on their own interpreter.

Started (core_spawn.CoreProcess) by core_client.CoreProcessReplica, one per data-parallel
replica. It loads the model once, says "ready" with what the front needs (CoreInfo), then
loops: apply the commands waiting on its pipe (block when it has nothing to run), step,
send the step's per-request outputs. Per step only small messages cross the pipe
(pickled; see docs/architecture.md):

    server -> core   ("add", request_id, [Request])       a prompt's engine requests (its n choices)
                     ("abort", [engine request id])
                     ("stats", token)
                     ("stop",)
    core -> server   ("ready", CoreInfo) | ("start_failed", message, is_config_error)
                     ("outputs", applied, [RequestOutput])  new token ids, logprobs, finish reasons
                     ("add_failed", request_id, message, param)
                     ("stats", token, EngineStats)
                     ("failed", reason)                     the step failed; the process then exits

`applied` counts the commands applied before the step, so the server can tell an output
of an aborted request from one of a new request that reuses its id. The process exits on
"stop", after a failed step, and when the server's end of the pipe closes (the server
died): it never outlives its server.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from hybridserve.config import EngineConfig
from hybridserve.core.errors import ConfigError, HybridServeError
from hybridserve.core.sched.output import RequestOutput
from hybridserve.models.config import ModelConfig
from hybridserve.text.tokenizer import release_tokenizer

logger = logging.getLogger("hybridserve")

# The OS name of replica i's core process (what `ps` and `top` show): CORE_NAME_PREFIX + i.
CORE_NAME_PREFIX = "hs-core-"


@dataclass(frozen=True)
class CoreInfo:
    """What a started core tells the server: the model's facts the front end needs."""

    pid: int
    model_path: Path
    model_config: ModelConfig
    max_model_len: int
    eos_token_id: int | None
    model_stop_ids: tuple[int, ...]
    block_size: int
    num_blocks: int  # the KV pool, null block included: bounds the router's record of its prefixes


def core_main(config: EngineConfig, conn: Connection, index: int, progress: bool) -> None:
    """The process's entry point."""
    from hybridserve.engine.frontend import build_engine_parts

    _name_process(f"{CORE_NAME_PREFIX}{index}")
    # Ctrl-C in a terminal reaches the whole process group; the server stops its cores.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        parts = build_engine_parts(config, progress=progress, keep_tokenizer=False)
        parts.engine.executor.prepare_large_steps()  # compiled kernels before the first burst, not in it
    except BaseException as exc:  # noqa: BLE001 - reported to the server, which raises it
        conn.send(("start_failed", str(exc) if isinstance(exc, HybridServeError) else
                   f"{type(exc).__name__}: {exc}", isinstance(exc, ConfigError)))
        return
    release_tokenizer(parts.tokenizer)  # again, should anything in the load have read it
    kv = parts.engine.scheduler.kv.config
    conn.send(("ready", CoreInfo(os.getpid(), parts.model_path, parts.model_config, parts.max_model_len,
                                 parts.eos_token_id, parts.model_stop_ids, config.block_size, kv.num_blocks)))
    _serve(parts.engine, conn)


def _serve(engine: Any, conn: Connection) -> None:
    from hybridserve.engine.replica import engine_stats

    applied = 0
    outputs: list[RequestOutput] = []
    while True:
        try:
            # Block for a command while idle; between steps take only what is waiting.
            while not engine.has_unfinished_requests() or conn.poll():
                cmd = conn.recv()
                kind = cmd[0]
                if kind == "stop":
                    engine.shutdown()
                    return
                applied += kind in ("add", "abort")
                if kind == "add":
                    outputs.extend(_add(engine, conn, cmd[1], cmd[2]))
                elif kind == "abort":
                    engine.abort_requests(cmd[1])
                elif kind == "stats":
                    conn.send(("stats", cmd[1], engine_stats(engine)))
                if outputs and not conn.poll():
                    break  # requests that finished at once go out now, not after a step
        except (EOFError, OSError):  # the server is gone
            engine.shutdown()
            return
        if engine.has_unfinished_requests():
            try:
                _, step_outputs = engine.step()
            except BaseException as exc:  # noqa: BLE001 - the server fails this core's requests
                logger.exception("engine step failed")
                _send(conn, ("failed", f"{type(exc).__name__}: {exc}"))
                return
            outputs.extend(step_outputs)
        if outputs:
            if not _send(conn, ("outputs", applied, outputs)):
                engine.shutdown()
                return
            outputs = []


def _add(engine: Any, conn: Connection, request_id: str, requests: list[Any]) -> list[RequestOutput]:
    from hybridserve.engine.replica import add_requests

    try:
        return add_requests(engine, requests)
    except HybridServeError as exc:  # this request is bad, the engine is fine
        conn.send(("add_failed", request_id, str(exc), getattr(exc, "param", None)))
        return []


def _name_process(name: str) -> None:
    try:
        with open("/proc/self/comm", "w") as f:  # Linux; 15 characters at most
            f.write(name[:15])
    except OSError:
        pass  # another OS: the name is only a convenience


def _send(conn: Connection, message: tuple[Any, ...]) -> bool:
    try:
        conn.send(message)
        return True
    except (OSError, ValueError):  # the server is gone
        return False
