"""Load and abuse test of `hybridserve serve` over loopback (a benchmark, not a unit test).

Each round sends, all at once:
- 64 well-formed streaming completions (random word prompts, 32 tokens, greedy);
- 50 streaming clients that hang up after their second chunk;
- malformed requests (bad JSON, wrong types, NaN, token ids past the vocabulary, huge
  n, unknown model, wrong content type, an over-limit body) in a steady trickle.
After each round it waits until /metrics shows nothing running or waiting and KV usage 0,
and reads the server's RSS. A last round sends SIGTERM while 64 streams run.

It checks (exit code 1 if not): every well-formed request completes or ends with a clean
OpenAI-style error; every malformed one is a 4xx with an OpenAI-style body; no 5xx; KV
usage returns to 0 after every round; RSS does not grow from round 2 to the last; after
SIGTERM every open stream ends with [DONE] and the log holds no traceback.

    python benchmarks/server_load.py                 # the tiny test model (a few minutes on 2 cores)
    python benchmarks/server_load.py --model PATH    # any model directory or .gguf
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GOOD, DISCONNECTS = 64, 50


def malformed_requests() -> list[tuple[str, dict, bytes]]:
    """(path, headers, body) of requests that must each get a 4xx."""
    js = {"content-type": "application/json"}
    bodies = [
        b"{not json", b"[]", b"null", json.dumps({"prompt": "hi", "max_tokens": "ten"}).encode(),
        json.dumps({"prompt": [1, 2, 3], "stop_token_ids": [99999], "min_tokens": 2}).encode(),
        json.dumps({"prompt": "hi", "stop_token_ids": [-1], "min_tokens": 1}).encode(),
        json.dumps({"prompt": "hi", "stop_token_ids": [2**64]}).encode(),
        b'{"prompt": "hi", "temperature": NaN}', b'{"prompt": "hi", "top_p": Infinity}',
        json.dumps({"prompt": ["a", "b"], "n": 100}).encode(), json.dumps({"prompt": [10**9]}).encode(),
        json.dumps({"model": "no-such-model", "prompt": "hi"}).encode(),
        json.dumps({"prompt": "hi", "stop": [str(i) for i in range(1000)]}).encode(),
        json.dumps({"prompt": "hi", "max_tokens": 10**9}).encode(),
    ]
    reqs = [("/v1/completions", js, b) for b in bodies]
    reqs.append(("/v1/chat/completions", js, json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode()))
    reqs.append(("/v1/completions", {"content-type": "text/plain"}, b'{"prompt": "hi"}'))
    reqs.append(("/v1/completions", js, b'{"prompt": "' + b"a" * (33 << 20) + b'"}'))
    return reqs


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def metrics(client: httpx.AsyncClient) -> dict[str, float]:
    out = {}
    for line in (await client.get("/metrics")).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def wait_idle(client: httpx.AsyncClient, timeout: float = 120) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = await metrics(client)
        if (m["hybridserve_num_requests_running"] == 0 and m["hybridserve_num_requests_waiting"] == 0
                and m["hybridserve_kv_cache_usage_ratio"] == 0):
            return m
        if time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.05)


async def good_stream(client: httpx.AsyncClient, prompt: str, max_tokens: int, counts: dict) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                counts["5xx" if r.status_code >= 500 else "good_refused"] += 1
                await r.aread()
                return
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    last = line
                    if line.startswith("data: {"):
                        data = json.loads(line[6:])
                        if "error" in data:
                            counts["good_error"] += 1
                            counts["error_kinds"].add(data["error"]["type"])
                        elif data["choices"] and data["choices"][0]["finish_reason"]:
                            counts["good_done"] += 1
    except httpx.TransportError:
        counts["transport_error"] += 1
        return
    if last != "data: [DONE]":
        counts["no_done"] += 1


async def disconnecting_stream(client: httpx.AsyncClient, prompt: str, counts: dict) -> None:
    body = {"prompt": prompt, "max_tokens": 200, "stream": True, "ignore_eos": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        seen = 0
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen == 2:
                    break  # hang up mid-stream
    counts["disconnected"] += 1


async def malformed(client: httpx.AsyncClient, reqs: list, counts: dict) -> None:
    for path, headers, body in reqs:
        r = await client.post(path, content=body, headers=headers)
        ok = 400 <= r.status_code < 500 and set(r.json().get("error", {})) == {"message", "type", "param", "code"}
        counts["malformed_4xx" if ok else "malformed_wrong"] += 1
        if r.status_code >= 500:
            counts["5xx"] += 1
        await asyncio.sleep(0.01)


def new_counts() -> dict:
    return {k: 0 for k in ("good_done", "good_error", "good_refused", "no_done", "transport_error", "disconnected",
                           "malformed_4xx", "malformed_wrong", "5xx")} | {"error_kinds": set()}


async def one_round(url: str, rng: random.Random, words: list[str], max_tokens: int) -> dict:
    counts = new_counts()
    limits = httpx.Limits(max_connections=GOOD + DISCONNECTS + 8)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 14))) for _ in range(GOOD + DISCONNECTS)]
        t0 = time.perf_counter()
        await asyncio.gather(
            *(good_stream(client, p, max_tokens, counts) for p in prompts[:GOOD]),
            *(disconnecting_stream(client, p, counts) for p in prompts[GOOD:]),
            malformed(client, malformed_requests(), counts))
        counts["wall_s"] = time.perf_counter() - t0
        m = await wait_idle(client)
        counts["kv_usage_after"] = m["hybridserve_kv_cache_usage_ratio"]
        counts["running_after"] = m["hybridserve_num_requests_running"] + m["hybridserve_num_requests_waiting"]
    return counts


async def sigterm_round(url: str, proc: subprocess.Popen, words: list[str], rng: random.Random) -> dict:
    counts = new_counts()
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=GOOD + 4)) as client:
        prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 14))) for _ in range(GOOD)]
        tasks = [asyncio.ensure_future(good_stream(client, p, 200, counts)) for p in prompts]
        await asyncio.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        await asyncio.gather(*tasks)
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model path (default: the tiny test model)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--shutdown-timeout", type=float, default=2.0)
    args = ap.parse_args()
    from tests.helpers.serving_models import WORDS, tiny_serving_dir

    model = args.model or str(tiny_serving_dir())
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "hybridserve.entrypoints.cli", "serve", "--model", model,
                             "--port", "0", "--served-model-name", "m", "--max-model-len", "512",
                             "--shutdown-timeout", str(args.shutdown_timeout)],
                            stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=REPO)
    line = proc.stdout.readline()
    if "serving m on " not in line:
        print(f"server did not start: {Path(log.name).read_text()[-2000:]}", file=sys.stderr)
        return 1
    url = line.rsplit(" ", 1)[1].strip()
    rng = random.Random(0)
    rows, failures = [], []
    print("| round | well-formed done | clean errors | refused | disconnects | malformed 4xx | 5xx | "
          "KV usage after | server RSS MiB | wall s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i in range(1, args.rounds + 1):
        c = asyncio.run(one_round(url, rng, WORDS, args.max_tokens))
        c["rss"] = rss_mib(proc.pid)
        rows.append(c)
        print(f"| {i} | {c['good_done']}/{GOOD} | {c['good_error']} | {c['good_refused']} | {c['disconnected']} | "
              f"{c['malformed_4xx']}/{len(malformed_requests())} | {c['5xx']} | {c['kv_usage_after']:.3f} | "
              f"{c['rss']:.0f} | {c['wall_s']:.1f} |", flush=True)
        if c["good_done"] + c["good_error"] + c["good_refused"] != GOOD or c["no_done"] or c["transport_error"]:
            failures.append(f"round {i}: a well-formed request neither completed nor got a clean error")
        if c["malformed_wrong"] or c["5xx"]:
            failures.append(f"round {i}: {c['malformed_wrong']} malformed requests without a 4xx, {c['5xx']} 5xx")
        if c["kv_usage_after"] != 0 or c["running_after"]:
            failures.append(f"round {i}: KV usage {c['kv_usage_after']} / {c['running_after']} requests left")
    if len(rows) >= 3 and rows[-1]["rss"] > rows[1]["rss"] * 1.05 + 16:
        failures.append(f"RSS grew from {rows[1]['rss']:.0f} MiB (round 2) to {rows[-1]['rss']:.0f} MiB")
    c = asyncio.run(sigterm_round(url, proc, WORDS, rng))
    code = proc.wait(60)
    text = Path(log.name).read_text()
    print(f"\nSIGTERM with 64 streams open (shutdown timeout {args.shutdown_timeout:g} s): {c['good_done']} finished, "
          f"{c['good_error']} ended with an error event {sorted(c['error_kinds'])}, {c['no_done']} without [DONE], "
          f"{c['transport_error']} cut off; exit code {code}; tracebacks in the log: {text.count('Traceback')}")
    if c["no_done"] or c["transport_error"] or "Traceback" in text or c["good_done"] + c["good_error"] != GOOD:
        failures.append("SIGTERM: a stream was cut off, or the log has a traceback")
    os.unlink(log.name)
    for f in failures:
        print("FAIL:", f)
    print("all checks passed" if not failures else f"{len(failures)} checks failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
