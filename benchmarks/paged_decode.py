"""Time of one layer's decode attention over the paged KV cache: the in-place kernel
(executor/torch/paged_decode.c) against the general path (gather the blocks, then SDPA
with a mask), each through StepAttention.attention as a decode step calls it (the KV
write included).

    python benchmarks/paged_decode.py                             # rows 1,16,64; 64 and 512 keys
    python benchmarks/paged_decode.py --rows 64 --keys 100 --dtype float32 --threads 1
    python benchmarks/paged_decode.py --dtype float32 --cache-dtype bfloat16  # a float32 model's bf16 cache
    python benchmarks/paged_decode.py --isa avx2                  # as on a CPU with AVX2 alone

Gemma 3 270M's attention by default (4 query heads on 1 kv head of 256, blocks of 16);
--layers distinct layer caches, in one pool on transparent huge pages as the engine's KV
pool is (executor/torch/kv_cache.py), are called in turn, each call after --between-mb of
other memory is read (a step's layers stream their weights between two attention calls,
so the keys are not in cache: 10 MB is about a Gemma 3 270M layer's int8 weights and its
share of the head), --calls passes over them per round, the paths alternating within each
round, each call timed alone; the median of the rounds' per-layer means is printed with the ratio and each
output's largest difference from the attention written out in float64 on the same inputs.
Prints CPU flags, load, commit and threads. Whole decode steps with the kernel on and off:
`python benchmarks/native_step.py --kernels paged_decode`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's hybridserve, whatever is installed

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common import rerun_as_avx2, torch_header  # noqa: E402
from hybridserve.executor.torch.attention import StepAttention  # noqa: E402
from hybridserve.executor.torch.paged_decode import paged_decode  # noqa: E402
from hybridserve.executor.torch.requests import BlockTables  # noqa: E402
from hybridserve.models.platform.huge_pages import zeros_on_huge_pages  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,16,64")
    p.add_argument("--keys", default="64,512", help="keys each request attends to (its position + 1)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16", help="the query's (the model's)")
    p.add_argument("--cache-dtype", choices=list(DTYPES), default=None,
                   help="the cache's (default: --dtype; bfloat16 under float32: a float32 model's bf16 cache)")
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--between-mb", type=float, default=10.0,
                   help="memory read before each call, not timed (0: the layers' keys may stay in cache)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--isa", choices=["native", "avx2"], default="native")
    a = p.parse_args()
    if a.isa == "avx2" and (rc := rerun_as_avx2()) is not None:
        return rc
    if paged_decode() is None:
        print("error: the in-place kernel could not be built (no C compiler?)", file=sys.stderr)
        return 2
    print(torch_header(a.threads, ("avx2", "avx512f", "avx512_bf16", "amx")))
    dtype, bs = DTYPES[a.dtype], a.block_size
    cache_dtype = DTYPES[a.cache_dtype or a.dtype]
    print(f"{a.heads} heads on {a.kv_heads} kv heads of {a.head_dim}, {a.dtype} over a {cache_dtype} cache, "
          f"blocks of {bs}, {a.layers} layers on huge pages, {a.between_mb:g} MB read before each call, "
          f"{a.calls} passes x {a.rounds} rounds, paths alternating; microseconds per layer call")
    print("| rows | keys | in place us | gather + SDPA us | gather / in place | in place max abs error | "
          "gather + SDPA max abs error |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    between = torch.ones(int(a.between_mb * 2**20) // 4) if a.between_mb > 0 else None
    g = torch.Generator().manual_seed(0)
    for rows in (int(r) for r in a.rows.split(",")):
        for keys in (int(k) for k in a.keys.split(",")):
            per_row = -(-keys // bs)
            tables = BlockTables(1)
            tables.table = np.zeros((1, rows, per_row), dtype=np.int64)
            tables.table[0] = 1 + np.arange(rows * per_row).reshape(rows, per_row)
            tables.lengths = np.full((1, rows), per_row)
            pool = zeros_on_huge_pages((a.layers, 1 + rows * per_row, bs, 2, a.kv_heads, a.head_dim), cache_dtype)
            for layer in range(a.layers):
                pool[layer] = torch.randn(pool.shape[1:], generator=g).to(cache_dtype)
            caches = list(pool.unbind(0))
            q = torch.randn(rows, a.heads, a.head_dim, generator=g).to(dtype)
            kv = torch.randn(rows, 2, a.kv_heads, a.head_dim, generator=g).to(dtype)
            starts = np.full(rows, keys - 1)

            def step(in_place: bool) -> StepAttention:
                return StepAttention([(0, c) for c in caches], [None], tables, bs, np.arange(rows), starts,
                                     np.ones(rows, dtype=np.int64), a.head_dim ** -0.5, None, torch.device("cpu"),
                                     dtype, in_place_decode=in_place)

            steps = {True: step(True), False: step(False)}
            outs = {m: s.attention(0, q, kv) for m, s in steps.items()}
            times: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(a.rounds):
                for mode, s in steps.items():
                    spent = 0.0
                    for _ in range(a.calls):
                        for layer in range(a.layers):
                            if between is not None:
                                between.sum()
                            t = time.perf_counter()
                            s.attention(layer, q, kv)
                            spent += time.perf_counter() - t
                    times[mode].append(spent / (a.calls * a.layers) * 1e6)
            fast, general = statistics.median(times[True]), statistics.median(times[False])
            want = reference(q, kv, caches[0], a.head_dim ** -0.5, keys - 1, bs).view(rows, -1)
            err = {m: (o.double() - want).abs().max().item() for m, o in outs.items()}
            print(f"| {rows} | {keys} | {fast:.0f} | {general:.0f} | {general / fast:.2f} | {err[True]:.1e} | "
                  f"{err[False]:.1e} |")
    return 0


def reference(q: torch.Tensor, kv: torch.Tensor, cache: torch.Tensor, scale: float, position: int, bs: int
              ) -> torch.Tensor:
    """Layer 0's output in float64 from the values both paths read: request b's keys are its
    blocks 1 + b * per_row ... laid end to end up to `position`, the step's own K/V (in the
    cache's dtype) last."""
    rows, heads, d = q.shape
    kvh = cache.shape[3]
    per_row = -(-(position + 1) // bs)
    out = torch.empty(rows, heads, d, dtype=torch.float64)
    for b in range(rows):
        tokens = cache[1 + b * per_row : 1 + (b + 1) * per_row].reshape(-1, 2, kvh, d)[: position + 1].double()
        tokens[position] = kv[b].to(cache.dtype).double()  # as the step stores it
        for h in range(heads):
            k = h // (heads // kvh)
            weights = torch.softmax(tokens[:, 0, k] @ q[b, h].double() * scale, dim=0)
            out[b, h] = weights @ tokens[:, 1, k]
    return out


if __name__ == "__main__":
    sys.exit(main())
