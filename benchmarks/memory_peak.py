"""Peak resident memory of `hybridserve generate` and of a 16 x 64 serving run, default model.

    python benchmarks/memory_peak.py                     # both
    python benchmarks/memory_peak.py --only generate
    python benchmarks/memory_peak.py --only serve --serve-flags=--no-compile --temperature 1.0

generate: `hybridserve generate` with its 3 example prompts (no prompt given) in a child
process; its peak RSS is the kernel's high-water mark of that process (wait4's ru_maxrss).

serve: `hybridserve serve` (its defaults: the engine core in its own process) on a free
port; once /health answers, --requests concurrent /v1/completions requests of
--prompt-tokens random token ids (seed 0) x --max-tokens tokens (greedy, or at
--temperature; EOS ignored); --serve-flags are added to the server's command line.
The process tree's RSS (every process's VmRSS, summed) is sampled every SAMPLE_S seconds
from the start until the responses are in; printed: after start-up and the peak.

The goal (issue 40): at most 0.7 GB for generate and 0.8 GB for the serving run's tree.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's hybridserve, whatever is installed

from common import checkout_commit, tree_status_kib  # noqa: E402
from cpu_peers import cpu_description  # noqa: E402

SAMPLE_S = 0.05
VOCAB_LOW, VOCAB_HIGH = 5, 256000  # random prompt ids: past the special tokens, inside Gemma 3's vocabulary


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "hybridserve.entrypoints.cli", *args]


def generate_peak_mb(flags: tuple[str, ...] = ()) -> float:
    """Peak RSS (MB) of one `hybridserve generate` run."""
    child = subprocess.Popen(_cli("generate", *flags), env=_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    if status:
        raise SystemExit(f"hybridserve generate failed (status {status})")
    return usage.ru_maxrss / 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def serve_peak_mb(requests: int, prompt_tokens: int, max_tokens: int, temperature: float = 0.0,
                  serve_flags: tuple[str, ...] = ()) -> tuple[float, float]:
    """(tree RSS MB once /health answers, peak tree RSS MB through the run)."""
    port = _free_port()
    server = subprocess.Popen(_cli("serve", "--port", str(port), *serve_flags), env=_env(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], tree_status_kib(server.pid, "VmRSS"))
            time.sleep(SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if server.poll() is not None:
                raise SystemExit(f"hybridserve serve exited with {server.returncode}")
            try:
                urllib.request.urlopen(base + "/health", timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        started = tree_status_kib(server.pid, "VmRSS")
        rng = random.Random(0)
        prompts = [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(prompt_tokens)] for _ in range(requests)]
        body = {"max_tokens": max_tokens, "temperature": temperature, "ignore_eos": True}
        with ThreadPoolExecutor(requests) as pool:
            outs = list(pool.map(lambda p: _post(base + "/v1/completions", {**body, "prompt": p}), prompts))
        tokens = sum(o["usage"]["completion_tokens"] for o in outs)
        if tokens != requests * max_tokens:
            raise SystemExit(f"expected {requests * max_tokens} output tokens, got {tokens}")
    finally:
        done.set()
        sampler.join()
        server.terminate()
        server.wait(timeout=60)
    return started / 1024, peak[0] / 1024


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("generate", "serve"), default=None)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="the serve run's requests' (0: greedy)")
    p.add_argument("--generate-flags", default="", help="more flags for `hybridserve generate`")
    p.add_argument("--serve-flags", default="", help="more flags for `hybridserve serve`, e.g. '--no-compile'")
    a = p.parse_args()
    print(f"# commit {checkout_commit()}; {cpu_description()}; load {os.getloadavg()[0]:.1f}")
    if a.only in (None, "generate"):
        flags = tuple(a.generate_flags.split())
        print(f"generate{' ' + a.generate_flags if flags else ''}: peak RSS {generate_peak_mb(flags):.0f} MB", flush=True)
    if a.only in (None, "serve"):
        started, peak = serve_peak_mb(a.requests, a.prompt_tokens, a.max_tokens, a.temperature,
                                      tuple(a.serve_flags.split()))
        print(f"serve {a.serve_flags + ' ' if a.serve_flags else ''}{a.requests}x{a.prompt_tokens}->{a.max_tokens}"
              f"{f' T {a.temperature}' if a.temperature else ''}: process tree RSS {started:.0f} MB after "
              f"start-up, peak {peak:.0f} MB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
