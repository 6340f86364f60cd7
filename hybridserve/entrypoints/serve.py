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

from hybridserve.entrypoints.engine_flags import (
    FlagError,
    add_engine_arguments,
    engine_config_from_args,
    one_line_errors,
    run_guarded,
    standalone_main,
)

PROG = "hybridserve serve"
DESCRIPTION = "Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)."


def _add_arguments(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="TCP port, 0 for any free one (default: 8000)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the --model value, or gemma3-270m)")
    s.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=False)
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
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
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


def _run(a: argparse.Namespace) -> int:
    config = engine_config_from_args(a)  # flag errors before anything slow
    sock = bind_socket(a.host, a.port)
    try:
        import uvicorn

        from hybridserve.engine.async_llm import AsyncLLM
        from hybridserve.entrypoints.server import build_app
        from hybridserve.models.default_model import DEFAULT_MODEL_NAME

        engine = AsyncLLM(config=config)
        try:
            name = a.served_model_name or a.model or DEFAULT_MODEL_NAME
            app = build_app(engine, name, owns_engine=True)
            server = uvicorn.Server(uvicorn.Config(app, log_level=a.log_level, access_log=a.access_log,
                                                   timeout_graceful_shutdown=5))
            host, port = sock.getsockname()[:2]
            print(f"hybridserve: serving {name} on http://{host}:{port}", flush=True)
            server.run(sockets=[sock])
        finally:
            engine.shutdown()  # no-op after the app's own shutdown; needed if uvicorn never started
    finally:
        sock.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    return standalone_main(PROG, DESCRIPTION, _add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
