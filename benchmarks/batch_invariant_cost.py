"""What `--batch-invariant` costs: the default model (the GGUF's int8 groups) with and
without it, each in its own process, alternating over rounds.

    python benchmarks/batch_invariant_cost.py --rounds 2

Per process: greedy generations of 64 tokens for 1, 16 and 64 prompts of 64 random ids
(3 runs each, the first not counted: median output tok/s), and a 32 x 64 prompt prefill
(one token each; median of the last 2 of 3 runs). Prints one line per process with the
CPU flags, commit and load; compare the modes only within one run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, torch_header  # noqa: E402

_RUN = """
import random, statistics, sys, time
from hybridserve import LLM, SamplingParams
invariant = sys.argv[1] == "1"
llm = LLM(None, progress=False, enable_prefix_caching=False, quantization="gguf-groups", batch_invariant=invariant)
vocab = llm.parts.model_config.vocab_size
def timed(prompts, tokens):
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0), use_tqdm=False)
    return time.perf_counter() - start
def prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(64)] for _ in range(n)]
out = []
for rows in (1, 16, 64):
    walls = [timed(prompts(rows, r), 64) for r in range(3)]
    out.append(f"{rows}x64 {rows * 64 / statistics.median(walls[1:]):.1f} tok/s")
walls = [timed(prompts(32, 10 + r), 1) for r in range(3)]
out.append(f"prefill 32x64 {statistics.median(walls[1:]) * 1e3:.0f} ms")
llm.shutdown()
print("; ".join(out))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    print(torch_header(None, ("avx", "amx")))
    for r in range(args.rounds):
        for invariant in (False, True):
            done = subprocess.run([sys.executable, "-c", _RUN, "1" if invariant else "0"], capture_output=True,
                                  text=True, check=True, cwd=REPO)
            name = "batch-invariant" if invariant else "default"
            print(f"round {r} {name:>15}: {done.stdout.strip().splitlines()[-1]}", flush=True)


if __name__ == "__main__":
    main()
