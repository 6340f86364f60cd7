"""Do the int8 layers' element-wise chains gain from torch.compile, one chain at a time?

    python benchmarks/int8_chains_compiled.py                  # Gemma 3 270M's sizes, 1 thread
    python benchmarks/int8_chains_compiled.py --threads 2 --rows 1,16,64

Each chain of models/arch/int8_chains.py (residual, qkv_out, quant, act_mul) is timed eager
and compiled (torch.compile, inductor's C++ backend, dynamic row counts) on random inputs
of Gemma 3 270M's sizes, in the same process, alternating; the minimum over --repeat calls
is printed (the minimum is what the code costs; on a shared machine the rest is waiting).
A bare compiled call (x * 2 + 1) beside an eager one gives the compiled call's fixed cost.
"""

from __future__ import annotations

import argparse
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's hybridserve, whatever is installed

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from hybridserve.models.arch.int8_chains import Int8Chains  # noqa: E402
from hybridserve.models.layers.int8 import PACKED  # noqa: E402

# Gemma 3 270M: 4 query heads, 1 KV head of 256, hidden 640, MLP 2048.
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, MLP = 4, 1, 256, 640, 2048


def fastest(fn, args: tuple, repeat: int) -> float:  # type: ignore[no-untyped-def]
    """The shortest of `repeat` calls, in microseconds."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def inputs(rows: int) -> dict[str, tuple]:
    """Each chain's arguments for `rows` rows (the qkv product is cloned per call: changed in place)."""
    g = torch.Generator().manual_seed(rows)
    norm = torch.rand(HIDDEN, generator=g) + 0.5
    qkv_width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    angles = torch.rand(rows, 1, HEAD_DIM, generator=g)
    return {
        "residual": (PACKED, torch.randn(rows, HIDDEN, generator=g), None, torch.randn(rows, HIDDEN, generator=g),
                     norm, norm),
        "qkv_out": (torch.randn(rows, qkv_width, generator=g), None, torch.rand(HEADS + KV_HEADS, HEAD_DIM, generator=g),
                    angles.cos(), angles.sin()),
        "quant": (PACKED, torch.randn(rows, HEADS * HEAD_DIM, generator=g).bfloat16()),
        "act_mul": (PACKED, torch.randn(rows, 2 * MLP, generator=g), None),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,16,64")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=300)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = types.SimpleNamespace(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, hidden_size=HIDDEN)
    chains = Int8Chains(cfg, torch.tensor(1e-6), lambda x: F.gelu(x, approximate="tanh"), torch.bfloat16)  # type: ignore[arg-type]

    def bare(x: torch.Tensor) -> torch.Tensor:
        return x * 2.0 + 1.0

    print(f"# torch {torch.__version__}; {args.threads} threads; fastest of {args.repeat} calls, us")
    print("\n| rows | chain | eager | compiled |\n|---:|---|---:|---:|")
    with torch.inference_mode():
        for rows in [int(r) for r in args.rows.split(",")]:
            cases = {"bare x * 2 + 1": (bare, (torch.randn(rows, HIDDEN),))}
            cases.update({name: (getattr(chains, name), a) for name, a in inputs(rows).items()})
            for name, (fn, a) in cases.items():
                compiled = torch.compile(fn, dynamic=True, fullgraph=True)
                clone_first = name == "qkv_out"  # its product is changed in place

                def run(f, a=a, clone_first=clone_first):  # type: ignore[no-untyped-def]
                    return f(a[0].clone(), *a[1:]) if clone_first else f(*a)

                eager_us = fastest(lambda: run(fn), (), args.repeat)
                try:
                    run(compiled)
                    run(compiled)  # compiled for this row class, then warm
                except Exception as exc:  # noqa: BLE001 - a chain dynamo cannot trace is a result too
                    print(f"| {rows} | {name} | {eager_us:.0f} | does not compile: {str(exc).splitlines()[0]} |")
                    continue
                compiled_us = fastest(lambda: run(compiled), (), args.repeat)
                print(f"| {rows} | {name} | {eager_us:.0f} | {compiled_us:.0f} |", flush=True)


if __name__ == "__main__":
    main()
