"""Gemma 3 270M on this machine's cores: one process against pipeline and data parallelism.

    python benchmarks/parallel_bench.py --rounds 2

Configurations (each its own process, rounds interleaved A B C ... A B C ..., so a drift
in the machine's speed hits all alike; every one generates the same 64 random-id prompts
of 8-64 tokens, seed 0, 128 greedy tokens each, EOS ignored, after 2 warm-up prompts):

  single-2t   one process, 2 torch threads (the default layout on 2 cores)
  single-1t   one process, 1 thread (what one pipeline stage or replica gets; calibrates the simulator)
  pp2-sync    --pipeline-parallel-size 2, 1 thread per stage, sync scheduling: the engine keeps
              2 steps of disjoint requests in flight, each stage on a different step
  pp2-async   the same with async scheduling: a request's next step waits for its tokens,
              so the pipeline drains between a request's steps
  dp2         --data-parallel-size 2: two engine-core processes, 1 thread each, behind the
              async front end (requests routed by prefix, else least loaded)

Printed per configuration: output tokens/s (median over rounds, min-max), the ratio to
single-2t, start-up seconds, the summed peak RSS of the process tree, the load average.
Then the simulator's prediction for pp2-sync: the roofline device is calibrated so that
the simulated single stage takes single-1t's measured time for this workload, and the same
device then runs each of 2 stages (the engine's per-step overheads from presets.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's hybridserve, whatever is installed
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import tree_status_kib  # noqa: E402
from cpu_peers import cpu_description  # noqa: E402  (the CPU model and flags, as every CPU figure states them)

CONFIGS = {
    "single-2t": dict(num_threads=2),
    "single-1t": dict(num_threads=1),
    "pp2-sync": dict(num_threads=1, pipeline_parallel_size=2, async_scheduling=False),
    "pp2-async": dict(num_threads=1, pipeline_parallel_size=2),
    "dp2": dict(num_threads=1, data_parallel_size=2),
}
NUM_PROMPTS, NEW_TOKENS = 64, 128


def prompts(n: int = NUM_PROMPTS, seed: int = 0, vocab: int = 262144) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(8, 64))] for _ in range(n)]


def tree_peak_rss_kib(pid: int) -> int:
    """Sum of VmHWM over `pid` and its descendants still running."""
    return tree_status_kib(pid, "VmHWM")


def run_config(name: str, num_prompts: int, new_tokens: int) -> dict:
    """One configuration, in this process: start, warm up, time the workload."""
    from hybridserve import SamplingParams

    kwargs = dict(CONFIGS[name])
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    work = prompts(num_prompts)
    t0 = time.perf_counter()
    if "data_parallel_size" in kwargs:
        import asyncio

        from hybridserve import AsyncLLM
        from hybridserve.config import EngineConfig

        engine = AsyncLLM(config=EngineConfig(**kwargs), progress=False, core_process=True)

        async def one(p: list[int]) -> None:
            async for _ in engine.generate(p, params):
                pass

        async def many(ps: list[list[int]]) -> None:
            await asyncio.gather(*(one(p) for p in ps))

        started = time.perf_counter()
        asyncio.run(many(prompts(2, seed=1)))
        t1 = time.perf_counter()
        asyncio.run(many(work))
        elapsed = time.perf_counter() - t1
        rss = tree_peak_rss_kib(os.getpid())
        engine.shutdown()
    else:
        from hybridserve import LLM

        engine = LLM(progress=False, **kwargs)
        started = time.perf_counter()
        engine.generate(prompts(2, seed=1), params, use_tqdm=False)
        t1 = time.perf_counter()
        outs = engine.generate(work, params, use_tqdm=False)
        elapsed = time.perf_counter() - t1
        assert sum(len(o.token_ids) for o in outs) == num_prompts * new_tokens
        rss = tree_peak_rss_kib(os.getpid())
        engine.shutdown()
    return {"config": name, "tok_s": num_prompts * new_tokens / elapsed, "seconds": elapsed,
            "startup_s": started - t0, "peak_rss_mib": rss / 1024}


def simulate_pp(single_1t_seconds: float, num_prompts: int, new_tokens: int) -> dict:
    """The simulator's pp2-sync time, its device calibrated on single-1t's measurement."""
    import hybridserve.sim.presets as presets
    from hybridserve.sim.simulation import SimConfig, run_simulation
    from hybridserve.sim.workload import LengthDistribution, WorkloadSpec, generate

    raw = json.loads(presets.PRESETS_PATH.read_text())
    raw["model_layouts"]["gemma3-270m-like"] = {
        "source": "google/gemma-3-270m: 18 layers (5 sliding : 1 global), hidden 640, 4 heads, 1 KV head, "
                  "head_dim 256, window 512, 268M params (168M of them the tied 262k-token embedding / head)",
        "num_layers": 18, "layer_pattern": ["sliding"] * 5 + ["full"], "hidden_size": 640, "num_q_heads": 4,
        "num_kv_heads": 1, "head_dim": 256, "sliding_window": 512, "total_params": 268e6, "active_params": 268e6,
        "weight_bytes_per_param": 2.0, "vocab_size": 262144, "max_position_embeddings": 32768,
    }
    items = generate(WorkloadSpec(num_prompts, LengthDistribution("uniform", 8, 64),
                                  LengthDistribution("fixed", new_tokens)))
    folder = Path(tempfile.mkdtemp(prefix="parallel_bench_"))
    original = presets.load_presets

    def sim_seconds(scale: float, pp: int) -> float:
        raw["gpus"]["this-cpu"] = {"memory_bytes": 16 << 30, "memory_bandwidth_bytes_per_s": 20e9 * scale,
                                   "peak_flops": 200e9 * scale}
        path = folder / f"presets_{scale:.6g}.json"
        path.write_text(json.dumps(raw))
        presets.load_presets = lambda p=str(path): original(p)  # type: ignore[assignment]
        try:
            cfg = SimConfig(gpu="this-cpu", model_layout="gemma3-270m-like", pipeline_parallel_size=pp,
                            async_scheduling=False, max_num_batched_tokens=2048, max_model_len=256,
                            num_blocks=4096, detector=False)
            return run_simulation(cfg, items, progress=False).sim_time_s
        finally:
            presets.load_presets = original  # type: ignore[assignment]

    lo, hi = 1e-3, 1e3  # the device's speed relative to the guess, found by bisection (log scale)
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if sim_seconds(mid, 1) > single_1t_seconds else (lo, mid)
    scale = (lo * hi) ** 0.5
    pp1, pp2 = sim_seconds(scale, 1), sim_seconds(scale, 2)
    tokens = num_prompts * new_tokens
    return {"scale": scale, "pp1_tok_s": tokens / pp1, "pp2_tok_s": tokens / pp2}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ", ".join(CONFIGS))
    ap.add_argument("--prompts", type=int, default=NUM_PROMPTS, help="number of prompts (default: 64)")
    ap.add_argument("--tokens", type=int, default=NEW_TOKENS, help="new tokens per prompt (default: 128)")
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)  # child mode: one configuration
    a = ap.parse_args()
    if a.run is not None:
        print(json.dumps(run_config(a.run, a.prompts, a.tokens)), flush=True)
        return 0
    names = [n for n in a.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"# {cpu_description()}; commit {commit}; {a.prompts} prompts x {a.tokens} tokens")
    results: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(a.rounds):
        for n in names:
            load = os.getloadavg()[0]
            proc = subprocess.run([sys.executable, __file__, "--run", n, "--prompts", str(a.prompts), "--tokens",
                                   str(a.tokens)], capture_output=True, text=True)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
            if proc.returncode or not lines:
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                print(f"round {r} {n}: failed: {tail}", flush=True)
                continue
            out = json.loads(lines[-1]) | {"load": load}
            results[n].append(out)
            print(f"round {r} {n}: {out['tok_s']:.1f} tok/s, start {out['startup_s']:.1f} s, "
                  f"RSS {out['peak_rss_mib']:.0f} MiB, load {load:.1f}", flush=True)
    base = statistics.median(x["tok_s"] for x in results.get("single-2t", [])) if results.get("single-2t") else None
    print("\n| configuration | output tok/s (median, min-max) | vs single-2t | start-up s | peak RSS MiB | load |")
    print("|---|---:|---:|---:|---:|---:|")
    for n in names:
        runs = results[n]
        if not runs:
            print(f"| {n} | failed | | | | |")
            continue
        tok = [x["tok_s"] for x in runs]
        med = statistics.median(tok)
        ratio = f"{med / base:.2f}x" if base else "-"
        print(f"| {n} | {med:.1f} ({min(tok):.1f}-{max(tok):.1f}) | {ratio} | "
              f"{statistics.median(x['startup_s'] for x in runs):.1f} | "
              f"{max(x['peak_rss_mib'] for x in runs):.0f} | "
              f"{min(x['load'] for x in runs):.1f}-{max(x['load'] for x in runs):.1f} |")
    if results.get("single-1t"):
        sim = simulate_pp(statistics.median(x["seconds"] for x in results["single-1t"]), a.prompts, a.tokens)
        measured = statistics.median(x["tok_s"] for x in results["pp2-sync"]) if results.get("pp2-sync") else None
        print(f"\nsimulator, device calibrated on single-1t: 1 stage {sim['pp1_tok_s']:.1f} tok/s, "
              f"2 stages {sim['pp2_tok_s']:.1f} tok/s (predicted speed-up {sim['pp2_tok_s'] / sim['pp1_tok_s']:.2f}x)"
              + (f"; measured pp2-sync {measured:.1f} tok/s" if measured else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
