"""`hybridserve serve`: the OpenAI-compatible server.

    hybridserve serve --model ./my-model --host 127.0.0.1 --port 8000
    curl localhost:8000/v1/completions -d '{"prompt": "Hello", "max_tokens": 16}' -H 'content-type: application/json'

The listening socket is bound before the model loads, so a busy port fails at once
(one line, exit 2). `--port 0` picks a free port. When the engine is ready, one line
"hybridserve: serving NAME on http://HOST:PORT" goes to stdout.
"""

from __future__ import annotations

import argparse
import socket
import sys
from typing import Any

from hybridserve.core.errors import ConfigError
from hybridserve.entrypoints.command import FlagError, one_line_errors, run_guarded, standalone_main
from hybridserve.entrypoints.engine_flags import add_engine_arguments, engine_config_from_args
from hybridserve.entrypoints.openai.limits import API_KEY_ENV, WAITING_PER_SEQ, ServerLimits, api_key_from_env

PROG = "hybridserve serve"
DESCRIPTION = "Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)."


_LIMITS = ServerLimits()  # the one definition of every default below


def _add_arguments(p: argparse.ArgumentParser) -> None:
    d = _LIMITS
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    s.add_argument("--port", type=int, default=8000, help="TCP port, 0 for any free one (default: %(default)s)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the --model value, or gemma3-270m)")
    s.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="server log level (default: %(default)s)")
    s.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=False,
                   help="log one line per HTTP request (default: off)")
    s.add_argument("--engine-core-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine (scheduler + executor) in its own process, one per --data-parallel-size "
                        "replica, so HTTP and detokenizing do not share an interpreter with it (default: on; "
                        "off: one engine on a thread of the server process)")
    g = p.add_argument_group("limits and security")
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on the API routes (default: ${API_KEY_ENV}, else open)")
    g.add_argument("--protect-health-and-metrics", action=argparse.BooleanOptionalAction,
                   default=d.protect_health_and_metrics, help="require the API key on /health and /metrics too "
                   "(default: off)")
    g.add_argument("--allowed-origins", nargs="*", default=list(d.allowed_origins), metavar="ORIGIN",
                   help="origins allowed by CORS, e.g. https://app.example.com or * (default: none, no CORS)")
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help=f"larger request bodies get 413 before they are read (default: {d.max_body_bytes})")
    g.add_argument("--max-waiting-requests", type=int, default=d.max_waiting_requests,
                   help=f"engine requests waiting beyond the running batch before new requests get 429 "
                        f"(default: {WAITING_PER_SEQ} x --max-num-seqs)")
    g.add_argument("--max-choices-per-request", type=int, default=d.max_choices_per_request,
                   help=f"n x prompts of one request (default: {d.max_choices_per_request})")
    g.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings,
                   help=f"stop strings per request (default: {d.max_stop_strings})")
    g.add_argument("--max-stop-string-chars", type=int, default=d.max_stop_string_chars,
                   help=f"characters per stop string (default: {d.max_stop_string_chars})")
    g.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help=f"seconds open requests may run on after SIGTERM (default: {d.shutdown_timeout:g})")
    g.add_argument("--max-engine-restarts", type=int, default=d.max_engine_restarts,
                   help=f"engine rebuilds after failures before the server exits (default: {d.max_engine_restarts})")
    add_engine_arguments(p)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible server", description=DESCRIPTION)
    one_line_errors(p, PROG)
    _add_arguments(p)
    return p


def bind_socket(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise FlagError(f"argument --port: must be in 0..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise FlagError(f"argument --host: cannot resolve {host!r} ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    # The protocol number matters: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    # connections whose socket says IPPROTO_TCP, and a socket made with proto 0 hands that 0
    # to every connection it accepts. With Nagle on, a reply written in two parts on a
    # kept-alive connection waits for the client's delayed ACK: 40 ms per request, and per
    # streamed token once tokens come faster than that.
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise FlagError(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from None
    sock.set_inheritable(True)
    return sock


def run(args: argparse.Namespace) -> int:
    return run_guarded(PROG, lambda: _run(args))


def limits_from_args(a: argparse.Namespace) -> ServerLimits:
    try:
        return ServerLimits(
            max_body_bytes=a.max_body_bytes, max_waiting_requests=a.max_waiting_requests,
            max_choices_per_request=a.max_choices_per_request, max_stop_strings=a.max_stop_strings,
            max_stop_string_chars=a.max_stop_string_chars, shutdown_timeout=a.shutdown_timeout,
            max_engine_restarts=a.max_engine_restarts, api_key=api_key_from_env(a.api_key),
            protect_health_and_metrics=a.protect_health_and_metrics, allowed_origins=tuple(a.allowed_origins))
    except ConfigError as exc:
        raise FlagError(str(exc)) from None


def _run(a: argparse.Namespace) -> int:
    config = engine_config_from_args(a)  # flag errors before anything slow
    limits = limits_from_args(a)
    sock = bind_socket(a.host, a.port)
    try:
        from hybridserve.engine.async_llm import AsyncLLM
        from hybridserve.entrypoints.openai.draining import DrainingServer
        from hybridserve.entrypoints.openai.app import build_app
        from hybridserve.models.loaders.default_model import DEFAULT_MODEL_NAME

        engine = AsyncLLM(config=config, max_restarts=limits.max_engine_restarts, core_process=a.engine_core_process)
        try:
            engine.prepare_large_steps()
            name = a.served_model_name or a.model or DEFAULT_MODEL_NAME
            app = build_app(engine, name, owns_engine=True, limits=limits)
            server = DrainingServer(app, limits.shutdown_timeout, log_level=a.log_level, access_log=a.access_log)
            engine.on_dead = server.exit_on_engine_death
            host, port = sock.getsockname()[:2]
            print(f"hybridserve: serving {name} on http://{host}:{port}", flush=True)
            server.run(sockets=[sock])
        finally:
            engine.shutdown()  # no-op after the app's own shutdown; needed if uvicorn never started
    finally:
        sock.close()
    return server.exit_code


def main(argv: list[str] | None = None) -> int:
    return standalone_main(PROG, DESCRIPTION, _add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
