"""The capacity the settled freeing basis costs, and what window-tail allocation wins back.

Gemma-like 5:1 sliding/global layout (W=1024), block 16, B = max_num_batched_tokens = 8192,
max_model_len 32768, prompts of 28-32k tokens, the pool sized to hold about 3 such
requests by the sync cap. Requests are admitted only when their whole sequence fits
(`full_sequence_must_fit`: a request's peak by the admission caps, plus what admitted
requests will still grow by, must fit in the free blocks), so the caps decide the
admitted concurrency. Each sliding-window group's cap per request is

    sync (one batch in flight):              cdiv(W - 1 + B, bs) + 1
    async, settled basis (two batches):      cdiv(W - 1 + 2B, bs) + 1
    async, window-tail allocation:           touch(W - 1) + 2 * touch(W - 1)

The unsafe row is the old behaviour: async with frees on the optimistic count and the
one-batch cap; the race detector counts what it breaks.

    python benchmarks/admission_tradeoff.py [--num-requests 12] [--output-len 256]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from hybridserve.core.kv.spec import WindowTail, blocks_per_request
from hybridserve.sim.presets import get_layout
from hybridserve.sim.simulation import SimConfig, build_kv_cache_config, run_simulation
from hybridserve.sim.workload import WorkloadSpec, generate

B = 8192
MAX_MODEL_LEN = 32768


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=12)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--gpu", default="H100")
    ap.add_argument("--requests-in-pool", type=float, default=3.0, help="pool size in max-length requests (sync cap)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-detector", action="store_true", help="skip the race detector (faster)")
    a = ap.parse_args()

    base = SimConfig(gpu=a.gpu, model_layout="gemma3-27b-like", block_size=16, max_num_batched_tokens=B,
                     max_model_len=MAX_MODEL_LEN, full_sequence_must_fit=True, enable_prefix_caching=False,
                     seed=a.seed, detector=not a.no_detector)
    layout = get_layout(base.model_layout)
    groups = build_kv_cache_config(base).groups
    caps = {
        "sync": blocks_per_request(groups, B, MAX_MODEL_LEN),
        "settled": blocks_per_request(groups, 2 * B, MAX_MODEL_LEN),
        "tail": blocks_per_request(groups, 2 * B, MAX_MODEL_LEN, WindowTail(2)),
    }
    num_blocks = 1 + int(a.requests_in_pool * caps["sync"])
    base = replace(base, num_blocks=num_blocks)
    modes = [  # (name, config, cap)
        ("sync", replace(base, async_scheduling=False, window_tail_allocation=False, label="sync"), "sync"),
        ("async, settled basis", replace(base, async_scheduling=True, window_tail_allocation=False, label="settled"),
         "settled"),
        ("async, window tail (default)", replace(base, async_scheduling=True, window_tail_allocation=True,
                                                 label="tail"), "tail"),
        ("async + unsafe switch", replace(base, async_scheduling=True, window_tail_allocation=False,
                                          unsafe_optimistic_free=True, max_in_flight_tokens=B, label="unsafe"), "sync"),
    ]
    items = generate(WorkloadSpec.from_flags(a.num_requests, "uniform:28000:32000", f"fixed:{a.output_len}"), a.seed)

    print(f"{layout.name} ({layout.num_layers} layers, W={layout.sliding_window}) on {a.gpu}, block 16, B={B}, "
          f"max_model_len {MAX_MODEL_LEN}; {len(groups)} KV groups")
    print(f"{a.num_requests} requests, prompts uniform 28000-32000, output {a.output_len}; pool {num_blocks} blocks; "
          "blocks per max-length request: " + ", ".join(f"{k} {v}" for k, v in caps.items()) + "\n")
    print("| mode | blocks/request cap | output tok/s | total tok/s | vs sync | vs settled | running mean / max "
          "| preemptions | violations | wall (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rates: dict[str, float] = {}
    for name, cfg, cap in modes:
        t0 = time.perf_counter()
        r = run_simulation(cfg, items, progress=False)
        wall = time.perf_counter() - t0
        rates[cfg.label] = r.total_tokens_per_s
        vs_sync = r.total_tokens_per_s / rates["sync"]
        vs_settled = f"{r.total_tokens_per_s / rates['settled']:.2f}x" if "settled" in rates else "-"
        print(f"| {name} | {caps[cap]} | {r.output_tokens_per_s:,.0f} | {r.total_tokens_per_s:,.0f} | "
              f"{vs_sync:.2f}x | {vs_settled} | {r.mean_running:.2f} / {r.max_running} | {r.num_preemptions} | "
              f"{r.violations} | {wall:.1f} |", flush=True)


if __name__ == "__main__":
    main()
