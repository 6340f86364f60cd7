"""A drafter for speculative decoding that knows HF's greedy continuation, and corrupts some drafts."""

from __future__ import annotations


class OracleDrafter:
    """Proposes the true greedy continuation, with one draft corrupted on two proposals of three."""

    def __init__(self, sequences: list[list[int]]) -> None:
        self.sequences = sequences  # prompt + HF greedy output, per prompt
        self.calls = 0

    def propose(self, token_ids: list[int], num_drafts: int) -> list[int]:
        n = len(token_ids)
        full = next(f for f in self.sequences if f[:n] == token_ids)
        drafts = list(full[n : n + num_drafts])
        self.calls += 1
        if drafts and self.calls % 3:
            j = 0 if self.calls % 3 == 1 else (self.calls // 3) % len(drafts)
            drafts[j] = (drafts[j] + 1) % 512
        return drafts
