"""Time of one greedy pass of Gemma 3 270M's int8 head per chunk size (models/layers/head.py).

    python benchmarks/head_chunks.py                     # chunks of 16384 and 32768 rows
    python benchmarks/head_chunks.py --chunks 8192,16384,32768,65536 --rows 1,16,64
    python benchmarks/head_chunks.py --isa avx2 --chunks 8192,32768 --rows 1,16,64   # fbgemm's path

A random [262144, 640] bfloat16 head (the default model's shape) is quantized as `--quantization
int8` does, once per chunk size, and `OutputHead.greedy` (int8 GEMM per chunk, then the argmax)
is timed on random hidden states: the median of --repeat passes. The whole head (168 MB of int8)
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
    a = p.parse_args()
    if a.isa == "avx2" and (rc := rerun_as_avx2()) is not None:
        return rc
    print(torch_header(a.threads, ("avx512_bf16", "avx512_vnni", "amx")))
    weight = (torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0)) * 0.05).to(torch.bfloat16)
    print("| chunk rows | " + " | ".join(f"{r} rows ms" for r in a.rows.split(",")) + " |")
    print("|---:|" + "---:|" * len(a.rows.split(",")))
    for chunk in (int(c) for c in a.chunks.split(",")):
        out = head.OutputHead(weight, "int8", chunk_rows=chunk)
        cells = []
        for rows in (int(r) for r in a.rows.split(",")):
            x = torch.randn(rows, HIDDEN)
            out.greedy(x, None)  # warm-up
            times = []
            for _ in range(a.repeat):
                t0 = time.perf_counter()
                out.greedy(x, None)
                times.append(time.perf_counter() - t0)
            cells.append(f"{statistics.median(times) * 1e3:.2f}")
        print(f"| {chunk} | " + " | ".join(cells) + " |", flush=True)
        del out
    return 0


if __name__ == "__main__":
    sys.exit(main())
