"""An engine core's OS process, started with subprocess and a socket pair, not multiprocessing.

Why: multiprocessing's spawn (and forkserver) start a resource tracker process beside the
first child, to clean up semaphores and shared memory a crashed child leaves behind. The
engine core creates neither, yet the tracker stayed for the server's life: 12 MB of RSS
in the serving tree (benchmarks/results/memory_peak.md). Spawning the interpreter
ourselves gives the same child (a fresh interpreter importing this checkout's modules,
the parent's sys.path first) talking over the same `multiprocessing.connection.Connection`
(pickled messages on a Unix socket pair), with nothing else started.

The child's first two messages are its sys.path (plain strings, readable before any
hybridserve module is) and then the entry function (pickled by reference: a module-level
function) with its arguments; `entry` gets the connection after the first of them. `CoreProcess` offers the part of multiprocessing.Process the server
uses: pid, exitcode, is_alive, join, terminate, kill.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any, Callable

# The child's program: read the parent's sys.path, import the entry point, call it.
_BOOT = """\
import sys
from multiprocessing.connection import Connection
conn = Connection(int(sys.argv[1]))
sys.path[:0] = conn.recv()
entry, args = conn.recv()
entry(*args[:1], conn, *args[1:])
"""


class CoreProcess:
    """A child interpreter running `entry(args[0], conn, *args[1:])`."""

    def __init__(self, entry: Callable[..., None], args: tuple[Any, ...]) -> None:
        """Start the child; `self.conn` is the parent's end of its connection."""
        parent, child = socket.socketpair()
        try:
            self._popen = subprocess.Popen([sys.executable, "-c", _BOOT, str(child.fileno())],
                                           pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            child.close()  # the child holds its end: EOF here once it exits
        self.conn = Connection(parent.detach())
        self.pid = self._popen.pid
        try:
            self.conn.send(list(sys.path))
            self.conn.send((entry, args))
        except OSError:  # it died at once: its reader sees the connection end
            pass

    @property
    def exitcode(self) -> int | None:
        """None while running; else the exit status, or -N when killed by signal N."""
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self.is_alive():
            self._popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()
