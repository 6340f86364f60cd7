"""Two versions of the in-place decode attention kernel (executor/torch/paged_decode.c),
built from two source files and called alternately in one process on the same inputs: the
way to compare a kernel change on a host whose speed drifts by 10-25% within minutes.

    git show HEAD:hybridserve/executor/torch/paged_decode.c > /tmp/base.c
    python benchmarks/paged_decode_ab.py /tmp/base.c hybridserve/executor/torch/paged_decode.c
    python benchmarks/paged_decode_ab.py A.c B.c --cases 16x64,64x128 --between-mb 0

Gemma 3 270M's attention (4 query heads on 1 kv head of 256, bf16, blocks of 16); each
request's blocks are a random permutation of the pool's, the 18 layers' caches one pool on
transparent huge pages as the engine's is, and before each call --between-mb of other
memory is read (a step streams a layer's weights between two attention calls). The kernel
is called directly (no Python planning or KV write: the decode stack calls it from C).
Prints the median per-call microseconds of each, B / A, and the largest difference between
their outputs (0 where a change only moves memory traffic).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's hybridserve, whatever is installed

import torch  # noqa: E402

from common import torch_header  # noqa: E402
from hybridserve.executor.torch.paged_decode import PagedDecode  # noqa: E402
from hybridserve.models.platform.huge_pages import zeros_on_huge_pages  # noqa: E402
from hybridserve.models.platform.native_build import build  # noqa: E402


def kernel(name: str, source: Path) -> PagedDecode:
    """PagedDecode over the library built from `source` (not the checkout's file)."""
    k = PagedDecode.__new__(PagedDecode)
    fn = build(name, source).paged_decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, ptr, i64, ptr, ptr, i64, i64, ctypes.c_float,
                   ctypes.c_float, ptr, ptr, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32]
    fn.restype = None
    k._fn = fn
    return k


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path, help="source file A (the base)")
    p.add_argument("b", type=Path, help="source file B (the change)")
    p.add_argument("--cases", default="16x64,16x256,64x128,1x256", help="ROWSxKEYS, comma-separated")
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=3, help="passes over the layers per round and version")
    p.add_argument("--between-mb", type=float, default=10.0)
    a = p.parse_args()
    for f in (a.a, a.b):
        if not f.is_file():
            print(f"error: no such source file: {f}", file=sys.stderr)
            return 2
    print(torch_header(None, ("avx2", "avx512f", "avx512_bf16", "amx")))
    print(f"A {a.a}, B {a.b}; {a.layers} layers, {a.between_mb:g} MB read before each call, "
          f"{a.calls} passes x {a.rounds} rounds, alternating")
    versions = (kernel("paged_decode_ab_a", a.a.resolve()), kernel("paged_decode_ab_b", a.b.resolve()))
    between = torch.ones(int(a.between_mb * 2**20) // 4) if a.between_mb > 0 else None
    bs, d, scale = 16, 256, 256 ** -0.5
    g = torch.Generator().manual_seed(0)
    print("| rows | keys | A us | B us | B / A | max abs difference |")
    print("|---:|---:|---:|---:|---:|---:|")
    for case in a.cases.split(","):
        rows, keys = (int(x) for x in case.split("x"))
        per_row = -(-keys // bs)
        pool = zeros_on_huge_pages((a.layers, 1 + rows * per_row, bs, 2, 1, d), torch.bfloat16)
        for layer in range(a.layers):
            pool[layer] = torch.randn(pool.shape[1:], generator=g).to(torch.bfloat16)
        caches = list(pool.unbind(0))
        ids = (torch.randperm(rows * per_row, generator=g) + 1).reshape(rows, per_row).contiguous()
        q = torch.randn(rows, 4, d, generator=g).to(torch.bfloat16)
        first = torch.zeros(rows, dtype=torch.int64)
        count = torch.full((rows,), keys, dtype=torch.int64)
        outs = [k(q, caches[0], ids, first, count, scale, None, None).float() for k in versions]
        times: list[list[float]] = [[], []]
        for _ in range(a.rounds):
            for which, k in enumerate(versions):
                spent = 0.0
                for _ in range(a.calls):
                    for cache in caches:
                        if between is not None:
                            between.sum()
                        t = time.perf_counter()
                        k(q, cache, ids, first, count, scale, None, None)
                        spent += time.perf_counter() - t
                times[which].append(spent / (a.calls * a.layers) * 1e6)
        ta, tb = (statistics.median(t) for t in times)
        diff = (outs[0] - outs[1]).abs().max().item()
        print(f"| {rows} | {keys} | {ta:.0f} | {tb:.0f} | {tb / ta:.3f} | {diff:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
