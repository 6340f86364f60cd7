"""Per-request logits controls: allowed tokens, bad words, logit bias, and the
repetition / frequency / presence penalties (SamplingParams documents each one).

They change the logits rows of the requests that ask for any (`has_logits_controls`), in
place, before temperature and the sampling filters; requests without them cost nothing.
A row sees the tokens before its own position: the prompt, the outputs so far and, in a
verify step, the drafts before it, so a verified draft is judged exactly as the same
token sampled one step at a time would be.

The whole batch is changed with one indexed tensor operation per control, in the order
above: each row's index lists are built first (numpy, per row), then applied together.
What changed is returned, so the span summaries can be brought up to date (sparse
changes span by span, allowed_token_ids' dense mask row by row).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from hybridserve.core.request import SamplingParams


@dataclass
class TokenHistory:
    """The tokens before a row's position: tokens[:num_prompt] are the prompt."""

    tokens: Sequence[int]
    num_prompt: int


@dataclass
class _Edits:
    """Index lists of one control over the batch: (row, token) pairs and their values."""

    rows: list[np.ndarray] = field(default_factory=list)
    ids: list[np.ndarray] = field(default_factory=list)
    values: list[np.ndarray] = field(default_factory=list)

    def add(self, row: int, ids: np.ndarray, values: np.ndarray | float = 0.0) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        self.rows.append(np.full(ids.shape[0], row, dtype=np.int64))
        self.ids.append(ids)
        self.values.append(np.broadcast_to(np.asarray(values, dtype=np.float32), ids.shape))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        if not self.rows:
            return None
        rows, ids, values = (torch.from_numpy(np.concatenate(x)) for x in (self.rows, self.ids, self.values))
        return rows, ids, values


@dataclass
class ControlChanges:
    """What apply_logits_controls changed: whole rows, and single (row, token) entries."""

    dense_rows: list[int]
    rows: torch.Tensor
    ids: torch.Tensor


def apply_logits_controls(logits: torch.Tensor, requests: Sequence[tuple[int, SamplingParams, TokenHistory]]
                          ) -> tuple[ControlChanges, dict[int, str]]:
    """Apply each (row, params, history)'s controls to logits [S, V] in place. A row whose
    controls name a token outside the vocabulary is left out and reported ({row: reason})."""
    vocab = logits.shape[1]
    allowed: list[tuple[int, list[int]]] = []
    bans, bias, repetition, output_counts = _Edits(), _Edits(), _Edits(), _Edits()
    failed: dict[int, str] = {}
    for row, params, history in requests:
        try:
            _collect(row, params, history, vocab, allowed, bans, bias, repetition, output_counts)
        except ValueError as exc:
            failed[row] = str(exc)
    for row, ids in allowed:
        keep = torch.full((vocab,), float("-inf"), dtype=logits.dtype)
        keep[ids] = 0.0
        logits[row] += keep
    touched_rows, touched_ids = [], []
    if (t := bans.tensors()) is not None:
        logits[t[0], t[1]] = float("-inf")
        touched_rows.append(t[0]), touched_ids.append(t[1])
    if (t := bias.tensors()) is not None:
        logits.index_put_((t[0], t[1]), t[2].to(logits.dtype), accumulate=True)
        touched_rows.append(t[0]), touched_ids.append(t[1])
    if (t := repetition.tensors()) is not None:
        picked = logits[t[0], t[1]]
        penalty = t[2].to(logits.dtype)
        logits[t[0], t[1]] = torch.where(picked > 0, picked / penalty, picked * penalty)
        touched_rows.append(t[0]), touched_ids.append(t[1])
    if (t := output_counts.tensors()) is not None:
        logits.index_put_((t[0], t[1]), -t[2].to(logits.dtype), accumulate=True)
        touched_rows.append(t[0]), touched_ids.append(t[1])
    empty = torch.empty(0, dtype=torch.long)
    changes = ControlChanges([r for r, _ in allowed], torch.cat(touched_rows) if touched_rows else empty,
                             torch.cat(touched_ids) if touched_ids else empty)
    return changes, failed


def _collect(row: int, params: SamplingParams, history: TokenHistory, vocab: int, allowed: list,
             bans: _Edits, bias: _Edits, repetition: _Edits, output_counts: _Edits) -> None:
    """One row's index lists (raises ValueError naming a token id outside the vocabulary)."""
    if params.allowed_token_ids is not None:
        allowed.append((row, _in_vocab("allowed_token_ids", list(params.allowed_token_ids), vocab)))
    if params.bad_words_token_ids:
        banned = _bad_word_endings(params.bad_words_token_ids, history.tokens)
        if banned:
            bans.add(row, _in_vocab("bad_words", sorted(banned), vocab))
    if params.logit_bias:
        bias.add(row, _in_vocab("logit_bias", list(params.logit_bias), vocab),
                 np.array(list(params.logit_bias.values())))
    if params.repetition_penalty != 1.0 and len(history.tokens):
        repetition.add(row, _in_vocab("the history", np.unique(np.asarray(history.tokens, dtype=np.int64)), vocab),
                       params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and len(history.tokens) > history.num_prompt:
        ids, counts = np.unique(np.asarray(history.tokens[history.num_prompt:], dtype=np.int64), return_counts=True)
        output_counts.add(row, _in_vocab("the outputs", ids, vocab),
                          params.frequency_penalty * counts + params.presence_penalty)


def _in_vocab(what: str, ids, vocab: int):  # type: ignore[no-untyped-def]
    if len(ids) and (max(ids) >= vocab or min(ids) < 0):
        bad = next(int(t) for t in ids if not 0 <= t < vocab)
        raise ValueError(f"{what} names token {bad}, outside the vocabulary of {vocab}")
    return ids


def _bad_word_endings(bad_words: Sequence[Sequence[int]], tokens: Sequence[int]) -> set[int]:
    """The last token of every bad word whose earlier tokens end `tokens` (all of a
    one-token bad word: always banned)."""
    banned = set()
    n = len(tokens)
    for word in bad_words:
        head = len(word) - 1
        if head == 0 or (head <= n and all(tokens[n - head + k] == word[k] for k in range(head))):
            banned.add(word[-1])
    return banned
