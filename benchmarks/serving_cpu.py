"""CPU time per output token of each process of `hybridserve serve` under the third-party client's load.

    python benchmarks/serving_cpu.py --model-dir DIR --vllm-python $VLLM_CPU_VENV/bin/python
    python benchmarks/serving_cpu.py ... --checkouts OLD_CHECKOUT,. --rounds 2 --profile-dir /tmp/prof

On 2 cores the HTTP process (tokenizing, detokenizing, SSE) competes with the engine core
process's matmul threads, so what it spends per step is time the step loses. For each
checkout in turn (interleaved over rounds), the server is started from that checkout, warmed
up with one client run, then driven by the mainstream engine's serving benchmark client
(serving_peers.py's: random dataset, --num-prompts requests of --input-len -> --output-len
tokens, EOS ignored, all at once, temperature 1.0). The CPU seconds (user + system, from
psutil) of the HTTP process, of the engine core process and of any other child are read
before and after the timed run and divided by the output tokens the client received.
Printed per run: output tok/s, TPOT p50 and each process's CPU ms per output token;
with --profile-dir, py-spy's collapsed stacks of the HTTP process and of the core process
during the timed run (every thread, samples taken while it holds the GIL: Python's own work).

CPU ms per token is fairly robust on a loaded machine; tok/s and TPOT are not: compare
those only as ratios between checkouts of the same round.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

from serving_peers import add_workload_args, free_port, run_client, stop_server, wait_ready  # noqa: E402 - benchmarks/ is sys.path[0]

CORE_NAME_PREFIX = "hs-core-"


def cpu_seconds(root: psutil.Process) -> dict[str, float]:
    """CPU seconds of the HTTP process ("http"), the engine cores ("core") and other children."""
    out = {"http": 0.0, "core": 0.0, "other": 0.0}
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            kind = "http" if proc.pid == root.pid else "core" if proc.name().startswith(CORE_NAME_PREFIX) else "other"
        except psutil.NoSuchProcess:
            continue
        out[kind] += t.user + t.system
    return out


def one_run(a: argparse.Namespace, checkout: Path, tmp: Path, seed: int, profile: Path | None) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "hybridserve.entrypoints.cli", "serve", "--model", a.model_dir,
           "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(checkout))
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, 600)
        run_client(a, "hybridserve", url, "inf", ["--temperature", "1.0"], tmp, seed=999)  # warm-up
        root = psutil.Process(proc.pid)
        spies = []
        if profile is not None:
            cores = [p for p in root.children(recursive=True) if p.name().startswith(CORE_NAME_PREFIX)]
            for name, pid in [("http", proc.pid), *(("core", p.pid) for p in cores)]:
                spies.append(subprocess.Popen(
                    ["py-spy", "record", "--pid", str(pid), "--threads", "--gil", "--rate", "1000", "--format", "raw",
                     "--output", str(profile / f"{name}-{pid}.txt"), "--nonblocking"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        before = cpu_seconds(root)
        r = run_client(a, "hybridserve", url, "inf", ["--temperature", "1.0"], tmp, seed=seed)
        after = cpu_seconds(root)
        for spy in spies:
            spy.send_signal(2)
            spy.wait(60)
        tokens = r["output_tokens"]
        r.update({f"{k}_ms_per_token": 1000 * (after[k] - before[k]) / tokens for k in after})
        return r
    finally:
        stop_server(proc)
        log.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--vllm-python", required=True, help="python of the vllm-cpu venv (the client)")
    ap.add_argument("--checkouts", default=".", help="comma-separated checkouts to serve from, interleaved")
    add_workload_args(ap)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--profile-dir", help="write py-spy collapsed stacks of the HTTP process here")
    a = ap.parse_args()
    checkouts = [Path(c).resolve() for c in a.checkouts.split(",")]
    print(f"# {a.num_prompts} requests x {a.input_len} -> {a.output_len} tokens, temperature 1.0, "
          f"load {os.getloadavg()[0]:.1f}")
    print("| round | checkout | output tok/s | TPOT p50 ms | HTTP CPU ms/token | core CPU ms/token | other |")
    print("|---|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(a.rounds):
            for k, checkout in enumerate(checkouts):
                profile = Path(a.profile_dir) / f"r{rnd}-c{k}" if a.profile_dir else None
                if profile is not None:
                    profile.mkdir(parents=True, exist_ok=True)
                r = one_run(a, checkout, Path(tmp), seed=100 + rnd, profile=profile)
                print(f"| {rnd} | {checkout} | {r['tok_s']:.1f} | {r['tpot_p50']:.0f} | {r['http_ms_per_token']:.2f} | "
                      f"{r['core_ms_per_token']:.2f} | {r['other_ms_per_token']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
