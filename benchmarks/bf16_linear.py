"""Time of Gemma 3 270M's bfloat16 matmuls per decode step, as bf16 or as float32 kernels.

    python benchmarks/bf16_linear.py                  # 1, 16 and 64 rows, this CPU
    python benchmarks/bf16_linear.py --rows 16 --repeat 9

The weights of benchmarks/int8_rows.py's shapes (the decoder's 72 matmuls, the head's 8
chunks of 32768 rows), rounded to bfloat16, multiplied with bfloat16 activations three
ways, alternating, median of --repeat passes:
- `bf16 plain`: `F.linear` in bfloat16 (ATen's own kernel);
- `bf16 packed`: models/layers/linear.make_linear as on a CPU with native bf16 (oneDNN's packed
  bf16 GEMM; where oneDNN refuses bf16 packing here, `n/a`);
- `as float32`: make_linear as on a CPU without native bf16 (float32 packed copies of the
  bf16 values, one rounding of the output: what `--dtype bfloat16` runs there).
A float32 model's packed matmuls (`float32`) are timed beside them. The header names the
CPU flags (avx512_bf16 / amx_bf16 say which of the two make_linear picks here).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's hybridserve, whatever is installed

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import torch_header  # noqa: E402
from hybridserve.models.layers.linear import make_linear  # noqa: E402
from int8_rows import HEAD_CHUNKS, LAYERS, SHAPES, step_table  # noqa: E402  (this folder is on sys.path)

COLUMNS = {p: p for p in ("bf16 plain", "bf16 packed", "as float32", "float32")}


def _weights(shapes: list[tuple[int, int]], g: torch.Generator) -> list[tuple[int, dict]]:
    """(in features, {path: x_bf16 -> x W^T, or None where unavailable}) per weight."""
    made = []
    for n, k in shapes:
        w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
        native, _, native_packed = make_linear(w, None, native_bf16=True)
        widened, _, _ = make_linear(w, None, native_bf16=False)
        w32 = w.float()
        dense32, _, _ = make_linear(w32, None)
        made.append((k, {"bf16 plain": lambda x, w=w: F.linear(x, w),
                         "bf16 packed": native if native_packed else None,
                         "as float32": widened,
                         "float32": lambda x, f=dense32: f(x.float())}))
    return made


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,16,64", help="activation rows per pass (decode batch sizes)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = p.parse_args()
    print(torch_header(a.threads, ("avx2", "avx512_bf16", "amx_bf16")))
    g = torch.Generator().manual_seed(0)
    rows_list = [int(r) for r in a.rows.split(",")]
    step_table("decoder: 72 matmuls per step", _weights(SHAPES * LAYERS, g), COLUMNS, rows_list, a.repeat, g,
               torch.bfloat16)
    step_table("head: 8 chunks of 32768 rows", _weights(HEAD_CHUNKS, g), COLUMNS, rows_list, a.repeat, g,
               torch.bfloat16)
    return 0


if __name__ == "__main__":
    sys.exit(main())
