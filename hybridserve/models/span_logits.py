"""Vocabulary logits with per-span summaries, what sampling reads instead of whole rows.

A row's vocabulary is cut into spans of SPAN consecutive token ids. For each span the
pass that writes the logits also keeps its maximum and its mass at the row's temperature,
sum over the span of exp((logit - span max) / T). From those a sampler finds the row's
maximum, its total mass and which span a draw lands in by reading 1/SPAN of the row, and
reads the logits themselves only inside the spans it needs (see
executor/torch/span_sampler.py).

The logits live in one float32 buffer per process, reused from step to step: allocating
a fresh [rows, vocab] tensor each step costs a page fault per 4 KiB, more than the
sampling itself at 64 rows. Rows are padded to a whole number of spans with -inf, which
no sampler ever picks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Token ids per span: the same span as the greedy head's argmax (models/head.ARGMAX_SPAN).
SPAN = 128


def padded_width(vocab_size: int, span: int = SPAN) -> int:
    return -(-vocab_size // span) * span


@dataclass
class SpanLogits:
    """Invariants: padded[:, :vocab_size] are the logits, padded[:, vocab_size:] are -inf;
    span_max[r, j] = max(padded[r, j*span:(j+1)*span]); span_sum[r, j] =
    sum(exp((padded[r, j*span:(j+1)*span] - span_max[r, j]) * inv_temperature[r])), 0 for a
    span whose logits are all -inf. Whoever changes logits restores the summaries
    (refresh_rows / refresh_spans)."""

    padded: torch.Tensor  # [S, W] float32, W a multiple of span
    vocab_size: int
    inv_temperature: torch.Tensor  # [S] float32
    span_max: torch.Tensor  # [S, W / span]
    span_sum: torch.Tensor  # [S, W / span]
    span: int = SPAN

    @property
    def logits(self) -> torch.Tensor:
        return self.padded[:, : self.vocab_size]

    def take_spans(self, rows: torch.Tensor, js: torch.Tensor) -> torch.Tensor:
        """[*rows.shape, span]: span js[i] of row rows[i] (shapes broadcast), copied with one
        index_select of whole spans (cheaper than advanced indexing of the 3-D view)."""
        rows, js = torch.broadcast_tensors(rows, js)
        num_spans = self.span_max.shape[1]
        flat = self.padded.view(-1, self.span).index_select(0, (rows * num_spans + js).reshape(-1))
        return flat.view(*rows.shape, self.span)

    @property
    def num_rows(self) -> int:
        return self.padded.shape[0]

    def refresh_rows(self, rows: torch.Tensor) -> None:
        """Recompute the summaries of whole rows (after a dense change such as a grammar mask)."""
        if rows.numel():
            m, s = span_stats(self.padded[rows], self.inv_temperature[rows], self.span)
            self.span_max[rows] = m
            self.span_sum[rows] = s

    def refresh_spans(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Recompute the summaries of the spans holding (rows[i], token_ids[i]) (after sparse
        changes: bans, biases, penalties)."""
        if not rows.numel():
            return
        keys = torch.unique(rows * self.span_max.shape[1] + token_ids // self.span)
        r, j = keys // self.span_max.shape[1], keys % self.span_max.shape[1]
        m, s = span_stats(self.take_spans(r, j), self.inv_temperature[r], self.span)
        self.span_max[r, j] = m[:, 0]
        self.span_sum[r, j] = s[:, 0]


def span_stats(x: torch.Tensor, inv_temperature: torch.Tensor, span: int = SPAN
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(span max, span mass) of x [S, n * span] float32 at each row's 1 / T; a span of -inf
    has mass 0 (not the NaN that -inf - -inf would give)."""
    rows = x.shape[0]
    spans = x.view(rows, -1, span)
    peak = spans.amax(dim=-1)
    scaled = torch.sub(spans, peak[..., None])
    if not bool((inv_temperature == 1.0).all()):  # temperature 1, the served default, needs no scaling
        scaled.mul_(inv_temperature.view(rows, 1, 1))
    mass = scaled.exp_().sum(dim=-1)
    return peak, mass.masked_fill_(peak == float("-inf"), 0.0)


class LogitsBuffer:
    """The process's reusable float32 [rows, padded vocab] buffer, grown to the largest
    batch seen; its padding columns are -inf from the start and never written."""

    def __init__(self, vocab_size: int, span: int = SPAN) -> None:
        self.vocab_size = vocab_size
        self.span = span
        self.width = padded_width(vocab_size, span)
        self._buf = torch.empty(0, self.width)

    def rows(self, n: int) -> torch.Tensor:
        if self._buf.shape[0] < n:
            self._buf = torch.empty(n, self.width)
            self._buf[:, self.vocab_size:] = float("-inf")
        return self._buf[:n]


def span_logits_from(logits: torch.Tensor, inv_temperature: torch.Tensor, buffer: LogitsBuffer | None = None
                     ) -> SpanLogits:
    """The general way to SpanLogits: copy finished logits [S, V] into a buffer and summarise
    them (models without a chunked head; tests). A chunked head fills the buffer and the
    summaries chunk by chunk instead (models/head.OutputHead.span_logits)."""
    rows, vocab = logits.shape
    buffer = buffer if buffer is not None and buffer.vocab_size == vocab else LogitsBuffer(vocab)
    padded = buffer.rows(rows)
    padded[:, :vocab].copy_(logits)
    inv_t = inv_temperature.to(torch.float32)
    peak, mass = span_stats(padded, inv_t, buffer.span)
    return SpanLogits(padded, vocab, inv_t, peak, mass, buffer.span)
