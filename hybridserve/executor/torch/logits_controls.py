"""Per-request logits controls: allowed tokens, bad words, logit bias, and the
repetition / frequency / presence penalties (SamplingParams documents each one).

They change the logits rows of the requests that ask for any (`has_logits_controls`), in
place, before temperature and the sampling filters; requests without them cost nothing.
A row sees the tokens before its own position: the prompt, the outputs so far and, in a
verify step, the drafts before it, so a verified draft is judged exactly as the same
token sampled one step at a time would be.

The whole batch is changed with few indexed reads and writes, in the order above: the
index lists are built first (numpy; the penalties' for every row at once); bad words are
written, then logit bias and the penalties share one read and one write of the entries any
of them names (each applied in turn to its own entries), where the logits are held.
What changed is returned, so the span summaries can be brought up to date (sparse
changes span by span, allowed_token_ids' dense mask row by row).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
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


Arrays = tuple[np.ndarray, np.ndarray, np.ndarray]  # rows, token ids, values: one entry each


@dataclass
class _Edits:
    """Index lists of one control over the batch: (row, token) pairs and their values, kept
    as Python lists while rows add theirs (a few each) and made arrays once."""

    rows: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    def add(self, row: int, ids: Sequence[int], values: Sequence[float] | float = 0.0) -> None:
        self.rows.extend([row] * len(ids))
        self.ids.extend(ids)
        self.values.extend([values] * len(ids) if isinstance(values, (int, float)) else values)

    def arrays(self) -> Arrays | None:
        if not self.rows:
            return None
        return (np.array(self.rows, dtype=np.int64), np.array(self.ids, dtype=np.int64),
                np.array(self.values, dtype=np.float32))


@dataclass
class _Merged:
    """The (row, token) entries any of several controls names, once each, and per control
    (None: it names none; True: it names them all; else a bool mask of those it names) its
    value at each entry (its neutral value where it names none: what is computed there is
    never kept, the mask keeps the entry as it was)."""

    rows: torch.Tensor
    ids: torch.Tensor
    controls: list[tuple[torch.Tensor | bool | None, torch.Tensor]]

    @staticmethod
    def of(vocab: int, *edits: tuple[Arrays | None, float]) -> _Merged | None:
        """From each control's arrays (None: it names nothing) and its neutral value."""
        keyed = [(a[0] * vocab + a[1], a[2], neutral) if a is not None else None for a, neutral in edits]
        present = [k for k in keyed if k is not None]
        if not present:
            return None
        keys, inverse = np.unique(np.concatenate([k for k, _, _ in present]), return_inverse=True)
        controls: list[tuple[torch.Tensor | bool | None, torch.Tensor]] = []
        start = 0
        for entry in keyed:
            if entry is None:
                controls.append((None, torch.empty(0)))
                continue
            at = inverse[start : start + len(entry[0])]
            start += len(entry[0])
            values = np.full(len(keys), entry[2], dtype=np.float32)
            values[at] = entry[1]
            if len(at) == len(keys):
                controls.append((True, torch.from_numpy(values)))
            else:
                named = np.zeros(len(keys), dtype=bool)
                named[at] = True
                controls.append((torch.from_numpy(named), torch.from_numpy(values)))
        return _Merged(torch.from_numpy(keys // vocab), torch.from_numpy(keys % vocab), controls)


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
    if (banned := bans.arrays()) is not None:
        rows, ids = torch.from_numpy(banned[0]), torch.from_numpy(banned[1])
        sl.put(rows, ids, torch.full(rows.shape, float("-inf")))
        touched_rows.append(rows), touched_ids.append(ids)
    if (merged := _Merged.of(vocab, (bias.arrays(), 0.0), (repetition, 1.0), (output_counts, 0.0))) is not None:
        # One read and one write of every entry the three name, each control applied in
        # turn to the entries it names, as three reads and writes would in this order.
        x = sl.at(merged.rows, merged.ids)
        for control, (named, values) in zip(("bias", "repetition", "counts"), merged.controls):
            if named is None:
                continue
            if control == "bias":
                changed = x + values
            elif control == "repetition":
                changed = torch.where(x > 0, x / values, x * values)
            else:
                changed = x - values
            x = changed if named is True else torch.where(named, changed, x)
        sl.put(merged.rows, merged.ids, x)
        touched_rows.append(merged.rows), touched_ids.append(merged.ids)
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
        bias.add(row, _in_vocab("logit_bias", list(params.logit_bias), vocab), list(params.logit_bias.values()))


def _history_edits(requests: Sequence[tuple[int, SamplingParams, TokenHistory]], vocab: int, failed: dict[int, str],
                   outputs_only: bool) -> Arrays | None:
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
    if not picked:
        return None
    lengths = [len(t) for _, _, t in picked]
    flat = np.fromiter(chain.from_iterable(t for _, _, t in picked), dtype=np.int64, count=sum(lengths))
    row_of = np.repeat(np.array([row for row, _, _ in picked], dtype=np.int64), lengths)
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
    return rows, keys % vocab, values.astype(np.float32)


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
