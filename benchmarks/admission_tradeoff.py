"""The capacity the settled freeing basis costs: sync vs async vs async with the unsafe switch.

Gemma-like 5:1 sliding/global layout (W=1024), block 16, B = max_num_batched_tokens = 8192,
max_model_len 32768, prompts of 28-32k tokens. Requests are admitted only when their whole
sequence fits by the admission caps (`full_sequence_must_fit`), so the caps decide the
admitted concurrency. Each sliding-window group's cap per request is

    sync (one batch in flight):              cdiv(W - 1 + B, bs) + 1
    async (two batches, the settled basis):  cdiv(W - 1 + 2B, bs) + 1

The unsafe row is the old behaviour: async scheduling with frees on the optimistic count
and the admission cap of one batch in flight; the race detector counts what it breaks.
The pool holds about 3 max-length requests by the sync cap.

Two admission policies are measured:
- "fits now": the engine's check, a request is admitted if its peak by the caps fits in
  the blocks free at that moment (running requests have not reached their peaks yet);
- "capped": max_num_seqs = floor(pool / cap), the startup max-concurrency figure an
  operator sizes a deployment by; here the cap decides the admitted concurrency.

    python benchmarks/admission_tradeoff.py [--num-requests 6] [--output-len 256]

Prints a markdown table (paste into the README).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from hybridserve.core.kv.spec import blocks_per_request
from hybridserve.executor.sim.presets import get_layout
from hybridserve.executor.sim.simulation import SimConfig, build_kv_cache_config, run_simulation
from hybridserve.executor.sim.workload import WorkloadSpec, generate

B = 8192
MAX_MODEL_LEN = 32768


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=6)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--gpu", default="H100")
    ap.add_argument("--requests-in-pool", type=float, default=3.0, help="pool size in max-length requests (sync cap)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    base = SimConfig(gpu=a.gpu, model_layout="gemma3-27b-like", block_size=16, max_num_batched_tokens=B,
                     max_model_len=MAX_MODEL_LEN, full_sequence_must_fit=True, enable_prefix_caching=False,
                     seed=a.seed)
    layout = get_layout(base.model_layout)
    groups = build_kv_cache_config(base).groups
    sync_cap = blocks_per_request(groups, B, MAX_MODEL_LEN)
    async_cap = blocks_per_request(groups, 2 * B, MAX_MODEL_LEN)
    num_blocks = 1 + int(a.requests_in_pool * sync_cap)
    base = replace(base, num_blocks=num_blocks)
    modes = [  # (name, config, in-flight tokens its admission cap assumes)
        ("sync", replace(base, async_scheduling=False, label="sync"), B),
        ("async (default)", replace(base, async_scheduling=True, label="async"), 2 * B),
        ("async + unsafe switch", replace(base, async_scheduling=True, unsafe_optimistic_free=True,
                                          max_in_flight_tokens=B, label="async-unsafe"), B),
    ]
    spec = WorkloadSpec.from_flags(a.num_requests, "uniform:28000:32000", f"fixed:{a.output_len}")
    items = generate(spec, a.seed)

    print(f"{layout.name} ({layout.num_layers} layers, W={layout.sliding_window}) on {a.gpu}, block 16, B={B}, "
          f"max_model_len {MAX_MODEL_LEN}")
    print(f"{a.num_requests} requests, prompts uniform 28000-32000, output {a.output_len}; pool {num_blocks} blocks "
          f"= {a.requests_in_pool:g} x sync cap {sync_cap} (async cap {async_cap}: "
          f"{(num_blocks - 1) / async_cap:.2f} requests)\n")
    print("| admission | mode | max_num_seqs | output tok/s | total tok/s | vs sync | running mean / max "
          "| preemptions | violations | wall (s) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for policy in ("fits now", "capped"):
        sync_rate = None
        for name, cfg, in_flight in modes:
            if policy == "capped":
                cap = blocks_per_request(groups, in_flight, MAX_MODEL_LEN)
                cfg = replace(cfg, max_num_seqs=max(1, (num_blocks - 1) // cap))
            t0 = time.perf_counter()
            r = run_simulation(cfg, items, progress=False)
            wall = time.perf_counter() - t0
            sync_rate = sync_rate or r.total_tokens_per_s
            print(f"| {policy} | {name} | {cfg.max_num_seqs} | {r.output_tokens_per_s:,.0f} | "
                  f"{r.total_tokens_per_s:,.0f} | {r.total_tokens_per_s / sync_rate:.2f}x | "
                  f"{r.mean_running:.2f} / {r.max_running} | {r.num_preemptions} | {r.violations} | {wall:.1f} |",
                  flush=True)

if __name__ == "__main__":
    main()
