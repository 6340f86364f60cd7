"""Time of one pass of Gemma 3 270M's int8 head per chunk size (models/layers/head.py).

    python benchmarks/head_chunks.py                     # chunks of 16384 and 32768 rows
    python benchmarks/head_chunks.py --chunks 8192,16384,32768,65536 --rows 1,16,64
    python benchmarks/head_chunks.py --isa avx2 --chunks 8192,32768 --rows 1,16,64   # fbgemm's path
    python benchmarks/head_chunks.py --chunks 32768 --rows 1,8,16,64 --pass greedy,sampled,summaries

A random [262144, 640] bfloat16 head (the default model's shape) is quantized as `--quantization
int8` does, once per chunk size, and `OutputHead.greedy` (int8 GEMM per chunk, then the argmax)
is timed on random hidden states: the median of --repeat passes. `--pass sampled` times
`OutputHead.span_logits` instead, what a sampled decode step's head does (every logit
written, each span summarised at temperature 1), and `--pass summaries` the same with
stored=False (the span summaries only, as a batch of greedy and plain temperature rows
has them); the passes named alternate pass by pass. The whole head (168 MB of int8)
is far larger than the caches, so each pass streams it from memory as a decode step does.
`--isa avx2` measures in a process run as on a CPU with AVX2 alone (cpu_features.as_avx2_env),
where the int8 head runs on fbgemm's GEMM (models/layers/int8.int8_path).
Prints the CPU flags, load, commit and threads with the figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's hybridserve, whatever is installed

import torch  # noqa: E402

from common import rerun_as_avx2, torch_header  # noqa: E402
from hybridserve.models.layers import head  # noqa: E402

VOCAB, HIDDEN = 262144, 640  # Gemma 3 270M


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", default="16384,32768", help="vocabulary rows per chunk, comma-separated")
    p.add_argument("--rows", default="1,16", help="hidden-state rows per pass (decode batch sizes)")
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--isa", choices=["native", "avx2"], default="native")
    p.add_argument("--pass", dest="passes", default="greedy", help="comma list of greedy, sampled, summaries")
    a = p.parse_args()
    passes = a.passes.split(",")
    if unknown := [name for name in passes if name not in ("greedy", "sampled", "summaries")]:
        p.error(f"unknown pass {', '.join(unknown)}: use greedy, sampled, summaries")
    if a.isa == "avx2" and (rc := rerun_as_avx2()) is not None:
        return rc
    print(torch_header(a.threads, ("avx512_bf16", "avx512_vnni", "amx")))
    weight = (torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0)) * 0.05).to(torch.bfloat16)
    rows_list = [int(r) for r in a.rows.split(",")]
    columns = [f"{r} rows {name} ms" for r in rows_list for name in passes]
    print("| chunk rows | " + " | ".join(columns) + " |")
    print("|---:|" + "---:|" * len(columns))
    for chunk in (int(c) for c in a.chunks.split(",")):
        out = head.OutputHead(weight, "int8", chunk_rows=chunk)
        cells = []
        for rows in rows_list:
            x = torch.randn(rows, HIDDEN)
            inv_t = torch.ones(rows)
            run = {"greedy": lambda x=x: out.greedy(x, None),
                   "sampled": lambda x=x, inv_t=inv_t: out.span_logits(x, inv_t, None),
                   "summaries": lambda x=x, inv_t=inv_t: out.span_logits(x, inv_t, None, stored=False)}
            for name in passes:
                run[name]()  # warm-up
            times: dict[str, list[float]] = {name: [] for name in passes}
            for _ in range(a.repeat):
                for name in passes:
                    t0 = time.perf_counter()
                    run[name]()
                    times[name].append(time.perf_counter() - t0)
            cells += [f"{statistics.median(times[name]) * 1e3:.2f}" for name in passes]
        print(f"| {chunk} | " + " | ".join(cells) + " |", flush=True)
        del out
    return 0


if __name__ == "__main__":
    sys.exit(main())
