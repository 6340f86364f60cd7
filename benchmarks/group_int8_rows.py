"""Gemma 3 270M's linears per call with the GGUF's own block precision held as int8 groups,
against the bf16 linear.

    python benchmarks/group_int8_rows.py                       # 1, 16, 64, 1024, 4096 rows; 1 and 2 threads
    python benchmarks/group_int8_rows.py --rows 1,16,64 --threads 1 --repeat 9

The question: can the decoder hold its weights as the file stores them (every block format
of the default GGUF is an int8 value times a float scale per group of 16 or 32, plus an
offset per group for Q4_K) and multiply them at most ~1.1x bf16's time at 16 and 64 rows
and faster than bf16 at one row? Random weights of the default model's shapes (qkv 1536 x
640, o 640 x 1024, gate|up 4096 x 640, down 640 x 2048), values in Q5_0's range
[-16, 15] and one float32 scale per 32 along the input, --layers copies of each so that a
pass streams them from memory as a decode step does. Each path, interleaved, bf16 input:
- `bf16`: the weight w = q * s rounded to bf16, models/layers/linear.make_linear (oneDNN's
  packed bf16 GEMM where this CPU multiplies bf16): today's decoder;
- `compiled gemv`: x times q * s in float32 as one torch.compile'd (inductor C++) reduction,
  nothing materialised: the fused kernel inductor writes for it;
- `compiled dequant+mm`: torch.compile of q * s rounded to bf16 followed by the bf16 matmul
  (the expansion per call fused into one kernel, then the GEMM);
- `row blocks`: BLOCK_ROWS rows of the weight at a time expanded to bf16 and multiplied
  (F.linear), each block staying in cache;
- `int8 x int8 groups`: the activation quantized to int8 per 32 with its own scale (as
  llama.cpp does), one `torch._int_mm` per group of 32 columns, scaled and summed in float32;
- `int8 per row`: torch's weight-only int8 kernel `_weight_int8pack_mm` (one scale per row,
  so not the file's values: its error line says so): the speed of the only fused int8
  weight kernel torch has, the bound for a per-group one built the same way;
- `int4 kernel`: a Q4_K-like weight (values 0..15, a bf16 scale and offset per 32) through
  `_weight_int4pack_mm_for_cpu` (the `q4` mode's kernel, models/layers/int4.py);
- `int4 template`: the same op compiled with inductor's freezing and max-autotune, where
  its C++ GEMM template expands each group into a small bf16 buffer and multiplies it with
  AMX or AVX-512 (the one group-wise fused GEMM torch 2.13 has; it needs the weight frozen
  as a constant, so every copy is compiled on its own: this path runs on --template-copies
  copies only, between 2 and --slow-max-rows rows).
Prints the median microseconds per call of each path and its ratio to bf16, and each path's
relative error (Frobenius) against the float32 product of the exact weight on one call.
Paths in SLOW_PATHS run up to --slow-max-rows rows only (their time grows with the rows).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's hybridserve, whatever is installed

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import torch_header  # noqa: E402
from hybridserve.models.layers.linear import make_linear  # noqa: E402

SHAPES = {"qkv 1536x640": (1536, 640), "o 640x1024": (640, 1024), "gate|up 4096x640": (4096, 640),
          "down 640x2048": (640, 2048)}
GROUP = 32  # Q5_0's and Q8_0's block (Q4_K's sub-block); Q6_K's 16 would double the scales
Q5_0_RANGE = (-16, 16)  # [low, high) of Q5_0's values once centred
BLOCK_ROWS = 256  # 256 x 640 bf16 = 320 KB: stays in a core's L2
SLOW_PATHS = ("compiled gemv", "int8 x int8 groups", "int8 per row", "int4 kernel", "int4 template")
TEMPLATE = "int4 template"
# Set for the whole run (torch.compile's `options` do not reach freezing): the other compiled
# paths take no module constants, so freezing leaves them as they are. Without
# fx_graph_cache off, torch 2.13 hands a frozen graph compiled for one weight (in this run or
# an earlier one) to another of the same shape: outputs of relative error 1.3, seen here.
_TEMPLATE_CONFIG = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                    "fx_graph_cache": False}
INT8_LEVELS = 127

Matmul = Callable[[torch.Tensor], torch.Tensor]


def _dequantized(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] of int8 values `q` [N, K] and scales `s` [N, K/GROUP]."""
    n, k = q.shape
    return (q.view(n, k // GROUP, GROUP).float() * s[..., None]).view(n, k)


def _gemv(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (x.float()[:, None, :] * _dequantized(q, s)[None]).sum(-1).to(torch.bfloat16)


def _dequant_mm(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return x @ _dequantized(q, s).to(torch.bfloat16).t()


def _row_blocks(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], q.shape[0], dtype=torch.bfloat16)
    for start in range(0, q.shape[0], BLOCK_ROWS):
        stop = start + BLOCK_ROWS
        torch.mm(x, _dequantized(q[start:stop], s[start:stop]).to(torch.bfloat16).t(), out=out[:, start:stop])
    return out


def _int8_groups(x: torch.Tensor, qt: list[torch.Tensor], s: torch.Tensor) -> torch.Tensor:
    """x quantized per GROUP columns (its own scale per row and group), one int8 GEMM per group."""
    rows, k = x.shape
    xg = x.float().view(rows, k // GROUP, GROUP)
    xs = xg.abs().amax(-1).clamp_min(1e-12) / INT8_LEVELS  # [S, G]
    xq = torch.round(xg / xs[..., None]).to(torch.int8)
    if rows <= 16:  # torch._int_mm needs more than 16 rows: pad (its own cost, counted)
        xq = torch.cat([xq, xq.new_zeros(17 - rows, *xq.shape[1:])])
    out = torch.zeros(rows, s.shape[0])
    for g, qg in enumerate(qt):
        out += torch._int_mm(xq[:, g], qg)[:rows].float() * xs[:, g, None] * s[:, g]
    return out.to(torch.bfloat16)


class _Int4(torch.nn.Module):
    """`_weight_int4pack_mm_for_cpu` with its packed weight as a buffer (frozen by the template's compile)."""

    def __init__(self, packed: torch.Tensor, scale_offset: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("packed", packed)
        self.register_buffer("scale_offset", scale_offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scale_offset)


def _int4(n: int, k: int, g: torch.Generator) -> tuple[_Int4, torch.Tensor]:
    """(module, its exact float32 weight) for a random Q4_K-like weight: (v - 8) * scale + offset."""
    values = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scale_offset = torch.stack([torch.rand(k // GROUP, n, generator=g) * 2e-3,
                                torch.randn(k // GROUP, n, generator=g) * 2e-3], dim=-1).bfloat16()
    scale, offset = scale_offset.float().unbind(-1)
    w = ((values.view(n, k // GROUP, GROUP) - 8) * scale.t()[..., None] + offset.t()[..., None]).view(n, k)
    return _Int4(torch._convert_weight_to_int4pack_for_cpu(values, 1), scale_offset).eval(), w


def _paths(n: int, k: int, g: torch.Generator, template: bool) -> dict[str, tuple[Matmul, torch.Tensor]]:
    """{path: (bf16 x -> x W^T, W's exact float32 values)} for one random weight as int8
    groups (and one as int4 groups for the int4 paths; `template`: compile it too)."""
    q = torch.randint(*Q5_0_RANGE, (n, k), generator=g, dtype=torch.int8)
    s = torch.rand(n, k // GROUP, generator=g) * 2e-3
    w = _dequantized(q, s)
    dense, _, _ = make_linear(w.to(torch.bfloat16), None)
    qt = [q[:, j:j + GROUP].t().contiguous() for j in range(0, k, GROUP)]
    row_q = torch.round(w / (w.abs().amax(1, keepdim=True) / INT8_LEVELS)).to(torch.int8)
    row_s = (w.abs().amax(1) / INT8_LEVELS).to(torch.bfloat16)
    gemv, dequant_mm = torch.compile(_gemv, dynamic=False), torch.compile(_dequant_mm, dynamic=False)
    int4, w4 = _int4(n, k, g)
    paths = {
        "bf16": (dense, w),
        "compiled gemv": (lambda x: gemv(x, q, s), w),
        "compiled dequant+mm": (lambda x: dequant_mm(x, q, s), w),
        "row blocks": (lambda x: _row_blocks(x, q, s), w),
        "int8 x int8 groups": (lambda x: _int8_groups(x, qt, s), w),
        "int8 per row": (lambda x: torch._weight_int8pack_mm(x, row_q, row_s), w),
        "int4 kernel": (int4, w4),
    }
    if template:
        paths[TEMPLATE] = (torch.compile(int4, dynamic=False), w4)
    return paths


def _table(rows_list: list[int], layers: int, repeat: int, slow_max_rows: int, template_copies: int,
           g: torch.Generator) -> None:
    made = {name: [_paths(n, k, g, i < template_copies) for i in range(layers)] for name, (n, k) in SHAPES.items()}
    names = list(made["qkv 1536x640"][0])
    print("\n| shape | rows | " + " | ".join(f"{p} us" for p in names) + " | "
          + " | ".join(f"{p} / bf16" for p in names[1:]) + " |\n|---|---:|" + "---:|" * (2 * len(names) - 1))
    errors: dict[tuple[str, int], dict[str, float]] = {}
    for name, copies in made.items():
        k = SHAPES[name][1]
        for rows in rows_list:
            live = [p for p in names if (rows <= slow_max_rows or p not in SLOW_PATHS)
                    and (rows > 1 or p != TEMPLATE) and p in copies[0]]
            used = copies if rows <= 64 else copies[:2]  # prefill sizes are compute-bound: two copies suffice
            x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
            errors[name, rows] = {}
            for p in live:
                f, w = used[0][p]
                exact = F.linear(x.float(), w)
                errors[name, rows][p] = ((f(x).float() - exact).norm() / exact.norm()).item()
            times: dict[str, list[float]] = {p: [] for p in live}
            for _ in range(repeat + 1):  # the first pass of each is a warm-up
                for p in live:
                    calls = [paths[p][0] for paths in used if p in paths]
                    t0 = time.perf_counter()
                    for f in calls:
                        f(x)
                    times[p].append((time.perf_counter() - t0) / len(calls))
            med = {p: statistics.median(t[1:]) * 1e6 for p, t in times.items()}
            print(f"| {name} | {rows} | " + " | ".join(f"{med[p]:.0f}" if p in med else "-" for p in names) + " | "
                  + " | ".join(f"{med[p] / med['bf16']:.2f}" if p in med else "-" for p in names[1:]) + " |",
                  flush=True)
    print("\nrelative error against the exact weight's float32 product (largest over shapes and rows)\n| path | "
          "error |\n|---|---:|")
    for p in names:
        print(f"| {p} | {max((e[p] for e in errors.values() if p in e), default=float('nan')):.1e} |")
    print(f"\n({TEMPLATE}: {template_copies} copies of each shape, the other paths {layers}; both 2 above 64 rows)")


def table_arguments(doc: str, rows: str, repeat: int) -> argparse.ArgumentParser:
    """The options of this script and group_int8_native.py: rows, threads, repeat, layers."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--rows", default=rows)
    p.add_argument("--threads", default="1,2", help="comma-separated torch thread counts, one table each")
    p.add_argument("--repeat", type=int, default=repeat)
    p.add_argument("--layers", type=int, default=18, help="copies of each shape (the decoder's layer count)")
    return p


def main() -> int:
    p = table_arguments(__doc__, "1,16,64,1024,4096", 7)
    p.add_argument("--slow-max-rows", type=int, default=64, help=f"the most rows {', '.join(SLOW_PATHS)} run at")
    p.add_argument("--template-copies", type=int, default=4,
                   help=f"copies of each shape compiled for {TEMPLATE} (each compile takes seconds; 0: left out)")
    a = p.parse_args()
    torch._dynamo.config.recompile_limit = 1024  # one compiled graph per weight copy and row count
    g = torch.Generator().manual_seed(0)
    for threads in (int(t) for t in a.threads.split(",")):
        print(f"\n## {torch_header(threads, ('avx2', 'avx512_bf16', 'avx512_vnni', 'amx'))}")
        with torch.no_grad(), torch._inductor.config.patch(_TEMPLATE_CONFIG):  # inductor freezes only under no_grad
            _table([int(r) for r in a.rows.split(",")], a.layers, a.repeat, a.slow_max_rows, a.template_copies, g)
    return 0


if __name__ == "__main__":
    sys.exit(main())
