"""Interleaved A/B: an int8 step's row chunks (models/arch/int8_row_chunks.py) against none.

    python benchmarks/int8_row_chunks_ab.py ROUNDS MAX_TOKENS CHUNK_ROWS   # e.g. 6 1 256: the prefill alone
    AB_THREADS=1 python benchmarks/int8_row_chunks_ab.py 6 1 256           # one thread

The default model in-process; each round generates 16 fresh random prompts of 64 ids (so
the prefix cache never serves them) x MAX_TOKENS greedy tokens, once with the model's
chunk_rows at CHUNK_ROWS and once unchunked, alternating which goes first.
Decode steps (at most CHUNK_ROWS rows) run the same ops in both arms.
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hybridserve

from hybridserve import LLM, SamplingParams  # noqa: E402

UNCHUNKED = None
PROMPTS, PROMPT_TOKENS = 16, 64


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    chunk_rows = int(sys.argv[3]) if len(sys.argv) > 3 else 256
    llm = LLM(None, progress=False, num_threads=int(os.environ.get("AB_THREADS", "0")) or None)
    model = llm.parts.engine.executor.model
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([[5, 6, 7]], params, use_tqdm=False)  # warm-up
    times: dict[int | None, list[float]] = {chunk_rows: [], UNCHUNKED: []}
    for r in range(rounds):
        for rows in ((chunk_rows, UNCHUNKED) if r % 2 == 0 else (UNCHUNKED, chunk_rows)):
            model.chunk_rows = rows
            g = random.Random(1000 + 2 * r + (rows == chunk_rows))  # fresh prompts: no prefix-cache hits
            batch = [[g.randrange(5, 256000) for _ in range(PROMPT_TOKENS)] for _ in range(PROMPTS)]
            start = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            times[rows].append(time.perf_counter() - start)
    chunked, whole = times[chunk_rows], times[UNCHUNKED]
    print(f"{PROMPTS} x {PROMPT_TOKENS} -> {max_tokens}, load {os.getloadavg()[0]:.1f}: chunked {[round(t, 2) for t in chunked]} s, "
          f"unchunked {[round(t, 2) for t in whole]} s")
    print(f"chunked / unchunked time: {sum(chunked) / sum(whole):.3f} (per round: "
          f"{[round(a / b, 3) for a, b in zip(chunked, whole)]})")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
