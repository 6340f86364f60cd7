"""Resident memory of the default model over repeated generations, per KV cache budget.

    python benchmarks/pool_rss.py                                  # default budget and 256MiB
    python benchmarks/pool_rss.py --budgets default,512MiB --generations 8
    python benchmarks/pool_rss.py --budgets default --retentions 1,0.25 --new-prompts --generations 8

Each budget runs in a fresh process: load the default model (`--kv-cache-memory` as given,
or unset for "default"), then generate --prompts random-id prompts of 8-64 tokens (seed 0)
x --max-tokens greedy tokens, --generations times, printing VmRSS after the load, after
each generation, and once more after a pause of IDLE_RELEASE_S + 1 s. `--retentions` runs
each budget once per `prefix_cache_retention` given ("default": unset); `--new-prompts`
draws new prompts for every generation (a server's stream of users) instead of repeating
the first ones (whose prompt blocks then hit the prefix cache). What it shows: the KV
pool's buffers are zero pages until written; with prefix caching the block pool keeps
finished requests' blocks findable, and hands out never-used blocks before recycling them
until those cached blocks exceed the retention (core/kv/block_pool.FreeBlocks), so
resident memory grows by the new blocks each generation writes until then, and stays flat
after; and after the pause the step temporaries left in the C heap have gone back to the
OS (models/platform/heap.IdleHeapRelease).
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's hybridserve, whatever is installed

from common import torch_header  # noqa: E402


def vm_rss_mb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return -1


def run_one(budget: str, retention: str, prompts: int, max_tokens: int, generations: int, new_prompts: bool) -> None:
    """One budget and retention in this process: prints one markdown row."""
    from hybridserve import LLM, SamplingParams
    from hybridserve.models.platform.heap import IDLE_RELEASE_S

    settings = {} if budget == "default" else {"kv_cache_memory": budget}
    if retention != "default":
        settings["prefix_cache_retention"] = float(retention)
    llm = LLM(None, progress=False, **settings)
    rng = random.Random(0)

    def draw() -> list[list[int]]:
        return [[rng.randrange(5, llm.parts.vocab_size) for _ in range(rng.randint(8, 64))] for _ in range(prompts)]

    batch = draw()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    row = [budget, retention, str(vm_rss_mb())]
    for _ in range(generations):
        llm.generate(batch, params, use_tqdm=False)
        row.append(str(vm_rss_mb()))
        if new_prompts:
            batch = draw()
    time.sleep(IDLE_RELEASE_S + 1)
    row.append(str(vm_rss_mb()))
    llm.shutdown()
    print("| " + " | ".join(row) + " |", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", default="default,256MiB", help="kv_cache_memory values, 'default' for unset")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--generations", type=int, default=5)
    p.add_argument("--retentions", default="default", help="prefix_cache_retention values, 'default' for unset")
    p.add_argument("--new-prompts", action="store_true", help="new prompts for every generation")
    p.add_argument("--run-one", default=None, nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.run_one:
        run_one(*a.run_one, a.prompts, a.max_tokens, a.generations, a.new_prompts)
        return 0
    print(torch_header(None, ("avx",)))
    print(f"# {a.prompts} prompts x {a.max_tokens} tokens, {a.generations} generations per process, "
          f"{'new' if a.new_prompts else 'the same'} prompts each generation; VmRSS in MB")
    print("| kv_cache_memory | prefix_cache_retention | loaded | "
          + " | ".join(f"after {i + 1}" for i in range(a.generations)) + " | idle |")
    print("|---|---|" + "---:|" * (a.generations + 2))
    for budget in a.budgets.split(","):
        for retention in a.retentions.split(","):
            child = [sys.executable, __file__, "--run-one", budget, retention, "--prompts", str(a.prompts),
                     "--max-tokens", str(a.max_tokens), "--generations", str(a.generations),
                     *(["--new-prompts"] if a.new_prompts else [])]
            rc = subprocess.run(child, cwd=REPO, env={**os.environ}).returncode
            if rc:
                print(f"| {budget} | {retention} | failed with exit code {rc} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
