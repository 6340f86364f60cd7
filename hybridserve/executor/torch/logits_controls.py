"""Per-request logits controls: allowed tokens, bad words, logit bias, and the
repetition / frequency / presence penalties (SamplingParams documents each one).

They change the logits rows of the requests that ask for any (`has_logits_controls`), in
place, before temperature and the sampling filters; requests without them cost nothing.
A row sees the tokens before its own position: the prompt, the outputs so far and, in a
verify step, the drafts before it, so a verified draft is judged exactly as the same
token sampled one step at a time would be.

The whole batch is changed with one indexed read and write per control, in the order
above: the index lists are built first (numpy; the penalties' for every row at once),
then applied together to the entries they name, where the logits are held.
What changed is returned, so the span summaries can be brought up to date (sparse
changes span by span, allowed_token_ids' dense mask row by row).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from hybridserve.core.request import SamplingParams
from hybridserve.models.layers.span_logits import SpanLogits


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


def apply_logits_controls(sl: SpanLogits, requests: Sequence[tuple[int, SamplingParams, TokenHistory]]
                          ) -> tuple[ControlChanges, dict[int, str]]:
    """Apply each (row, params, history)'s controls to the logits of sl in place (its
    summaries are the caller's to refresh). A row whose controls name a token outside the
    vocabulary is left out and reported ({row: reason}). Every control but
    allowed_token_ids changes single (row, token) entries, read and written where the
    logits are (sl.at / sl.put): never a pass over whole rows."""
    vocab = sl.vocab_size
    allowed: list[tuple[int, list[int]]] = []
    bans, bias = _Edits(), _Edits()
    failed: dict[int, str] = {}
    for row, params, history in requests:
        try:
            _collect(row, params, history, vocab, allowed, bans, bias)
        except ValueError as exc:
            failed[row] = str(exc)
    repetition = _history_edits(requests, vocab, failed, outputs_only=False)
    output_counts = _history_edits(requests, vocab, failed, outputs_only=True)
    for row, ids in allowed:  # dense, and rare
        keep = torch.full((vocab,), float("-inf"))
        keep[ids] = 0.0
        sl.logits[row] += keep
    touched_rows, touched_ids = [], []
    if (t := bans.tensors()) is not None:
        sl.put(t[0], t[1], torch.full(t[0].shape, float("-inf")))
        touched_rows.append(t[0]), touched_ids.append(t[1])
    if (t := bias.tensors()) is not None:
        sl.put(t[0], t[1], sl.at(t[0], t[1]) + t[2])
        touched_rows.append(t[0]), touched_ids.append(t[1])
    if (t := repetition.tensors()) is not None:
        picked = sl.at(t[0], t[1])
        sl.put(t[0], t[1], torch.where(picked > 0, picked / t[2], picked * t[2]))
        touched_rows.append(t[0]), touched_ids.append(t[1])
    if (t := output_counts.tensors()) is not None:
        sl.put(t[0], t[1], sl.at(t[0], t[1]) - t[2])
        touched_rows.append(t[0]), touched_ids.append(t[1])
    empty = torch.empty(0, dtype=torch.long)
    changes = ControlChanges([r for r, _ in allowed], torch.cat(touched_rows) if touched_rows else empty,
                             torch.cat(touched_ids) if touched_ids else empty)
    return changes, failed


def _collect(row: int, params: SamplingParams, history: TokenHistory, vocab: int, allowed: list,
             bans: _Edits, bias: _Edits) -> None:
    """One row's index lists of the controls that name tokens themselves (raises
    ValueError naming a token id outside the vocabulary)."""
    if params.allowed_token_ids is not None:
        allowed.append((row, _in_vocab("allowed_token_ids", list(params.allowed_token_ids), vocab)))
    if params.bad_words_token_ids:
        banned = _bad_word_endings(params.bad_words_token_ids, history.tokens)
        if banned:
            bans.add(row, _in_vocab("bad_words", sorted(banned), vocab))
    if params.logit_bias:
        bias.add(row, _in_vocab("logit_bias", list(params.logit_bias), vocab),
                 np.array(list(params.logit_bias.values())))


def _history_edits(requests: Sequence[tuple[int, SamplingParams, TokenHistory]], vocab: int, failed: dict[int, str],
                   outputs_only: bool) -> _Edits:
    """The repetition penalty's edits (each distinct token of a row's history, valued the
    penalty) or, with outputs_only, the frequency / presence penalties' (each distinct
    output token, valued frequency * count + presence), for every row at once: one
    np.unique over (row, token) keys, not one per row. Rows naming a token outside the
    vocabulary are added to `failed` and left out."""
    if outputs_only:
        what = "the outputs"
        picked = [(row, p, h.tokens[h.num_prompt:]) for row, p, h in requests
                  if row not in failed and (p.frequency_penalty or p.presence_penalty) and len(h.tokens) > h.num_prompt]
    else:
        what = "the history"
        picked = [(row, p, h.tokens) for row, p, h in requests
                  if row not in failed and p.repetition_penalty != 1.0 and len(h.tokens)]
    edits = _Edits()
    if not picked:
        return edits
    tokens = [np.asarray(t, dtype=np.int64) for _, _, t in picked]
    row_of = np.repeat(np.array([row for row, _, _ in picked], dtype=np.int64), [len(t) for t in tokens])
    flat = np.concatenate(tokens)
    bad = (flat < 0) | (flat >= vocab)
    if bad.any():
        for row in np.unique(row_of[bad]).tolist():
            failed[row] = f"{what} names token {int(flat[bad & (row_of == row)].min())}, outside the vocabulary of {vocab}"
        ok = ~np.isin(row_of, np.array(list(failed), dtype=np.int64))
        row_of, flat = row_of[ok], flat[ok]
    keys, counts = np.unique(row_of * vocab + flat, return_counts=True)
    rows = keys // vocab
    per_row = np.zeros(max(row for row, _, _ in picked) + 1, dtype=np.float32)
    if outputs_only:
        presence = per_row.copy()
        for row, p, _ in picked:
            per_row[row], presence[row] = p.frequency_penalty, p.presence_penalty
        values = per_row[rows] * counts + presence[rows]
    else:
        for row, p, _ in picked:
            per_row[row] = p.repetition_penalty
        values = per_row[rows]
    edits.rows.append(rows)
    edits.ids.append(keys % vocab)
    edits.values.append(values.astype(np.float32))
    return edits


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
