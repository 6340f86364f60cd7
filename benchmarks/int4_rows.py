"""Gemma 3 270M's linears per call: int4 groups (torch's packed CPU kernel) against int8 and bf16.

    python benchmarks/int4_rows.py                          # 1, 2, 16, 64, 256, 2048 rows; 1 and 2 threads
    python benchmarks/int4_rows.py --rows 1,16 --threads 1 --repeat 31

Random weights of the default model's shapes (qkv 1536 x 640, o 640 x 1024, gate|up 4096 x
640, down 640 x 2048, and the head's 262,144 x 640 as its 8 chunks of 32768 rows), each timed
per call at each row count, the paths interleaved in one process (a loaded machine slows
them alike, so the ratios hold better than the times):
- `bf16`: the bf16 weight through make_linear (oneDNN-packed where it pays), bf16 input;
- `int8`: W8A8Linear (models/layers/int8.py) on float32 input, its activation
  quantization included: what `--quantization int8` runs;
- `int4 bf16`: `_weight_int4pack_mm_for_cpu`, groups of 32, bf16 input and bf16 scales and
  offsets (the int4 head's form);
- `dequant bf16`: the int4 nibbles expanded to a bf16 weight at every call, then F.linear
  (one copy of the weight made per call instead of held: the prefill option).
Prints per shape the median microseconds per call of each path, and the bytes each holds.
The same int4 kernel on float32 input (with float32 scales, which it then requires) is left
out: it is not vectorised, 13-18x int8's time at one row and hundreds of times at 16.
The head chunk is timed up to --head-rows rows only (the int4 kernel's time grows with
the rows: at 2048 rows a chunk takes seconds).
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
import torch.nn.functional as F  # noqa: E402

from common import torch_header  # noqa: E402
from hybridserve.models.layers.head import quantize_int4_groups  # noqa: E402
from hybridserve.models.layers.int8 import W8A8Linear, quantize_gemm_weight  # noqa: E402
from hybridserve.models.layers.linear import make_linear  # noqa: E402

SHAPES = {"qkv 1536x640": (1536, 640), "o 640x1024": (640, 1024), "gate|up 4096x640": (4096, 640),
          "down 640x2048": (640, 2048), "head chunk 32768x640": (32768, 640)}
GROUP = 32


def _paths(n: int, k: int, g: torch.Generator) -> tuple[dict, dict[str, int]]:
    """({path: (x dtype, x -> x W^T)}, {path: bytes held}) for one random [n, k] weight."""
    w = torch.randn(n, k, generator=g) * 0.02
    bf16 = w.to(torch.bfloat16)
    dense, _, packed = make_linear(bf16, None)
    values8, scale8 = quantize_gemm_weight(w)
    int8 = W8A8Linear(values8, scale8)
    values, scale, offset = quantize_int4_groups(w, GROUP)
    packed4 = torch._convert_weight_to_int4pack_for_cpu(values, 1)
    so16 = torch.stack([scale.t(), offset.t()], dim=-1).contiguous().to(torch.bfloat16)
    nibbles = (values[:, 0::2] | (values[:, 1::2] << 4)).to(torch.uint8)  # two values a byte
    scale16, offset16 = scale.to(torch.bfloat16), (offset - 8 * scale).to(torch.bfloat16)

    def dequantized(x: torch.Tensor) -> torch.Tensor:
        q = torch.stack([nibbles & 15, nibbles >> 4], dim=-1).view(n, k // GROUP, GROUP).to(torch.bfloat16)
        return F.linear(x, (q * scale16[..., None] + offset16[..., None]).view(n, k))

    paths = {
        "bf16": (torch.bfloat16, dense),
        "int8": (torch.float32, int8),
        "int4 bf16": (torch.bfloat16, lambda x: torch._weight_int4pack_mm_for_cpu(x, packed4, GROUP, so16)),
        "dequant bf16": (torch.bfloat16, dequantized),
    }
    held = {"bf16": n * k * 2, "int8": values8.numel() + 4 * n, "int4 bf16": packed4.numel() + so16.numel() * 2, "dequant bf16": nibbles.numel() + scale16.numel() * 4}
    return paths, held


def _table(rows_list: list[int], head_rows: int, repeat: int, g: torch.Generator) -> None:
    made = {name: _paths(n, k, g) for name, (n, k) in SHAPES.items()}
    names = list(next(iter(made.values()))[0])
    print("\n| shape | rows | " + " | ".join(f"{p} us" for p in names) + " | int4 / int8 | int4 / bf16 | dequant / int8 |"
          + "\n|---|---:|" + "---:|" * (len(names) + 3))
    for name, (paths, _) in made.items():
        k = SHAPES[name][1]
        for rows in rows_list:
            if name.startswith("head") and rows > head_rows:
                continue
            x = torch.randn(rows, k, generator=g)
            inputs = {p: x.to(dtype) for p, (dtype, _) in paths.items()}
            times: dict[str, list[float]] = {p: [] for p in paths}
            calls = max(1, 8 // rows)  # several calls per sample where one is a few tens of microseconds
            for _ in range(repeat + 1):  # the first sample of each is a warm-up
                for p, (_, f) in paths.items():
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        f(inputs[p])
                    times[p].append((time.perf_counter() - t0) / calls)
            med = {p: statistics.median(t[1:]) * 1e6 for p, t in times.items()}
            print(f"| {name} | {rows} | " + " | ".join(f"{med[p]:.0f}" for p in names)
                  + f" | {med['int4 bf16'] / med['int8']:.2f} | {med['int4 bf16'] / med['bf16']:.2f}"
                  + f" | {med['dequant bf16'] / med['int8']:.2f} |", flush=True)
    print("\n| shape | " + " | ".join(f"{p} MB" for p in names) + " |\n|---|" + "---:|" * len(names))
    for name, (_, held) in made.items():
        print(f"| {name} | " + " | ".join(f"{held[p] / 1e6:.2f}" for p in names) + " |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,16,64,256,2048")
    p.add_argument("--threads", default="1,2", help="comma-separated torch thread counts, one table each")
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--head-rows", type=int, default=64, help="the most rows the head chunk is timed at")
    a = p.parse_args()
    g = torch.Generator().manual_seed(0)
    for threads in (int(t) for t in a.threads.split(",")):
        print(f"\n## {torch_header(threads, ('avx2', 'avx512_bf16', 'avx512_vnni', 'amx'))}")
        _table([int(r) for r in a.rows.split(",")], a.head_rows, a.repeat, g)
    return 0


if __name__ == "__main__":
    sys.exit(main())
