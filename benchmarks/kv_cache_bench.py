"""Time KVCacheManager.allocate_slots + remove_skipped_blocks per decode step.

Model: 1 full-attention + 5 sliding-window groups (W=1024, block 16), 1024 running
requests, async scheduling: each request advances 1 token per step and has 1 token in
flight when it is scheduled again (the scheduler runs one step ahead of the executor).
Per step the loop does what the scheduler does:

    schedule:  allocate_slots(r, 1); num_computed += 1; num_in_flight += 1     (timed)
    process:   num_in_flight -= 1; append the sampled token                     (not timed)
               remove_skipped_blocks(r, num_processed_tokens)                   (timed, 2nd mode)

Two modes per variant: "scheduler path" (allocate_slots alone: it prunes on the processed
basis itself, which is all the Scheduler does per step) and "+ explicit prune" (a
remove_skipped_blocks call per request after each processed step as well).

Every hot path should be O(blocks touched), so the per-request cost should not grow
with the pool size (4x larger), the request length (4x longer) or the number of
requests (4x fewer); the variants show how far it does (benchmarks/results/kv_cache_manager.md). Times
are process CPU time (time.process_time_ns), so other load on a shared machine inflates
them less than wall time would.

    python benchmarks/kv_cache_bench.py            # ~3.5 minutes on 2 busy cores, ~1 GB RAM
    python benchmarks/kv_cache_bench.py --quick    # 256 requests, for a smoke run
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import dataclass

from hybridserve.core.kv.cache_manager import KVCacheManager
from hybridserve.core.kv.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec, cdiv
from hybridserve.core.request import Request, SamplingParams
from hybridserve.testing import make_kv_cache_config

BLOCK_SIZE = 16
WINDOW = 1024
NUM_SLIDING_GROUPS = 5
# Two 1024-token batches in flight (async scheduling on one stage).
MAX_IN_FLIGHT_TOKENS = 2 * 1024


@dataclass
class Result:
    label: str
    num_requests: int
    prompt_len: int
    num_blocks: int
    sched_us_per_step: float  # allocate_slots alone (the scheduler's per-step work)
    alloc_us_per_step: float  # allocate_slots, explicit-prune mode
    prune_us_per_step: float  # remove_skipped_blocks, explicit-prune mode

    @property
    def explicit_us_per_step(self) -> float:
        return self.alloc_us_per_step + self.prune_us_per_step

    def per_request(self, us_per_step: float) -> float:
        return us_per_step / self.num_requests


def model_specs() -> list[KVCacheSpec]:
    full = FullAttentionSpec(BLOCK_SIZE, 8, 128, "bfloat16")
    sliding = SlidingWindowSpec(BLOCK_SIZE, 8, 128, "bfloat16", sliding_window=WINDOW)
    return [full] + [sliding] * NUM_SLIDING_GROUPS


def blocks_per_request_steady(seq_len: int) -> int:
    """Blocks one decoding request holds: all of full attention, a window per sliding group."""
    return cdiv(seq_len, BLOCK_SIZE) + NUM_SLIDING_GROUPS * (cdiv(WINDOW + 1, BLOCK_SIZE) + 1)


def build(num_requests: int, prompt_len: int, pool_factor: float, steps: int) -> tuple[KVCacheManager, list[Request]]:
    """A manager with num_requests requests prefilled, processed and pruned, one decode in flight."""
    max_model_len = prompt_len + steps + 64
    need = num_requests * blocks_per_request_steady(max_model_len)
    # Room for one request's un-pruned prefill on top of everyone's steady state.
    transient = (1 + NUM_SLIDING_GROUPS) * cdiv(prompt_len, BLOCK_SIZE)
    num_blocks = int(need * pool_factor) + transient + 1
    config = make_kv_cache_config(num_blocks, model_specs(), BLOCK_SIZE)
    kv = KVCacheManager(config, max_model_len=max_model_len, max_in_flight_tokens=MAX_IN_FLIGHT_TOKENS)
    requests = []
    for i in range(num_requests):
        prompt = [(i * 7919 + j) % 50_000 + 2 for j in range(prompt_len)]
        r = Request(str(i), prompt, SamplingParams(max_tokens=steps + 32))
        kv.init_request(r)
        assert kv.allocate_slots(r, prompt_len) is not None
        r.num_computed_tokens = prompt_len  # prefill done and processed
        kv.remove_skipped_blocks(r.request_id, r.num_processed_tokens)
        r.append_output_token_ids([1])
        requests.append(r)
    for r in requests:  # first decode step goes out: from now on 1 token is always in flight
        assert kv.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
        r.num_in_flight_tokens += 1
    return kv, requests


def run_steps(
    kv: KVCacheManager, requests: list[Request], steps: int, explicit_prune: bool
) -> tuple[list[int], list[int]]:
    """Decode `steps` steps; return per-step CPU ns spent in allocate_slots and in pruning."""
    alloc_ns, prune_ns = [], []
    clock = time.process_time_ns
    for _ in range(steps):
        t0 = clock()
        for r in requests:
            if kv.allocate_slots(r, 1) is None:
                raise RuntimeError("pool too small for the benchmark")
            r.num_computed_tokens += 1
            r.num_in_flight_tokens += 1
        t1 = clock()
        # The previous step's output arrives: its token is processed, a new token sampled.
        for r in requests:
            r.num_in_flight_tokens -= 1
            r.append_output_token_ids([1])
        t2 = clock()
        if explicit_prune:
            for r in requests:
                kv.remove_skipped_blocks(r.request_id, r.num_processed_tokens)
        t3 = clock()
        alloc_ns.append(t1 - t0)
        prune_ns.append(t3 - t2)
    return alloc_ns, prune_ns


def measure(label: str, num_requests: int, prompt_len: int, pool_factor: float, steps: int, warmup: int) -> Result:
    kv, requests = build(num_requests, prompt_len, pool_factor, 2 * (steps + warmup))
    # Millions of long-lived block objects: keep the cyclic GC from rescanning them, as a
    # production engine does after start-up (gc.freeze), so we time the manager, not the GC.
    gc.collect()
    gc.freeze()
    try:
        run_steps(kv, requests, warmup, explicit_prune=False)
        sched_ns, _ = run_steps(kv, requests, steps, explicit_prune=False)
        run_steps(kv, requests, warmup, explicit_prune=True)
        alloc_ns, prune_ns = run_steps(kv, requests, steps, explicit_prune=True)
    finally:
        gc.unfreeze()
    return Result(
        label,
        num_requests,
        prompt_len,
        kv.pool.num_blocks,
        statistics.fmean(sched_ns) / 1e3,
        statistics.fmean(alloc_ns) / 1e3,
        statistics.fmean(prune_ns) / 1e3,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=48, help="timed decode steps per mode (3 block crossings)")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="256 requests, 16 steps")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.steps, args.warmup = 256, 16, 4
    n, p = args.requests, args.prompt_len
    variants = [
        ("baseline", n, p, 1.25),
        ("pool x4", n, p, 5.0),
        ("requests 4x longer", n, 4 * p, 1.25),
        ("4x fewer requests", max(1, n // 4), p, 1.25),
    ]
    results = []
    for label, num_requests, prompt_len, factor in variants:
        res = measure(label, num_requests, prompt_len, factor, args.steps, args.warmup)
        results.append(res)
        print(
            f"  {label}: scheduler path {res.per_request(res.sched_us_per_step):.2f} us/request/step, "
            f"+ explicit prune {res.per_request(res.explicit_us_per_step):.2f}",
            flush=True,
        )
    print()
    print(
        f"1 full + {NUM_SLIDING_GROUPS} sliding-window groups (W={WINDOW}, block {BLOCK_SIZE}), {args.steps} timed "
        "decode steps per mode, 1 token in flight per request; CPU time, mean per step."
    )
    print()
    print(
        "| variant | requests | prompt | pool blocks | allocate_slots only: us/step (us/req) "
        "| allocate_slots + remove_skipped_blocks: us/step (us/req) | of which remove_skipped_blocks us/step |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r.label} | {r.num_requests} | {r.prompt_len} | {r.num_blocks:,} "
            f"| {r.sched_us_per_step:,.0f} ({r.per_request(r.sched_us_per_step):.2f}) "
            f"| {r.explicit_us_per_step:,.0f} ({r.per_request(r.explicit_us_per_step):.2f}) "
            f"| {r.prune_us_per_step:,.0f} |"
        )
    base = results[0]
    per_req = [r.per_request(r.explicit_us_per_step) for r in results]
    print()
    print(
        f"KV cache step, {base.num_requests} requests, 1 full + {NUM_SLIDING_GROUPS} SW (W={WINDOW}, bs={BLOCK_SIZE}): "
        f"allocate_slots {base.sched_us_per_step / 1e3:.1f} ms/step "
        f"({base.per_request(base.sched_us_per_step):.1f} us/request); "
        f"allocate_slots + remove_skipped_blocks {base.explicit_us_per_step / 1e3:.1f} ms/step "
        f"({per_req[0]:.1f} us/request); per-request spread {max(per_req) / min(per_req):.2f}x "
        "across pool x4 / 4x longer / 4x fewer"
    )


if __name__ == "__main__":
    main()
