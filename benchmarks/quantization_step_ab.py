"""Decode-step time and peak RSS of the default model at two quantization modes, one engine
per process, the modes alternated over rounds: e.g. the default (int8 layers) against
bf16 weights (`none`), the choice issue 40's accuracy bar raises.

    for i in 1 2; do for q in auto none; do python benchmarks/quantization_step_ab.py $q 1,16,64; done; done

A step's time is (34-token run - 2-token run) / 32 at temperature 1 (seeded), prompts of
16 random ids, so prefill and start-up cancel.
"""

from __future__ import annotations

import random
import resource
import sys
import time

from hybridserve import LLM, SamplingParams


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, temperature=1.0, seed=1)


def main() -> None:
    quant, rows_list = sys.argv[1], [int(r) for r in sys.argv[2].split(",")]
    llm = LLM(None, progress=False, enable_prefix_caching=False, quantization=quant)
    vocab = llm.parts.model_config.vocab_size
    for rows in rows_list:
        rng = random.Random(rows)
        prompts = [[rng.randrange(5, vocab) for _ in range(16)] for _ in range(rows)]
        llm.generate(prompts, params(3), use_tqdm=False)
        t0 = time.perf_counter()
        llm.generate(prompts, params(2), use_tqdm=False)
        t1 = time.perf_counter()
        llm.generate(prompts, params(34), use_tqdm=False)
        t2 = time.perf_counter()
        print(f"{quant} rows {rows}: decode step {((t2 - t1) - (t1 - t0)) / 32 * 1000:.1f} ms")
    print(f"{quant} maxrss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
    llm.shutdown()


if __name__ == "__main__":
    main()
