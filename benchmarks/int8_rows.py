"""Time of Gemma 3 270M's 72 int8 decoder matmuls per step, packed GEMM against the one-row path.

    python benchmarks/int8_rows.py                    # 1, 2, 4 and 16 rows
    python benchmarks/int8_rows.py --rows 1,16 --repeat 21

Random weights of the default model's decoder shapes (18 layers of qkv 1536 x 640, o 640 x
1024, gate|up 4096 x 640, down 640 x 2048; 100 MB of int8, far larger than the caches, so
each pass streams them from memory as a decode step does) are quantized as `--quantization
int8` does. Each pass multiplies every layer's four weights once, activations quantized per
call, through the two paths of models/int8.W8A8Linear: `general` (oneDNN's packed u8 x s8
GEMM) and `single_row` (torch._int_mm on the plain weight, the path one
row takes). Prints the median of --repeat passes, alternating the paths, with the CPU flags,
load, commit and threads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's hybridserve, whatever is installed

import torch  # noqa: E402

from hybridserve.models.cpu_features import read_cpu_flags  # noqa: E402
from hybridserve.models.int8 import W8A8Linear, int8_activations_native, quantize_int8_rows  # noqa: E402

LAYERS = 18
SHAPES = [(1536, 640), (640, 1024), (4096, 640), (640, 2048)]  # [out, in] of qkv, o, gate|up, down


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,16", help="activation rows per pass (decode batch sizes)")
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = p.parse_args()
    if not int8_activations_native():
        print("int8_rows: this CPU has no int8 dot products (VNNI / AMX-INT8); int8 layers are not used here",
              file=sys.stderr)
        return 2
    if a.threads:
        torch.set_num_threads(a.threads)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=REPO).stdout.strip()
    flags = " ".join(sorted(f for f in read_cpu_flags() if f.startswith(("avx512_vnni", "avx_vnni", "amx"))))
    print(f"# commit {commit}; {torch.get_num_threads()} threads; flags {flags}; load {os.getloadavg()[0]:.1f}")
    g = torch.Generator().manual_seed(0)
    linears = [(k, W8A8Linear(*quantize_int8_rows(torch.randn(n, k, generator=g) * 0.02)))
               for _ in range(LAYERS) for n, k in SHAPES]

    paths = ("general", "single_row")  # W8A8Linear's methods: the packed GEMM, the one-row path
    print("| rows | packed GEMM ms | one-row path ms |")
    print("|---:|---:|---:|")
    for rows in (int(r) for r in a.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=g) for k in {k for _, k in SHAPES}}
        times: dict[str, list[float]] = {path: [] for path in paths}
        for _ in range(a.repeat + 1):  # the first pass of each is a warm-up
            for path in paths:
                t0 = time.perf_counter()
                for k, linear in linears:
                    getattr(linear, path)(xs[k])
                times[path].append(time.perf_counter() - t0)
        print("| " + " | ".join([str(rows)] + [f"{statistics.median(times[p][1:]) * 1e3:.2f}" for p in paths]) + " |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
