"""The engine's int8-group linear (models/layers/int8_groups.py: the GGUF's blocks at their
own values, its C kernel) against the dense linear of the same weight (or the int8 mode's),
over one decode step's decoder matmuls.

    python benchmarks/group_linear.py                          # 1, 2, 4, 8, 16, 64 rows
    python benchmarks/group_linear.py --rows 1,16 --rounds 9 --isa avx2
    python benchmarks/group_linear.py --isa avx2 --dtype float32 --against int8 --paths vector,i16

Random weights in Gemma 3 270M's decoder shapes and the default GGUF's formats (qkv and
gate|up as Q5_0 groups of 32, o as Q4_K groups of 32 with offsets, down as Q6_K groups of
16), --layers copies of each, so a pass streams the weights from memory as a decode step
does. The baseline is models/layers/linear.make_linear on the weight in --dtype (`dense`:
oneDNN's packed GEMM), or make_int8_linear (`int8`: the int8 mode's linears, every weight
int8 per row); `groups` is make_group_linear. Inputs are in --dtype (bf16 by default;
float32 is what a CPU without native bf16 serves in). Per row count, alternating rounds of
one pass each, the median milliseconds a pass (all layers' four matmuls) and groups /
baseline. The weights' bytes are printed beside: what one row's time follows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's hybridserve, whatever is installed

from common import rerun_as_avx2, torch_header  # noqa: E402  (this folder is on sys.path)

# (name, out, in, group size, offsets): Gemma 3 270M's decoder, the default GGUF's formats
SHAPES = (("qkv", 1536, 640, 32, False), ("o", 640, 1024, 32, True), ("gate|up", 4096, 640, 32, False),
          ("down", 640, 2048, 16, False))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16,64")
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--isa", choices=("native", "avx2"), default="native")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--against", choices=("dense", "int8"), default="dense")
    parser.add_argument("--paths", default="", help="also time these kernel paths forced at every row count "
                        "(comma-separated: vector, exact, folded, dpbf16, i16; each where the CPU has it)")
    args = parser.parse_args()
    if args.isa == "avx2" and (code := rerun_as_avx2()) is not None:
        return code

    import torch

    from hybridserve.models.layers.int8_groups import GroupWeights, group_kernel, make_group_linear
    from hybridserve.models.layers.linear import make_int8_linear, make_linear

    print(torch_header(args.threads, ("avx", "amx", "fma")))
    print(f"# group kernel: {'native' if group_kernel() is not None else 'general path'}")
    dtype = getattr(torch, args.dtype)
    baseline = f"{'bf16' if dtype == torch.bfloat16 else 'float32'} dense" if args.against == "dense" else "int8"
    g = torch.Generator().manual_seed(0)
    kernel = group_kernel()
    paths = [p for p in args.paths.split(",") if p]
    base, groups, packed = [], [], []
    base_bytes = group_bytes = 0
    for _ in range(args.layers):
        for _, out, inp, size, offsets in SHAPES:
            w = GroupWeights(torch.randint(-16, 16, (out, inp), dtype=torch.int8, generator=g),
                             torch.rand(out, inp // size, generator=g) * 0.01,
                             torch.randn(out, inp // size, generator=g) * 0.01 if offsets else None, size)
            dense = w.weight().to(dtype)
            base.append(make_linear(dense, None)[0] if args.against == "dense"
                        else make_int8_linear(dense, None, dtype)[0])
            groups.append(make_group_linear(w, None)[0])
            if paths and kernel is not None:
                packed.append({p: kernel.pack(w, "pairs" if p == "i16" else "tiles") for p in paths})
            base_bytes += dense.numel() * dense.element_size()
            group_bytes += w.values.numel() + w.scale.numel() * 4 * (2 if offsets else 1)
    print(f"# weights: dense {args.dtype} {base_bytes / 1e6:.1f} MB, groups {group_bytes / 1e6:.1f} MB; "
          f"{args.layers} layers, {args.rounds} rounds; inputs {args.dtype}, baseline {baseline}")
    if paths and kernel is None:
        print("# --paths: no native kernel here, not timed")
        paths = []
    if kernel is not None:
        missing = {"exact": kernel.amx, "folded": kernel.amx, "dpbf16": kernel.dpbf16, "i16": kernel.i16, "vnni": kernel.vnni}
        if dropped := [p for p in paths if not missing.get(p, True)]:
            print(f"# --paths: this CPU has no {', '.join(dropped)}: not timed")
            paths = [p for p in paths if p not in dropped]
    names = ["base", "groups", *paths]
    print(f"| rows | {baseline} ms | groups ms | groups / {baseline} |" + "".join(f" {p} / {baseline} |" for p in paths))
    print("|---:|---:|---:|---:|" + "---:|" * len(paths))
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, 2048, generator=g).to(dtype)
        inputs = [x[:, :inp].contiguous() for _, _, inp, _, _ in SHAPES]
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.rounds + 1):  # the first round warms up, untimed
            for name in names:
                fns = {"base": base, "groups": groups}.get(name)
                t0 = time.perf_counter()
                for i in range(len(base)):
                    x_i = inputs[i % len(SHAPES)]
                    if fns is None:
                        kernel(x_i, packed[i][name], path=name)
                    else:
                        fns[i](x_i)
                times[name].append(time.perf_counter() - t0)
        ms = {name: statistics.median(times[name][1:]) * 1e3 for name in names}
        print(f"| {rows} | {ms['base']:.2f} | {ms['groups']:.2f} | {ms['groups'] / ms['base']:.2f} |"
              + "".join(f" {ms[p] / ms['base']:.2f} |" for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
