"""Chained block hashes for prefix caching.

hash(block i) = SHA-256(hash(block i-1) || tokens of block i || extra keys). The chain
makes a block's hash name its whole prefix. A cryptographic hash, because a prefix-cache
hit hands one request another's KV: with a weak 64-bit hash a tenant could craft tokens
that collide with someone else's prefix. The first block carries the cache salt, so
requests with different salts never share blocks; salts are hashed as UTF-8 bytes, so
hashes agree across processes (a KV connector can match them).
"""

from __future__ import annotations

import hashlib
from array import array

from hybridserve.core.request import BlockHasher, Request

BlockHash = bytes
ROOT_HASH: BlockHash = hashlib.sha256(b"hybridserve-root").digest()


def hash_block_tokens(parent_hash: BlockHash, token_ids: list[int] | tuple[int, ...], salt: str | None = None) -> BlockHash:
    h = hashlib.sha256(parent_hash)
    h.update(array("q", token_ids).tobytes())
    if salt:
        h.update(b"\x00salt:" + salt.encode("utf-8"))
    return h.digest()


def make_block_hasher(block_size: int) -> BlockHasher:
    """A function that returns the hashes of a request's newly completed full blocks."""

    def new_block_hashes(request: Request) -> list[BlockHash]:
        start = len(request.block_hashes)
        end = request.num_tokens // block_size
        if end <= start:
            return []
        tokens = request.token_slice(start * block_size, end * block_size)
        parent = request.block_hashes[-1] if start else ROOT_HASH
        out = []
        for j, i in enumerate(range(start, end)):
            salt = request.cache_salt if i == 0 else None
            parent = hash_block_tokens(parent, tokens[j * block_size : (j + 1) * block_size], salt)
            out.append(parent)
        return out

    return new_block_hashes
