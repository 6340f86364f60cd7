"""A lone request's time to first token on an idle `hybridserve serve`, against the offline prefill.

    python benchmarks/lone_ttft.py --model-dir DIR
    python benchmarks/lone_ttft.py --model-dir DIR --config= --config=--no-async-scheduling

What a request arriving at a quiet server waits (the Poisson sweep's TTFT at low rates):
per server configuration (each `--config=FLAGS`, one string of `hybridserve serve` flags;
default: one server with its defaults), a server on a free port, then --warmup +
--requests streamed completions one at a time over one kept-alive connection, each
--prompt-tokens random ids (seed 0) -> 2 tokens at temperature 1; the client's TTFT is the
time to the first SSE chunk with text. Beside them, the offline engine in this process: the
same prompts through LLM.generate to one token. Printed: each configuration's sorted TTFTs
and median, the offline times, the CPU flags, commit and load.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving_peers as sp  # noqa: E402
from common import torch_header  # noqa: E402


def prompts(n: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(5, 200000) for _ in range(length)] for _ in range(n)]


def streamed_ttft(client: "httpx.Client", url: str, prompt: list[int]) -> float:
    start = time.perf_counter()
    first = None
    body = {"prompt": prompt, "max_tokens": 2, "stream": True, "ignore_eos": True, "temperature": 1.0}
    with client.stream("POST", url + "/v1/completions", json=body, timeout=60) as reply:
        # Read to the end: the next request then meets an idle server, not this one's last step.
        for line in reply.iter_lines():
            if first is None and line.startswith("data:") and '"text"' in line:
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return first


def served(a: argparse.Namespace, flags: str, batch: list[list[int]]) -> list[float]:
    port = sp.free_port()
    args = argparse.Namespace(model_dir=a.model_dir, hs_args=flags)
    cmd, env = sp.server_command("hybridserve", args, port)
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "server.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp)
        url = f"http://127.0.0.1:{port}"
        try:
            sp.wait_ready(url, proc, 600)
            # One client, its connection kept alive, as OpenAI's client and `vllm bench serve`
            # do (a fresh httpx client per request spends ~17 ms building its TLS context).
            with httpx.Client() as client:
                times = [streamed_ttft(client, url, p) for p in batch]
        finally:
            sp.stop_server(proc)
    return times[a.warmup:]


def offline(a: argparse.Namespace, batch: list[list[int]]) -> list[float]:
    from hybridserve import LLM, SamplingParams

    llm = LLM(None, progress=False, enable_prefix_caching=False)
    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=1.0)
    times = []
    for p in batch:
        start = time.perf_counter()
        llm.generate([p], one, use_tqdm=False)
        times.append(time.perf_counter() - start)
    llm.shutdown()
    return times[a.warmup:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", required=True, help="an HF model directory (serving_peers.py's)")
    p.add_argument("--config", action="append", help="`hybridserve serve` flags of one server, as --config=FLAGS")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    print(torch_header(None, ("avx", "amx")))
    batch = prompts(a.warmup + a.requests, a.prompt_tokens)
    rows = [(f"served {flags or '(defaults)'}", served(a, flags, batch)) for flags in a.config or [""]]
    rows.append(("offline prefill + 1 token", offline(a, batch)))
    print(f"\n| {a.prompt_tokens}-token request | median ms | all ms, sorted |\n|---|---:|---|")
    for name, times in rows:
        ms = sorted(round(t * 1e3) for t in times)
        print(f"| {name} | {statistics.median(ms):.0f} | {', '.join(map(str, ms))} |")


if __name__ == "__main__":
    main()
