"""What sampling costs next to greedy: offline output tok/s of the default model per sampling mode.

    python benchmarks/sampling_cost.py                        # 1, 16 and 64 rows, every mode
    python benchmarks/sampling_cost.py --rows 64 --modes greedy,temperature,top_p --rounds 3

For each row count R: R prompts of random ids (lengths 8-64, ids 5..vocab-1, the peer kit's
workload), submitted at once, --new-tokens tokens each with EOS ignored, so every step
runs R rows. The modes run in turn, interleaved over --rounds (the machine drifts), one
engine for all of them (prefix caching off, so every round computes its prompts). A
round's time includes the prompts' prefill, the same for every mode. Printed per row count
and mode: the median output tok/s and its ratio to greedy's (1.00 = free; >= 0.91 is at
most 10% more time per token), and the median decode step (the model runner's `execute`
timed on the steps where every request decodes one token: what issue 38's goal 1, at most
10% more per step, speaks of, without the prefill and the engine's loop) and its ratio to
greedy's, with the CPU flags, commit, threads and load. Seeded modes give every request
its own seed; the others draw from the engine's.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's hybridserve, whatever is installed

from common import torch_header  # noqa: E402

MODES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=1.0),
    # Code assistants sample cold: at 0.2 most of a span's weights underflow float32.
    "cold": dict(temperature=0.2),
    "top_p": dict(temperature=0.7, top_p=0.9),
    "top_k": dict(temperature=0.7, top_k=40),
    "min_p": dict(temperature=1.0, min_p=0.05),
    "penalties": dict(temperature=0.8, repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.2,
                      logit_bias={100: 2.0, 200: -2.0}),
    "all_seeded": dict(temperature=0.8, top_k=50, top_p=0.95, min_p=0.01, seed=0),
}


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(8, 64))] for _ in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a model path (default: the embedded Gemma 3 270M)")
    p.add_argument("--rows", default="1,16,64", help="comma list of batch sizes")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")

    from hybridserve import LLM, SamplingParams

    print(torch_header(args.threads, ("avx", "amx")))
    llm = LLM(args.model, progress=False, enable_prefix_caching=False)
    from hybridserve.models.layers.span_kernel import KERNEL

    KERNEL.get()  # built before timing (a server builds it in the background on its first sampled request)
    vocab = llm.parts.model_config.vocab_size
    steps = DecodeSteps(llm)
    print(f"# model {args.model or 'default'}; vocab {vocab}; {args.new_tokens} new tokens per request")
    print("\n| rows | mode | output tok/s (median) | vs greedy | decode step ms (median) | vs greedy |\n"
          "|---:|---|---:|---:|---:|---:|")
    for rows in [int(r) for r in args.rows.split(",")]:
        steps.rows = rows
        batch = prompts(rows, vocab, seed=rows)
        # Warm-up at this batch's shapes, greedy and sampled: the first step of a new size
        # compiles its kernels (seconds), which no mode's round should pay.
        for warm in (SamplingParams(max_tokens=4, ignore_eos=True),
                     SamplingParams(max_tokens=4, ignore_eos=True, temperature=1.0)):
            llm.generate(batch, [warm] * rows, use_tqdm=False)
        rates: dict[str, list[float]] = {m: [] for m in modes}
        step_times: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.rounds):
            for mode in modes:
                cfg = dict(MODES[mode])
                seeded = "seed" in cfg
                params = [SamplingParams(max_tokens=args.new_tokens, ignore_eos=True,
                                         **{**cfg, **({"seed": i} if seeded else {})}) for i in range(rows)]
                steps.times = step_times[mode]
                t0 = time.perf_counter()
                outs = llm.generate(batch, params, use_tqdm=False)
                rates[mode].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
        steps.times = None
        base = statistics.median(rates["greedy"]) if "greedy" in rates else None
        base_step = statistics.median(step_times["greedy"]) if step_times.get("greedy") else None
        for mode in modes:
            rate = statistics.median(rates[mode])
            ratio = f"{rate / base:.2f}" if base else "n/a"
            step = statistics.median(step_times[mode]) if step_times[mode] else None
            step_cells = (f"{step * 1e3:.2f} | " + (f"{step / base_step:.3f}" if base_step else "n/a")
                          if step is not None else "n/a | n/a")
            print(f"| {rows} | {mode} | {rate:.1f} | {ratio} | {step_cells} |", flush=True)
    llm.shutdown()


class DecodeSteps:
    """Times the model runner's `execute` on the steps where each of `rows` requests decodes
    one token, appending seconds to `times` (None: not timing). Where the engine's runner is
    not in this process (another executor), nothing is timed and the columns say n/a."""

    def __init__(self, llm) -> None:
        self.rows = 0
        self.times: list[float] | None = None
        runner = getattr(getattr(getattr(llm.parts, "engine", None), "executor", None), "runner", None)
        if runner is None:
            return
        execute = runner.execute

        def timed(so):
            if self.times is None or len(so.requests) != self.rows or so.total_num_scheduled_tokens != self.rows:
                return execute(so)
            t0 = time.perf_counter()
            out = execute(so)
            self.times.append(time.perf_counter() - t0)
            return out

        runner.execute = timed


if __name__ == "__main__":
    main()
