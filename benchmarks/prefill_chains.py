"""Do the compiled int8 chains pay at a step of R rows? Eager and compiled, interleaved.

    python benchmarks/prefill_chains.py                            # 64..4096 rows, 5 rounds
    python benchmarks/prefill_chains.py --rows 128,2048 --threads 1 --rounds 9

One engine on the default model (int8 layers where the CPU has the int8 GEMMs), prefix
caching off. Each round runs a prefill of R rows (prompts of 64 random ids, or one prompt
of R ids below 64) to one token twice, the chains eager (models/arch/int8_chains.py) and
compiled (models/arch/compiled_chains.py), alternating which goes first; new ids each
round. Prints the fastest wall and process CPU time of each and their ratios, and the
median of the per-round wall ratios. R = 4096 is two steps of 2048 (the default token
budget): the 64 x 64 prefill of issue 38's serving workload. On a busy machine the CPU
times are the steadier figure.
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

from hybridserve import LLM, SamplingParams  # noqa: E402

EAGER_ONLY = 1 << 62  # a min_rows no step reaches


def prompts(seed: int, rows: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    n = max(1, rows // 64)
    return [[rng.randrange(5, vocab) for _ in range(rows // n)] for _ in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="64,128,256,512,2048,4096")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the engine's choice)")
    args = p.parse_args()
    llm = LLM(None, progress=False, enable_prefix_caching=False, num_threads=args.threads)
    chains = llm.parts.engine.executor.model._chains
    if chains is None:
        sys.exit("the model has no int8 layers on this CPU: nothing to compare")
    compiled_from = chains.min_rows
    vocab = llm.parts.model_config.vocab_size
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts(0, 2048, vocab), one, use_tqdm=False)
    print(f"# first large step, compile and check included: {time.perf_counter() - start:.1f} s; "
          f"compiled chains in use: {chains.for_rows(compiled_from) is not chains.eager}")
    print("\n| rows | eager ms | compiled ms | ratio | median round ratio | eager CPU ms | compiled CPU ms "
          "| CPU ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rows in [int(r) for r in args.rows.split(",")]:
        chains.min_rows = min(compiled_from, rows)
        llm.generate(prompts(0, rows, vocab), one, use_tqdm=False)  # warm at this size
        wall: dict[str, list[float]] = {"eager": [], "compiled": []}
        cpu: dict[str, list[float]] = {"eager": [], "compiled": []}
        for r in range(args.rounds):
            for mode in ("eager", "compiled") if r % 2 == 0 else ("compiled", "eager"):
                chains.min_rows = EAGER_ONLY if mode == "eager" else min(compiled_from, rows)
                batch = prompts(r + 1, rows, vocab)
                w0, c0 = time.perf_counter(), time.process_time()
                llm.generate(batch, one, use_tqdm=False)
                wall[mode].append(time.perf_counter() - w0)
                cpu[mode].append(time.process_time() - c0)
        ratios = [c / e for c, e in zip(wall["compiled"], wall["eager"])]
        e, c, ec, cc = min(wall["eager"]), min(wall["compiled"]), min(cpu["eager"]), min(cpu["compiled"])
        print(f"| {rows} | {e * 1e3:.0f} | {c * 1e3:.0f} | {c / e:.2f} | {statistics.median(ratios):.2f} | "
              f"{ec * 1e3:.0f} | {cc * 1e3:.0f} | {cc / ec:.2f} |", flush=True)
    chains.min_rows = compiled_from
    llm.shutdown()


if __name__ == "__main__":
    main()
