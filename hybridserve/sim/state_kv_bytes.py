"""KV bytes one max_model_len request reserves, per token of it: this engine's sizing, the
mainstream engine's rule, and the need. Arithmetic over a model's layer specs only, so
every per-request state kind counts alike: a Mamba-2 (conv, SSM) state, a Mamba-1 one, a
Gated DeltaNet's (conv, recurrent) state or a short convolution's conv state are each a
`MambaSpec` of their own shapes.

Definitions, for one request of L = max_model_len tokens, B = in-flight tokens = steps in
flight k * batched tokens:

- need: each attention layer's own cap in its own pages (full attention: cdiv(L, bs)
  pages; a window or a chunk: what it keeps) + one state per state layer, unpadded.
- engine: what admission and startup sizing reserve here, prefix caching on (state
  checkpoints, running state in place): `bytes_per_block` * `blocks_per_request` of the
  groups `group_layers` and `with_mamba_checkpoints` build, sync (k = 1) or async (k >= 2).
- mainstream: the mainstream engine's rule for hybrids (its hybrid page alignment): the
  attention block grows to `align * cdiv(state, align * attention bytes a token)` tokens
  (align = the attention kernel's block alignment, 16), every state page is padded to
  that attention page, layers are grouped by the smallest count as here, and a state
  group holds 1 page a request without prefix caching ("none" mode) or 2 with it
  ("align" mode: the running state and the last checkpoint), each plus one per draft
  token with speculative decoding (not modelled here). Steps in flight do not change it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hybridserve.core.kv.spec import (AttentionSpec, KVCacheSpec, MambaSpec, WindowTail, blocks_per_request,
                                      bytes_per_block, cdiv, group_layers, with_mamba_checkpoints)

# The attention kernels' block-size multiple the mainstream rule aligns a grown block to.
MAINSTREAM_BLOCK_ALIGNMENT = 16


@dataclass(frozen=True)
class KVBytes:
    """Bytes one max_model_len request reserves (or needs); `block_size` is the attention
    block those blocks hold, in tokens."""

    total: int
    block_size: int

    def per_token(self, max_model_len: int) -> float:
        return self.total / max_model_len


def need_bytes(specs: dict[str, KVCacheSpec], max_model_len: int, in_flight_tokens: int) -> int:
    """Attention layers' own caps in their own pages + one unpadded state per state layer."""
    attention = sum(s.page_size_bytes * s.max_admission_blocks_per_request(in_flight_tokens, max_model_len)
                    for s in specs.values() if isinstance(s, AttentionSpec))
    return attention + sum(s.state_size_bytes for s in specs.values() if isinstance(s, MambaSpec))


def engine_bytes(specs: dict[str, KVCacheSpec], max_model_len: int, steps: int, batched_tokens: int) -> KVBytes:
    """This engine with prefix caching on and `steps` steps in flight (what
    config.resolve_engine_settings sizes the pool by)."""
    groups = with_mamba_checkpoints(group_layers(specs), WindowTail(steps))
    blocks = blocks_per_request(groups, steps * batched_tokens, max_model_len)
    return KVBytes(bytes_per_block(groups) * blocks, groups[0].spec.block_size)


def mainstream_bytes(specs: dict[str, KVCacheSpec], max_model_len: int, *, prefix_caching: bool) -> KVBytes:
    """The mainstream engine's hybrid rule (module docstring); a model without attention
    layers keeps the state as its page."""
    counts: dict[KVCacheSpec, int] = {}
    for s in specs.values():
        counts[s] = counts.get(s, 0) + 1
    group_size = min(counts.values())
    state_page = max((s.state_size_bytes for s in counts if isinstance(s, MambaSpec)), default=0)
    attention = [s for s in counts if isinstance(s, AttentionSpec)]
    block_size = attention[0].block_size if attention else 0
    page = state_page
    if attention:
        token_bytes = max(s.page_size_bytes // s.block_size for s in attention)
        align = MAINSTREAM_BLOCK_ALIGNMENT
        block_size = max(block_size, align * cdiv(state_page, align * token_bytes))
        page = block_size * token_bytes
    state_blocks = 2 if prefix_caching else 1
    blocks = 0
    for spec, n in counts.items():
        per_request = (state_blocks if isinstance(spec, MambaSpec) else
                       replace(spec, block_size=block_size).max_admission_blocks_per_request(0, max_model_len))
        blocks += cdiv(n, group_size) * per_request
    return KVBytes(group_size * page * blocks, block_size)
