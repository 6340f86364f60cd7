"""`hybridserve`: one argparse app; each subcommand lives in its own module.

Errors a user can cause print one line and exit 2; never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from hybridserve import __version__
from hybridserve.entrypoints.command import one_line_errors
from hybridserve.models.platform.cpu_features import prefer_short_omp_spin

# subcommand -> module with add_parser(subparsers) and run(args) -> int
COMMANDS = {
    "generate": "hybridserve.entrypoints.generate",
    "serve": "hybridserve.entrypoints.serve",
    "bench": "hybridserve.entrypoints.bench",
    "simulate": "hybridserve.entrypoints.simulate",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridserve", description="LLM serving engine for hybrid-attention models.")
    one_line_errors(parser, "hybridserve")  # top-level errors: unknown command, ...
    parser.add_argument("--version", action="version", version=f"hybridserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS.items():
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    prefer_short_omp_spin()  # before any command imports torch
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(importlib.import_module(COMMANDS[args.command]).run(args))


if __name__ == "__main__":
    sys.exit(main())
