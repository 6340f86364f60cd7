"""Run `hybridserve serve` in a subprocess on a free loopback port, for the server tests."""

from __future__ import annotations

import contextlib
import os
import selectors
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import httpx

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT = 240.0


@contextlib.contextmanager
def running_server(model: Path | None, *args: str, name: str = "tiny", env: dict[str, str] | None = None,
                   health_headers: dict[str, str] | None = None) -> Iterator[dict]:
    """Yields {"url", "proc", "log"}; terminates the server (if still running) afterwards.
    model=None: the default model."""
    log = tempfile.NamedTemporaryFile("w+", prefix="hybridserve_server_", suffix=".log", delete=False)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridserve.entrypoints.cli", "serve", *(["--model", str(model)] if model else []),
         "--port", "0", "--served-model-name", name, *args],
        stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO, env=env)
    try:
        url = _wait_ready(proc, log.name, name, health_headers or {})
        yield {"url": url, "proc": proc, "log": log.name}
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        log.close()
        os.unlink(log.name)


def scrape_metrics(url: str) -> dict[str, float]:
    """GET /metrics as {series (name with its labels): value}."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def process_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (Linux /proc)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _wait_ready(proc: subprocess.Popen, log_path: str, name: str, headers: dict[str, str]) -> str:
    deadline = time.monotonic() + START_TIMEOUT
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}: {Path(log_path).read_text()[-2000:]}")
        if sel.select(timeout=0.5):
            line = proc.stdout.readline()
            if f"serving {name} on " in line:
                url = line.rsplit(" ", 1)[1].strip()
                for _ in range(100):
                    try:
                        if httpx.get(url + "/health", timeout=2, headers=headers).status_code == 200:
                            return url
                    except httpx.TransportError:
                        pass
                    time.sleep(0.1)
    raise AssertionError(f"server not ready in {START_TIMEOUT}s: {Path(log_path).read_text()[-2000:]}")
