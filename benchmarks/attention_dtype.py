"""Time of one layer's attention at Gemma 3 270M's shapes: bfloat16 SDPA against SDPA on float32 copies.

    python benchmarks/attention_dtype.py
    python benchmarks/attention_dtype.py --repeat 101 --threads 1

What executor/torch/attention.py chooses between for a bfloat16 KV cache on CPU: torch's
scaled_dot_product_attention on the bfloat16 tensors (its CPU flash-attention kernel), or on
float32 copies of them, the conversions (q, k, v, the additive mask, the output back to
bfloat16) inside the timed call. Shapes: 16 sequences, 4 query heads over 1 KV head, head
size 256; decode (1 query over 128 or 512 keys, the sliding window) and a 64-token prefill
chunk. The allocator is first brought to a serving process's state (see main). Prints the median of --repeat calls with the CPU flags, load, commit and threads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's hybridserve, whatever is installed

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import median_seconds, torch_header  # noqa: E402


SEQUENCES, HEADS, KV_HEADS, HEAD_DIM = 16, 4, 1, 256
CASES = [("decode, 128 keys", 1, 128), ("decode, 512 keys", 1, 512), ("prefill chunk 64, 64 keys", 64, 64)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=51)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = p.parse_args()
    print(torch_header(a.threads, ("avx512_bf16", "avx512_fp16", "amx")))
    # glibc serves blocks below its mmap threshold from the heap and keeps them there; the
    # threshold follows the largest block freed (up to 32 MB). A serving process has freed
    # such blocks in its first steps (logits, head chunks), so its per-call copies reuse
    # heap pages; a fresh process would map and fault in new pages at every call instead.
    warm = torch.ones(16 << 20, dtype=torch.uint8)  # touched, so really mapped
    del warm
    print("| case | bfloat16 SDPA us | float32 copies us |\n|---|---:|---:|")
    g = torch.Generator().manual_seed(0)
    scale = HEAD_DIM ** -0.5
    for name, queries, keys in CASES:
        q = torch.randn(SEQUENCES, HEADS, queries, HEAD_DIM, generator=g).bfloat16()
        k, v = (torch.randn(SEQUENCES, KV_HEADS, keys, HEAD_DIM, generator=g).bfloat16() for _ in range(2))
        mask = torch.zeros(SEQUENCES, 1, queries, keys, dtype=torch.bfloat16)
        mask[..., keys - 8:] = float("-inf")  # a few masked keys, as padding leaves them

        def half() -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

        def copies() -> torch.Tensor:
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask.float(), scale=scale,
                                                  enable_gqa=True).bfloat16()

        torch.testing.assert_close(half().float(), copies().float(), rtol=3e-2, atol=3e-2)
        times = [median_seconds(f, a.repeat, warmup=5) * 1e6 for f in (half, copies)]
        print(f"| {name} | {times[0]:.0f} | {times[1]:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
