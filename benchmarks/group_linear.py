"""The engine's int8-group linear (models/layers/int8_groups.py: the GGUF's blocks at their
own values, its C kernel) against the bf16 linear the decoder takes today, over one
decode step's decoder matmuls.

    python benchmarks/group_linear.py                          # 1, 2, 4, 8, 16, 64 rows
    python benchmarks/group_linear.py --rows 1,16 --rounds 9 --isa avx2

Random weights in Gemma 3 270M's decoder shapes and the default GGUF's formats (qkv and
gate|up as Q5_0 groups of 32, o as Q4_K groups of 32 with offsets, down as Q6_K groups of
16), --layers copies of each, so a pass streams the weights from memory as a decode step
does. `bf16` is models/layers/linear.make_linear on the bf16 weight (oneDNN's packed GEMM);
`groups` is make_group_linear. Per row count, alternating rounds of one pass each, the
median milliseconds a pass (all layers' four matmuls) and groups / bf16. The weights'
bytes are printed beside: what one row's time follows.
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
    parser.add_argument("--paths", default="", help="also time these kernel paths forced at every row count "
                        "(comma-separated: vector, exact, folded; the AMX ones need AMX)")
    args = parser.parse_args()
    if args.isa == "avx2" and (code := rerun_as_avx2()) is not None:
        return code

    import torch

    from hybridserve.models.layers.int8_groups import GroupWeights, group_kernel, make_group_linear
    from hybridserve.models.layers.linear import make_linear

    print(torch_header(args.threads, ("avx", "amx", "fma")))
    print(f"# group kernel: {'native' if group_kernel() is not None else 'general path'}")
    g = torch.Generator().manual_seed(0)
    kernel = group_kernel()
    paths = [p for p in args.paths.split(",") if p]
    bf16, groups, packed = [], [], []
    bf16_bytes = group_bytes = 0
    for _ in range(args.layers):
        for _, out, inp, size, offsets in SHAPES:
            w = GroupWeights(torch.randint(-16, 16, (out, inp), dtype=torch.int8, generator=g),
                             torch.rand(out, inp // size, generator=g) * 0.01,
                             torch.randn(out, inp // size, generator=g) * 0.01 if offsets else None, size)
            dense = w.weight().bfloat16()
            bf16.append(make_linear(dense, None)[0])
            groups.append(make_group_linear(w, None)[0])
            if paths and kernel is not None:
                packed.append(kernel.pack(w))
            bf16_bytes += dense.numel() * 2
            group_bytes += w.values.numel() + w.scale.numel() * 4 * (2 if offsets else 1)
    print(f"# weights: bf16 {bf16_bytes / 1e6:.1f} MB, groups {group_bytes / 1e6:.1f} MB; "
          f"{args.layers} layers, {args.rounds} rounds")
    if paths and kernel is None:
        print("# --paths: no native kernel here, not timed")
        paths = []
    if kernel is not None and not kernel.amx and {"exact", "folded"} & set(paths):
        print("# --paths: no AMX here, exact and folded not timed")
        paths = [p for p in paths if p not in ("exact", "folded")]
    names = ["bf16", "groups", *paths]
    print("| rows | bf16 ms | groups ms | groups / bf16 |" + "".join(f" {p} / bf16 |" for p in paths))
    print("|---:|---:|---:|---:|" + "---:|" * len(paths))
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, 2048, generator=g).bfloat16()
        inputs = [x[:, :inp].contiguous() for _, _, inp, _, _ in SHAPES]
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.rounds + 1):  # the first round warms up, untimed
            for name in names:
                fns = {"bf16": bf16, "groups": groups}.get(name)
                t0 = time.perf_counter()
                for i in range(len(bf16)):
                    x_i = inputs[i % len(SHAPES)]
                    if fns is None:
                        kernel(x_i, packed[i], path=name)
                    else:
                        fns[i](x_i)
                times[name].append(time.perf_counter() - t0)
        ms = {name: statistics.median(times[name][1:]) * 1e3 for name in names}
        print(f"| {rows} | {ms['bf16']:.2f} | {ms['groups']:.2f} | {ms['groups'] / ms['bf16']:.2f} |"
              + "".join(f" {ms[p] / ms['bf16']:.2f} |" for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
