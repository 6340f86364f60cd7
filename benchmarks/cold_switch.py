"""What a decode step's small ops pay after each weight-streaming matmul, and the head's
few-rows greedy that pays it once instead of once per chunk.

    python benchmarks/cold_switch.py                       # both parts
    python benchmarks/cold_switch.py --part head --rows 1,4,16 --rounds 6

switch: a bf16 linear at one row over weights of several sizes, each followed by a tiny
op (`torch.ones(4) + 1`); the tiny op's time after each size, against its time after
another tiny op. The weights evict the interpreter's and the dispatcher's code and data
from the caches, so the op after a matmul starts cold.

head: the default model, greedy, R random-id prompts of 32 tokens, 128 (at 1 row) or 64
decode steps; OutputHead.greedy_few_rows (every chunk's product, then one reduction)
against greedy_by_chunks (a reduction per chunk) in alternating order within each round,
in one process; a step's time is (generate N+1 tokens - generate 1) / N, the median over
rounds printed with whether the tokens agree. Prints CPU flags, load, commit and threads.
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

import torch  # noqa: E402

from common import torch_header  # noqa: E402

WEIGHT_ROWS = (512, 2048, 8192, 32768)  # x 640 bf16 columns: 640 KB .. 40 MB
CALLS = 300


def switch_table() -> None:
    print("| weight streamed | linear us | tiny op after it us |")
    print("|---:|---:|---:|")
    x = torch.randn(1, 640).bfloat16()
    with torch.inference_mode():
        for rows in WEIGHT_ROWS:
            w = torch.randn(rows, 640).bfloat16()
            linear = tiny = 0.0
            for _ in range(CALLS):
                t0 = time.perf_counter()
                torch.nn.functional.linear(x, w)
                t1 = time.perf_counter()
                torch.ones(4) + 1
                tiny += time.perf_counter() - t1
                linear += t1 - t0
            print(f"| {rows * 640 * 2 >> 10} KB | {linear / CALLS * 1e6:.1f} | {tiny / CALLS * 1e6:.1f} |")
        tiny = 0.0
        for _ in range(CALLS):
            torch.ones(4) * 2
            t1 = time.perf_counter()
            torch.ones(4) + 1
            tiny += time.perf_counter() - t1
        print(f"| (after another tiny op) | | {tiny / CALLS * 1e6:.1f} |")


def head_ab(rows_list: list[int], rounds: int) -> None:
    from hybridserve import LLM, SamplingParams
    from hybridserve.models.layers import head

    paths = {"few rows": head.OutputHead.greedy_few_rows, "by chunks": head.OutputHead.greedy_by_chunks}
    real = head.OutputHead.greedy
    llm = LLM(None, progress=False, enable_prefix_caching=False)
    print("| rows | few rows ms / step | by chunks ms / step | same tokens |")
    print("|---:|---:|---:|---|")
    try:
        for rows in rows_list:
            rng = random.Random(rows)
            batch = [[rng.randrange(5, 262000) for _ in range(32)] for _ in range(rows)]
            steps = 128 if rows == 1 else 64
            times: dict[str, list[float]] = {name: [] for name in paths}
            tokens: dict[str, list[list[int]]] = {}
            for r in range(rounds):
                for name in (list(paths) if r % 2 else list(reversed(paths))):
                    head.OutputHead.greedy = paths[name]  # type: ignore[method-assign]
                    start = time.perf_counter()
                    outs = llm.generate(batch, SamplingParams(max_tokens=steps + 1, ignore_eos=True), use_tqdm=False)
                    whole = time.perf_counter() - start
                    start = time.perf_counter()
                    llm.generate(batch, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
                    times[name].append((whole - (time.perf_counter() - start)) / steps * 1e3)
                    tokens[name] = [o.token_ids for o in outs]
            few, chunks = (statistics.median(times[name]) for name in paths)
            print(f"| {rows} | {few:.2f} | {chunks:.2f} | {tokens['few rows'] == tokens['by chunks']} |", flush=True)
    finally:
        head.OutputHead.greedy = real  # type: ignore[method-assign]
        llm.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("switch", "head"), default=None, help="one part (default: both)")
    p.add_argument("--rows", default="1,4,16", help="the head part's row counts")
    p.add_argument("--rounds", type=int, default=6)
    a = p.parse_args()
    try:
        rows = [int(r) for r in a.rows.split(",")]
    except ValueError:
        p.error(f"--rows takes comma-separated integers, got {a.rows!r}")
    if any(r < 1 for r in rows) or a.rounds < 1:
        p.error("--rows and --rounds must be at least 1")
    print(torch_header(None, ("avx", "amx")))
    if a.part in (None, "switch"):
        switch_table()
    if a.part in (None, "head"):
        head_ab(rows, a.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
