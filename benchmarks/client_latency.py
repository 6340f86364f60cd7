"""What one user of OpenAI's Python client waits per request, server by server, interleaved.

    python benchmarks/client_latency.py --model-dir DIR /path/to/base /path/to/this --rounds 2

Each round starts `hybridserve serve` from every checkout in turn (its hybridserve on
PYTHONPATH, the same interpreter), on a free port, and sends it, one at a time through one
`openai.OpenAI` client (whose connection is kept alive, as every application's is):
--warmup then --requests completions of --max-tokens tokens at temperature 1 (EOS
ignored), first whole, then streamed. Prints per checkout and round the median and
sorted end-to-end milliseconds of each kind, with the CPU flags, commits and load;
compare checkouts only within one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving_peers as sp  # noqa: E402
from common import checkout_commit, checkout_dir, torch_header  # noqa: E402

PROMPT = "Tell me about the sea."


def timings(url: str, a: argparse.Namespace, stream: bool) -> list[float]:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    times = []
    for _ in range(a.warmup + a.requests):
        start = time.perf_counter()
        reply = client.completions.create(model="m", prompt=PROMPT, max_tokens=a.max_tokens, temperature=1.0,
                                          stream=stream, extra_body={"ignore_eos": True})
        if stream:
            for _ in reply:
                pass
        times.append(time.perf_counter() - start)
    client.close()
    return times[a.warmup:]


def served(checkout: Path, a: argparse.Namespace) -> dict[str, list[float]]:
    port = sp.free_port()
    cmd, env = sp.server_command("hybridserve", argparse.Namespace(model_dir=a.model_dir, hs_args=""), port)
    env["PYTHONPATH"] = str(checkout.resolve())
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "server.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp)
        url = f"http://127.0.0.1:{port}"
        try:
            sp.wait_ready(url, proc, 600)
            return {kind: timings(url, a, kind == "streamed") for kind in ("whole", "streamed")}
        finally:
            sp.stop_server(proc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkouts", nargs="+", type=checkout_dir, help="repository roots to compare")
    p.add_argument("--model-dir", required=True, help="an HF model directory (serving_peers.py's)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=8)
    a = p.parse_args()
    print(torch_header(None, ("avx", "amx")))
    print(f"\n| round | checkout | commit | kind | median ms ({a.max_tokens} tokens) | all ms, sorted | load |"
          "\n|---:|---|---|---|---:|---|---:|")
    for r in range(a.rounds):
        for c in a.checkouts:
            for kind, times in served(c, a).items():
                ms = sorted(round(t * 1e3) for t in times)
                print(f"| {r} | {c} | {checkout_commit(c)} | {kind} | {statistics.median(ms):.0f} | "
                      f"{', '.join(map(str, ms))} | {os.getloadavg()[0]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
