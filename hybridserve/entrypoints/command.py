"""How every CLI command reports a user's mistake: one line on stderr, exit code 2.

The one home of that contract for `hybridserve` and each of its subcommands (generate,
serve, bench, simulate), whether run under the CLI app or on its own:
- argparse's own errors (bad value, unknown flag) go through `one_line_errors`;
- errors found after parsing are `HybridServeError`s (a command raises `FlagError` for
  its own flags), turned into the same line by `run_guarded`.
Never a usage block, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, NoReturn

from hybridserve.core.errors import HybridServeError
from hybridserve.models.platform.cpu_features import prefer_short_omp_spin


class FlagError(HybridServeError, ValueError):
    """A flag value or combination is unusable."""


def _error_line(prog: str, message: str) -> str:
    # One line, whatever the message held.
    return f"{prog}: error: {' '.join(message.split())}\n"


def one_line_errors(parser: argparse.ArgumentParser, prog: str,
                    hint: Callable[[str], str] | None = None) -> None:
    """argparse errors of `parser` as one line on stderr and exit code 2 (no usage block);
    `hint` may add advice to a message."""

    def error(message: str) -> NoReturn:
        sys.stderr.write(_error_line(prog, hint(message) if hint is not None else message))
        raise SystemExit(2)

    parser.error = error  # type: ignore[method-assign]


def run_guarded(prog: str, body: Callable[[], int]) -> int:
    """Run a command: user errors become one line on stderr and exit 2, never a traceback."""
    try:
        return body()
    except HybridServeError as exc:
        sys.stderr.write(_error_line(prog, str(exc)))
        return 2
    except KeyboardInterrupt:
        sys.stderr.write(f"{prog}: interrupted\n")
        return 130
    except BrokenPipeError:
        # stdout closed early (`| head`): not an error of ours. Point the descriptor at
        # /dev/null so the interpreter's final flush does not complain either.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0


def standalone_main(
    prog: str,
    description: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
    argv: list[str] | None = None,
) -> int:
    """`python -m hybridserve.entrypoints.<command>`: the subcommand without the CLI app."""
    prefer_short_omp_spin()  # before the command imports torch
    p = argparse.ArgumentParser(prog=prog, description=description)
    one_line_errors(p, prog)
    add_arguments(p)
    return run(p.parse_args(argv))
