"""Time of Gemma 3 270M's int8 matmuls per decode step: float32 and the int8 x int8 paths.

    python benchmarks/int8_rows.py                    # 1, 2, 4 and 16 rows, this CPU
    python benchmarks/int8_rows.py --isa avx2         # as on a CPU with AVX2 alone
    python benchmarks/int8_rows.py --rows 1,16 --repeat 21
    python benchmarks/int8_rows.py --peak             # the CPU's multiply-add rate per path

Random weights of the default model's shapes, each pass streaming them from memory as a
decode step does (far larger than the caches):
- decoder: 18 layers of qkv 1536 x 640, o 640 x 1024, gate|up 4096 x 640, down 640 x 2048
  (100 MB of int8, 400 MB of float32);
- head: 8 chunks of 32768 x 640 vocabulary rows (168 MB of int8, 671 MB of float32).
Every weight is multiplied once per pass, activations quantized per call, five ways:
`float32`, oneDNN's packed float32 GEMM (models/layers/linear.py, what --dtype float32 runs);
`packed`, W8A8Linear.general (oneDNN's packed u8 x s8 GEMM); `plain`, W8A8Linear.plain
(torch._int_mm on the plain weight); `fbgemm`, W8A8Linear.fbgemm (fbgemm's u8 x s8 GEMM);
`amx`, W8A8Linear.amx (int8_amx.c on AMX's integer tiles; n/a without them).
The int8 weights take this CPU's levels (127, or 63 on AVX2 alone:
models/layers/int8.gemm_weight_levels). Prints the median of --repeat passes, alternating the
five, with the CPU flags, load, commit and threads. `--isa avx2` runs the measurement in a
process limited as cpu_features.as_avx2_env says (how the AVX2 choices of
models/layers/int8.int8_path were measured on an AVX-512 machine).

`--peak` prints instead the multiply-adds per second of each path at PEAK_ROWS rows against
one head chunk (compute-bound: the rate the CPU's kernels reach at best), and of a plain
2048^3 float32 matmul: the ceiling any engine's float32 or int8 decode runs under here.
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

from common import median_seconds, rerun_as_avx2, torch_header  # noqa: E402
from hybridserve.models.layers.int8 import (W8A8Linear, gemm_weight_levels, int8_gemm_available,  # noqa: E402
                                           quantize_gemm_weight)
from hybridserve.models.layers.int8_amx import amx_kernel  # noqa: E402
from hybridserve.models.layers.linear import make_linear  # noqa: E402

LAYERS = 18
SHAPES = [(1536, 640), (640, 1024), (4096, 640), (640, 2048)]  # [out, in] of qkv, o, gate|up, down
HEAD_CHUNKS = [(32768, 640)] * 8  # models/layers/head.py's chunks of Gemma 3 270M's 262,144-row head
PATHS = ("float32", "packed", "plain", "fbgemm", "amx")
COLUMNS = {"float32": "float32", "packed": "int8 packed", "plain": "int8 plain", "fbgemm": "int8 fbgemm",
           "amx": "int8 amx"}
PEAK_ROWS = 1024


def _weights(shapes: list[tuple[int, int]], g: torch.Generator) -> list[tuple[int, dict]]:
    """(in features, {path: x -> x W^T}) per weight."""
    made = []
    for n, k in shapes:
        w = torch.randn(n, k, generator=g) * 0.02
        dense, _, _ = make_linear(w, None)
        int8 = W8A8Linear(*quantize_gemm_weight(w))
        made.append((k, {"float32": dense, "packed": int8.general, "plain": int8.plain, "fbgemm": int8.fbgemm,
                         "amx": int8.amx if amx_kernel() is not None else None}))
    return made


def step_table(name: str, weights: list[tuple[int, dict]], columns: dict[str, str], rows_list: list[int],
               repeat: int, g: torch.Generator, dtype: torch.dtype = torch.float32) -> None:
    """Print one row per row count: the median ms of a pass over every weight, per path
    (`columns`: path -> column title), the paths alternating; a path some weight lacks
    (None) prints n/a."""
    print(f"\n{name}\n| rows | " + " | ".join(f"{t} ms" for t in columns.values()) + " |\n|---:|"
          + "---:|" * len(columns))
    available = [p for p in columns if all(fs[p] is not None for _, fs in weights)]
    for rows in rows_list:
        xs = {k: torch.randn(rows, k, generator=g).to(dtype) for k in {k for k, _ in weights}}
        times: dict[str, list[float]] = {path: [] for path in available}
        for _ in range(repeat + 1):  # the first pass of each is a warm-up
            for path in available:
                t0 = time.perf_counter()
                for k, fs in weights:
                    fs[path](xs[k])
                times[path].append(time.perf_counter() - t0)
        cells = [f"{statistics.median(times[p][1:]) * 1e3:.2f}" if p in times else "n/a" for p in columns]
        print("| " + " | ".join([str(rows)] + cells) + " |", flush=True)


def _peak(repeat: int, g: torch.Generator) -> None:
    """GMAC/s of each path at PEAK_ROWS rows x one head chunk, and of a 2048^3 float32 matmul."""
    (k, fs), = _weights(HEAD_CHUNKS[:1], g)
    n = HEAD_CHUNKS[0][0]
    x = torch.randn(PEAK_ROWS, k, generator=g)
    square = torch.randn(2048, 2048, generator=g)
    runs = {path: (lambda f=fs[path]: f(x), PEAK_ROWS * n * k) for path in PATHS
            if path != "plain" and fs[path] is not None}
    runs["float32 2048^3 matmul"] = (lambda: square @ square, 2048 ** 3)
    print(f"\n| {PEAK_ROWS} rows x {n} x {k} | GMAC/s |\n|---|---:|")
    for name, (f, macs) in runs.items():  # torch._int_mm ("plain") is skipped: far off the others on AVX2
        print(f"| {name} | {macs / median_seconds(f, repeat) / 1e9:.1f} |", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,16", help="activation rows per pass (decode batch sizes)")
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--isa", choices=["native", "avx2"], default="native")
    p.add_argument("--peak", action="store_true", help="multiply-add rates at many rows instead of the tables")
    a = p.parse_args()
    if a.isa == "avx2" and (rc := rerun_as_avx2()) is not None:
        return rc
    if not int8_gemm_available():
        print("int8_rows: no int8 GEMM on this CPU (x86 with AVX2 or VNNI); int8 layers are not used here",
              file=sys.stderr)
        return 2
    print(f"{torch_header(a.threads, ('avx2', 'avx512_vnni', 'avx_vnni', 'amx'))}; int8 weight levels "
          f"{gemm_weight_levels()}")
    g = torch.Generator().manual_seed(0)
    if a.peak:
        _peak(a.repeat, g)
        return 0
    rows_list = [int(r) for r in a.rows.split(",")]
    step_table("decoder: 72 matmuls per step", _weights(SHAPES * LAYERS, g), COLUMNS, rows_list, a.repeat, g)
    step_table("head: 8 chunks of 32768 rows", _weights(HEAD_CHUNKS, g), COLUMNS, rows_list, a.repeat, g)
    return 0


if __name__ == "__main__":
    sys.exit(main())
