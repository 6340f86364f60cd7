"""KV bytes per token of a max-length request for Mamba hybrids: this engine before and
after paged states + sparse checkpoints, the mainstream engine's published rule, and the
sum of what each group truly needs. Arithmetic only (no timing), prefix caching on.

    python benchmarks/mamba_kv_bytes.py [--max-model-len 8192 32768] [--batched-tokens 8192]

Definitions (per max_model_len request L, B = in-flight tokens = steps in flight k *
--batched-tokens, bs = 16, bf16):

- need: attention K/V of L tokens + one state per Mamba layer (the running state).
- before: one pool, every block costs max(layers per group) * the largest page (the
  Mamba state); a Mamba group holds a checkpoint block per boundary in flight,
  min(touch(B) + 1, cdiv(L, bs)) blocks.
- after: this engine's sizing, `blocks_per_request` of the groups `group_layers` and
  `with_mamba_checkpoints` build: paged states kept in place, a cap of 1 block per page
  group (checkpoints, and with a KV connector the last whole one, are best-effort blocks
  outside the cap), the same with or without a connector and for any steps in flight.
- mainstream (vLLM's HybridAttentionMambaModelConfig with prefix caching, "align" mode):
  attention block size = chunk * cdiv(state page, chunk * attention bytes per token)
  (chunk = the Mamba-2 SSD chunk, 256; Mamba-1 Jamba has no SSD chunk: 16), Mamba pages
  padded to the attention page, layers grouped as here, (2 + drafts) state pages per
  Mamba group per request.
"""

from __future__ import annotations

import argparse

from hybridserve.core.kv.spec import (
    AttentionSpec,
    MambaSpec,
    WindowTail,
    blocks_per_request,
    blocks_touched,
    bytes_per_block,
    cdiv,
    group_layers,
    with_mamba_checkpoints,
)
from hybridserve.sim.presets import get_gpu, get_layout

BS = 16
SSD_CHUNK = {"bamba-9b-like": 256, "jamba-like": 16}


def need_bytes(specs: dict, length: int) -> int:
    attn = sum(s.page_size_bytes for s in specs.values() if isinstance(s, AttentionSpec)) * cdiv(length, BS)
    return attn + sum(s.state_size_bytes for s in specs.values() if isinstance(s, MambaSpec))


def before_bytes(specs: dict, length: int, in_flight_tokens: int) -> int:
    counts: dict = {}
    for s in specs.values():
        counts[s] = counts.get(s, 0) + 1
    size = min(counts.values())
    per_block = size * max(s.page_size_bytes for s in counts)
    blocks = 0
    for s, n in counts.items():
        groups = cdiv(n, size)
        per = cdiv(length, BS) if isinstance(s, AttentionSpec) else min(blocks_touched(in_flight_tokens, BS) + 1,
                                                                          cdiv(length, BS))
        blocks += groups * per
    return per_block * blocks


def after_bytes(specs: dict, length: int, in_flight_tokens: int, steps: int) -> int:
    groups = with_mamba_checkpoints(group_layers(specs), WindowTail(steps, 0))
    return bytes_per_block(groups) * blocks_per_request(groups, in_flight_tokens, length)


def mainstream_bytes(name: str, specs: dict, length: int) -> tuple[int, int]:
    counts: dict = {}
    for s in specs.values():
        counts[s] = counts.get(s, 0) + 1
    attn = next(s for s in counts if isinstance(s, AttentionSpec))
    mamba = next(s for s in counts if isinstance(s, MambaSpec))
    per_token = attn.page_size_bytes // BS
    chunk = SSD_CHUNK[name]
    attn_block = chunk * cdiv(mamba.state_size_bytes, chunk * per_token)
    page = attn_block * per_token
    size = min(counts.values())
    blocks = cdiv(counts[attn], size) * cdiv(length, attn_block) + cdiv(counts[mamba], size) * 2
    return size * page * blocks, attn_block


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-model-len", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--batched-tokens", type=int, default=8192)
    p.add_argument("--gpu", default="H200")
    a = p.parse_args()
    gpu = get_gpu(a.gpu)
    print("| layout | L | mode | need B/tok | before B/tok (x) | mainstream B/tok (x) | after B/tok (x) | "
          "fit before / mainstream / after |")
    print("|---|---|---|---|---|---|---|---|")
    for name in ("bamba-9b-like", "jamba-like"):
        layout = get_layout(name)
        specs = layout.layer_specs(BS, "bfloat16")
        pool = gpu.memory_bytes * 0.9 - layout.weight_bytes
        for length in a.max_model_len:
            for mode, steps in (("sync", 1), ("async", 2)):
                tokens = steps * a.batched_tokens
                need = need_bytes(specs, length)
                before = before_bytes(specs, length, tokens)
                main_b, main_bs = mainstream_bytes(name, specs, length)
                after = after_bytes(specs, length, tokens, steps)

                def cell(b: int) -> str:
                    return f"{b / length:,.0f} ({b / need:.2f})"

                fit = " / ".join(f"{int(pool // b):,}" for b in (before, main_b, after))
                print(f"| {name} | {length:,} | {mode} | {need / length:,.0f} | {cell(before)} | {cell(main_b)} "
                      f"[bs {main_bs}] | {cell(after)} | {fit} |")


if __name__ == "__main__":
    main()
