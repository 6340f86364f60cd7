"""Chained block hashes for prefix caching.

hash(block i) = H(hash(block i-1), tokens of block i, extra keys). The chain makes a
block's hash name its whole prefix, so equal hashes mean equal prefixes (up to
collisions of a 64-bit hash). The first block carries the cache salt, so requests with
different salts never share blocks.
"""

from __future__ import annotations

from typing import Any

from hybridserve.core.request import BlockHasher, Request

ROOT_HASH = 0x5EED_B10C_4A54


def hash_block_tokens(parent_hash: int, token_ids: tuple[int, ...], extra_keys: tuple[Any, ...] = ()) -> int:
    return hash((parent_hash, token_ids, extra_keys))


def make_block_hasher(block_size: int) -> BlockHasher:
    """A function that returns the hashes of a request's newly completed full blocks."""

    def new_block_hashes(request: Request) -> list[int]:
        start = len(request.block_hashes)
        end = request.num_tokens // block_size
        if end <= start:
            return []
        tokens = request.token_slice(start * block_size, end * block_size)
        parent = request.block_hashes[-1] if start else ROOT_HASH
        out = []
        for j, i in enumerate(range(start, end)):
            extra = (request.cache_salt,) if i == 0 and request.cache_salt else ()
            parent = hash_block_tokens(parent, tuple(tokens[j * block_size : (j + 1) * block_size]), extra)
            out.append(parent)
        return out

    return new_block_hashes
