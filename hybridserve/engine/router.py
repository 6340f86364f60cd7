"""Which data-parallel replica serves a request.

Prefix-aware: the router keeps, per replica, a record of the prompt block hashes it has
sent there (the same chained SHA-256 hashes the prefix cache keys blocks by, so a hash
names its whole prefix), bounded LRU at the replica's pool size in blocks. A request goes
to the replica that was sent the longest run of its leading blocks, unless that replica's
batch is full (max_num_seqs unfinished requests) while another has room: a cache hit is
not worth a wait in the queue. Without a match it goes to the least loaded replica (fewest
unfinished engine requests; ties: fewest routed so far, then the lowest index).

The record is what the router sent, not what the replica still caches: a block evicted
there still counts here until the LRU drops it, so a stale match costs one prefill the
replica would have done anyway. A replica that restarts starts with an empty record.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol, Sequence

from hybridserve.core.errors import ConfigError
from hybridserve.core.kv.hashing import make_block_hasher
from hybridserve.core.request import Request

POLICIES = ("prefix", "round_robin")


class Routable(Protocol):
    index: int
    num_unfinished: int
    num_routed: int


class Router:
    def __init__(self, num_replicas: int, block_size: int, max_num_seqs: int, policy: str = "prefix") -> None:
        if policy not in POLICIES:
            raise ConfigError(f"routing must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        # Block hashes remembered per replica; set to the pool size once the replicas report it.
        self.record_blocks = 1
        self._hasher = make_block_hasher(block_size)
        self._records: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_replicas)]
        self._next = 0  # round robin's next replica

    def choose(self, prompt_token_ids: list[int], candidates: Sequence[Routable]) -> Routable:
        """The replica for this prompt among `candidates` (those serving; at least one)."""
        if len(self._records) == 1:
            return candidates[0]
        if self.policy == "round_robin":
            chosen = min(candidates, key=lambda r: (r.index - self._next) % len(self._records))
            self._next = chosen.index + 1
            return chosen
        hashes = self._hasher(Request("route", prompt_token_ids))
        least = min(candidates, key=lambda r: (r.num_unfinished, r.num_routed, r.index))
        best, matched = least, 0
        for r in candidates:
            n = self._matched(r.index, hashes)
            if n > matched or (n == matched and n and r.num_unfinished < best.num_unfinished):
                best, matched = r, n
        if best.num_unfinished >= self.max_num_seqs and least.num_unfinished < self.max_num_seqs:
            best = least
        self._remember(best.index, hashes)
        return best

    def forget(self, index: int) -> None:
        """The replica restarted: its cache is empty."""
        self._records[index].clear()

    def _matched(self, index: int, hashes: list[bytes]) -> int:
        record = self._records[index]
        n = 0
        for h in hashes:
            if h not in record:
                break
            n += 1
        return n

    def _remember(self, index: int, hashes: list[bytes]) -> None:
        record = self._records[index]
        # Last block first, so a prompt's leading blocks are the most recent: the LRU drops
        # the tails of prefixes first and a remembered run always starts at block 0.
        for h in reversed(hashes):
            record[h] = None
            record.move_to_end(h)
        while len(record) > self.record_blocks:
            record.popitem(last=False)
