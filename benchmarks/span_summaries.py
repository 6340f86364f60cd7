"""Time of one chunk's span summaries per kernel: the native C kernel, inductor's compiled
loop and eager span_stats (models/layers/span_kernel.py).

    python benchmarks/span_summaries.py                          # rows 1,16,64; chunks of 32768
    python benchmarks/span_summaries.py --rows 64 --width 32768 --rounds 5 --threads 1
    python benchmarks/span_summaries.py --isa avx2        # as on a CPU with AVX2 alone

Each kernel summarises the same random float32 chunk [rows, width] (logits of spread
--spread at temperature 1 and 0.7); kernels alternate within each round, --calls calls
per kernel and round, and the median of the rounds' per-call means is printed with each
kernel's ratio to the native one and its largest relative mass difference from a float64
reference. `--isa avx2` runs it as on a CPU with AVX2 alone (common.rerun_as_avx2: the native
kernel is then built for AVX2 + FMA, ATen's kernels limited to AVX2). Prints the CPU flags,
load, commit and threads with the figures.
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
from hybridserve.models.layers.span_kernel import _summarise  # noqa: E402
from hybridserve.models.layers.span_logits import EXP_FLOOR, SPAN, span_stats  # noqa: E402
from hybridserve.models.layers.span_native import NativeSummaries  # noqa: E402


def reference_mass(x: torch.Tensor, inv_t: torch.Tensor) -> torch.Tensor:
    spans = x.double().view(x.shape[0], -1, SPAN)
    peak = spans.amax(dim=-1, keepdim=True)
    return torch.exp(((spans - peak) * inv_t.double().view(-1, 1, 1)).clamp(min=EXP_FLOOR)).sum(dim=-1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,16,64")
    p.add_argument("--width", type=int, default=32768, help="logits per chunk row (a multiple of 128)")
    p.add_argument("--spread", type=float, default=3.0, help="standard deviation of the random logits")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--isa", choices=["native", "avx2"], default="native")
    a = p.parse_args()
    if a.isa == "avx2" and (rc := rerun_as_avx2()) is not None:
        return rc
    print(torch_header(a.threads, ("avx2", "avx512f", "avx512_bf16", "amx")))
    kernels = {"native": NativeSummaries(),
               "compiled": torch.compile(_summarise, dynamic=True, fullgraph=True),
               "eager": span_stats}
    print(f"chunk width {a.width}, spread {a.spread}, {a.calls} calls x {a.rounds} rounds, kernels alternating")
    print("| rows | T | " + " | ".join(f"{k} ms" for k in kernels) + " | "
          + " | ".join(f"{k} / native" for k in list(kernels)[1:]) + " | max rel. mass error (" + ", ".join(kernels) + ") |")
    print("|---:|---:|" + "---:|" * (2 * len(kernels) - 1) + "---|")
    g = torch.Generator().manual_seed(0)
    for rows in (int(r) for r in a.rows.split(",")):
        x = torch.randn(rows, a.width, generator=g) * a.spread
        for temperature in (1.0, 0.7):
            inv_t = torch.full((rows,), 1.0 / temperature)
            want = reference_mass(x, inv_t)
            errors = []
            for fn in kernels.values():
                mass = fn(x, inv_t)[1].double()
                errors.append(float(((mass - want).abs() / want).max()))
            times: dict[str, list[float]] = {k: [] for k in kernels}
            for _ in range(a.rounds):
                for name, fn in kernels.items():
                    t0 = time.perf_counter()
                    for _ in range(a.calls):
                        fn(x, inv_t)
                    times[name].append((time.perf_counter() - t0) / a.calls)
            ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            print(f"| {rows} | {temperature} | " + " | ".join(f"{ms[k]:.3f}" for k in kernels) + " | "
                  + " | ".join(f"{ms[k] / ms['native']:.2f}" for k in list(kernels)[1:]) + " | "
                  + ", ".join(f"{e:.1e}" for e in errors) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
