"""The 64 x 64 prefill (issue 38's burst) of two or more checkouts, interleaved.

    python benchmarks/prefill_checkouts.py /path/to/base /path/to/this --rounds 2
    python benchmarks/prefill_checkouts.py . --quantizations auto,gguf-groups

Each round runs every checkout (and each --quantizations mode of it) in turn, each in its own process (its own hybridserve on
sys.path, the same installed torch): one engine on the default model, prefix caching off,
its compiled kernels prepared first as a server's start-up prepares them; then 6
generations of one token for 64 prompts of 64 random ids (new ids each time), the first
not counted. Prints per checkout and round the fastest and the median of the other 5, with
the CPU flags, each checkout's commit and the load; compare checkouts only within one run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import checkout_commit, checkout_dir, torch_header  # noqa: E402

_RUN = """
import random, sys, time
sys.path.insert(0, sys.argv[1])
from hybridserve import LLM, SamplingParams
llm = LLM(None, progress=False, enable_prefix_caching=False, quantization=sys.argv[2])
llm.parts.engine.executor.prepare_large_steps()
vocab = llm.parts.model_config.vocab_size
one = SamplingParams(max_tokens=1, ignore_eos=True)
times = []
for r in range(6):
    rng = random.Random(r)
    prompts = [[rng.randrange(5, vocab) for _ in range(64)] for _ in range(64)]
    start = time.perf_counter()
    llm.generate(prompts, one, use_tqdm=False)
    times.append(time.perf_counter() - start)
llm.shutdown()
rest = sorted(times[1:])
print(f"{min(rest) * 1e3:.0f} {rest[len(rest) // 2] * 1e3:.0f}")
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkouts", nargs="+", type=checkout_dir, help="repository roots to compare")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quantizations", default="auto", help="--quantization modes to run each checkout with")
    args = p.parse_args()
    print(torch_header(None, ("avx", "amx")))
    print("\n| round | checkout | commit | quantization | fastest ms | median ms | load |\n"
          "|---:|---|---|---|---:|---:|---:|")
    for r in range(args.rounds):
        for c in args.checkouts:
            for mode in args.quantizations.split(","):
                out = subprocess.run([sys.executable, "-c", _RUN, str(c.resolve()), mode], capture_output=True,
                                     text=True, check=True)
                fastest, median = out.stdout.split()[-2:]
                print(f"| {r} | {c} | {checkout_commit(c)} | {mode} | {fastest} | {median} | "
                      f"{os.getloadavg()[0]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
