"""Vocabulary logits with per-span summaries, what sampling reads instead of whole rows.

A row's vocabulary is cut into spans of SPAN consecutive token ids. For each span the
pass that computes the logits also keeps its maximum and its mass at the row's
temperature, sum over the span of exp((logit - span max) / T). From those a sampler finds
the row's maximum, its total mass and which span a draw lands in by reading 1/SPAN of the
row, and reads the logits themselves only inside the spans it needs (see
executor/torch/span_sampler.py).

The logits are held one of three ways. Dense: one float32 [rows, padded vocab] buffer per
process, reused from step to step (a fresh tensor of that size each step costs a page
fault per 4 KiB). In pieces: the output head's chunk outputs as its kernels returned
them, so a step that only draws never copies the whole vocabulary; spans are read from
the pieces, and the first dense need (a logits change, logprobs, a rare whole-row search)
copies the pieces into the buffer once. Not held at all: a LogitsSource computes them
again, a span at a time for native code that reads a span or two of each row, or all
of them into the buffer at the first other need. Padding past the vocabulary is -inf,
which no sampler ever picks.
"""

from __future__ import annotations

import ctypes
from typing import Callable, Protocol

import torch

# Token ids per span: the same span as the greedy head's argmax (models/layers/head.ARGMAX_SPAN).
SPAN = 128
# The smallest exponent a span mass's terms are taken at: exp(-87) is still a normal
# float32, while the exponent of a weight far below its span's maximum (a cold temperature,
# a large negative bias) would give a subnormal result, which x86 CPUs compute in a slow
# microcode assist (three times the summaries' time when most terms underflow). A term
# raised to exp(-87) ~ 1.6e-38 changes no mass: every mass is at least 1 (its maximum's
# term) and a span's 128 terms at the floor add under 2.1e-36, far below a float32 ulp of 1.
EXP_FLOOR = -87.0


# (logits [n, k * SPAN], inv_temperature [n]) -> (span max, span mass) [n, k], as span_stats.
Summarise = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class LogitsSource(Protocol):
    """Where logits that were summarised but not stored come from, exactly as they would
    have been stored."""

    def materialize(self, padded: torch.Tensor) -> None:
        """Write every logit into padded [S, W] (float32; its padding columns are left as
        they are, -inf)."""

    def native(self) -> tuple[int, int]:
        """(address of a C function void fill(const void *context, int64_t row, int64_t span,
        float *out) writing span `span` of a row's logits to out[0 .. SPAN - 1], its
        context's address); both valid while this object lives."""


class SpanFill:
    """A kernel library's span fill (LogitsSource.native's C function, `name` in `library`),
    bound once: `address` for native samplers, `span` for a read from Python's thread."""

    def __init__(self, library: ctypes.CDLL, name: str) -> None:
        fn = getattr(library, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        fn.restype = None
        self._fn = fn
        self.address: int = ctypes.cast(fn, ctypes.c_void_p).value or 0

    def span(self, context: int, rows: int, spans: int, row: int, j: int) -> torch.Tensor:
        """Span j of row `row` of the source at `context` (rows x spans), float32 [SPAN]."""
        if not (0 <= row < rows and 0 <= j < spans):
            raise IndexError(f"span {j} of row {row}: the source has {rows} rows of {spans} spans")
        out = torch.empty(SPAN, dtype=torch.float32)
        self._fn(context, row, j, out.data_ptr())
        return out


def padded_width(vocab_size: int, span: int = SPAN) -> int:
    return -(-vocab_size // span) * span


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


class SpanLogits:
    """Invariants: `padded` [S, W] (W a multiple of span) holds the logits in [:, :vocab_size]
    and -inf after; span_max[r, j] = max(padded[r, j*span:(j+1)*span]); span_sum[r, j] =
    sum(exp(max((padded[r, j*span:(j+1)*span] - span_max[r, j]) * inv_temperature[r],
    EXP_FLOOR))), 0 for a span whose logits are all -inf. Whoever changes logits (through `padded` or
    `logits`, which make them dense first) restores the summaries (refresh_rows /
    refresh_spans). Held in pieces, each piece is [S, w] with w a multiple of span, and
    the pieces side by side are `padded`. Given by a `source`, the logits are not held: the
    first use of them other than a native kernel's (`source`) makes them dense."""

    def __init__(self, *, vocab_size: int, inv_temperature: torch.Tensor, span_max: torch.Tensor,
                 span_sum: torch.Tensor, buffer: LogitsBuffer, padded: torch.Tensor | None = None,
                 pieces: list[torch.Tensor] | None = None, source: LogitsSource | None = None) -> None:
        if sum(held is not None for held in (padded, pieces, source)) != 1:
            raise ValueError("SpanLogits holds its logits dense (padded), in pieces, or not (a source)")
        self.vocab_size = vocab_size
        self.inv_temperature = inv_temperature  # [S] float32
        self.span_max = span_max  # [S, W / span]
        self.span_sum = span_sum  # [S, W / span]
        self.span = buffer.span
        self._buffer = buffer
        self._padded = padded
        self._pieces = pieces
        self._source = source
        if pieces is not None:
            self._piece_spans = torch.tensor([p.shape[1] // self.span for p in pieces])
            self._piece_start = torch.cat([torch.zeros(1, dtype=torch.long), self._piece_spans.cumsum(0)])

    @property
    def num_rows(self) -> int:
        return self.span_max.shape[0]

    @property
    def is_dense(self) -> bool:
        return self._padded is not None

    @property
    def source(self) -> LogitsSource | None:
        """The source of logits not held (None once they are)."""
        return self._source

    def _hold(self) -> None:
        """Logits not held are computed into the buffer: from here on they are dense."""
        if self._source is not None:
            padded = self._buffer.rows(self.num_rows)
            self._source.materialize(padded)
            self._padded, self._source = padded, None

    @property
    def padded(self) -> torch.Tensor:
        """The logits as one dense [S, W] tensor (copied out of the pieces, or computed from
        the source, on first use)."""
        self._hold()
        if self._padded is None:
            assert self._pieces is not None
            padded = self._buffer.rows(self.num_rows)
            start = 0
            for piece in self._pieces:
                padded[:, start : start + piece.shape[1]].copy_(piece)
                start += piece.shape[1]
            self._padded, self._pieces = padded, None
        return self._padded

    @property
    def logits(self) -> torch.Tensor:
        return self.padded[:, : self.vocab_size]

    def pieces(self) -> list[torch.Tensor]:
        """The logits as they are held, without copying: [padded] when dense, else the
        pieces side by side (each [S, w], w a multiple of span, in the head's dtype)."""
        self._hold()
        if self._padded is not None:
            return [self._padded]
        assert self._pieces is not None
        return list(self._pieces)

    def whole_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """A copy of rows [n] of `padded` ([n, W]), without making the rest dense."""
        self._hold()
        if self._padded is not None:
            return self._padded[rows]
        assert self._pieces is not None
        return torch.cat([p[rows].float() for p in self._pieces], dim=1)

    def take_spans(self, rows: torch.Tensor, js: torch.Tensor) -> torch.Tensor:
        """[*rows.shape, span]: span js[i] of row rows[i] (shapes broadcast), copied with
        index_select of whole spans (cheaper than advanced indexing of a 3-D view)."""
        rows, js = torch.broadcast_tensors(rows, js)
        shape = (*rows.shape, self.span)
        blocks = self.span_blocks(rows.reshape(-1), js.reshape(-1))
        if len(blocks) == 1 and blocks[0][0] is None:
            return blocks[0][1].view(shape)
        out = torch.empty(rows.numel(), self.span)
        for at, values in blocks:
            out[at] = values.float()
        return out.view(shape)

    def span_blocks(self, rows: torch.Tensor, js: torch.Tensor) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
        """Spans js[i] of rows rows[i] ([n] each) as copies [m, span], one block per piece
        holding any (one block when dense), each with the positions i it holds (None:
        all, in order): what take_spans returns before putting them back in order, for
        callers that reduce each span and need no order."""
        self._hold()
        if self._padded is not None:
            keys = rows * self.span_max.shape[1] + js
            return [(None, self._padded.view(-1, self.span).index_select(0, keys))]
        assert self._pieces is not None
        if not len(rows):
            return [(None, torch.empty(0, self.span))]
        which = torch.bucketize(js, self._piece_start[1:], right=True)  # the piece holding each span
        order = torch.argsort(which, stable=True)
        counts = torch.bincount(which, minlength=len(self._pieces)).tolist()
        blocks = []
        for k, at in enumerate(order.split(counts)):
            if at.numel():
                keys = rows[at] * int(self._piece_spans[k]) + js[at] - int(self._piece_start[k])
                blocks.append((at, self._pieces[k].reshape(-1, self.span).index_select(0, keys)))
        return blocks

    def at(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The logits at (rows[i], ids[i]), [n] float32, read in place (dense or in pieces)."""
        self._hold()
        if self._padded is not None:
            return self._padded[rows, ids]
        assert self._pieces is not None
        out = torch.empty(len(rows))
        for k, at, cols in self._by_piece(ids):
            out[at] = self._pieces[k][rows[at], cols].float()
        return out

    def put(self, rows: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Set the logits at (rows[i], ids[i]) (each pair at most once) to values [n],
        without making pieces dense: the summaries are the caller's to refresh. A piece
        in a narrower dtype than float32 is widened first, so that a value is stored as a
        dense float32 buffer would store it."""
        self._hold()
        if self._padded is not None:
            self._padded[rows, ids] = values
            return
        assert self._pieces is not None
        for k, at, cols in self._by_piece(ids):
            if self._pieces[k].dtype != torch.float32:
                self._pieces[k] = self._pieces[k].float()
            self._pieces[k][rows[at], cols] = values[at]

    def _by_piece(self, ids: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Per piece holding any of ids: (its index in the pieces, the positions i of the
        ids it holds, their columns in it)."""
        assert self._pieces is not None
        which = torch.bucketize(ids // self.span, self._piece_start[1:], right=True)
        order = torch.argsort(which, stable=True)
        counts = torch.bincount(which, minlength=len(self._pieces)).tolist()
        out = []
        for k, at in enumerate(order.split(counts)):
            if at.numel():
                out.append((k, at, ids[at] - int(self._piece_start[k]) * self.span))
        return out

    def _summarise(self, summarise: Summarise | None, x: torch.Tensor, inv_temperature: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """summarise(x, inv_temperature) (a kernel for spans of SPAN), or span_stats at this
        object's span where none is given."""
        if summarise is None or self.span != SPAN:
            return span_stats(x, inv_temperature, self.span)
        return summarise(x, inv_temperature)

    def refresh_rows(self, rows: torch.Tensor, summarise: Summarise | None = None) -> None:
        """Recompute the summaries of whole rows (after a dense change such as a grammar mask),
        with `summarise` ((logits [n, k * span], inv_temperature [n]) -> (span max, span mass)
        [n, k]: a kernel that computes them as span_stats defines; span_stats itself if None)."""
        if rows.numel():
            m, s = self._summarise(summarise, self.padded[rows], self.inv_temperature[rows])
            self.span_max[rows] = m
            self.span_sum[rows] = s

    def refresh_spans(self, rows: torch.Tensor, token_ids: torch.Tensor, summarise: Summarise | None = None) -> None:
        """Recompute the summaries of the spans holding (rows[i], token_ids[i]) (after sparse
        changes: bans, biases, penalties), with `summarise` as refresh_rows."""
        if not rows.numel():
            return
        keys = torch.unique(rows * self.span_max.shape[1] + token_ids // self.span)
        r, j = keys // self.span_max.shape[1], keys % self.span_max.shape[1]
        m, s = self._summarise(summarise, self.take_spans(r, j), self.inv_temperature[r])
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
    mass = scaled.clamp_min_(EXP_FLOOR).exp_().sum(dim=-1)
    return peak, mass.masked_fill_(peak == float("-inf"), 0.0)


def span_logits_from(logits: torch.Tensor, inv_temperature: torch.Tensor, buffer: LogitsBuffer | None = None
                     ) -> SpanLogits:
    """The general way to SpanLogits: copy finished logits [S, V] into a buffer and summarise
    them (models without a chunked head; tests). A chunked head summarises its chunks as
    it computes them instead (models/layers/head.OutputHead.span_logits)."""
    rows, vocab = logits.shape
    buffer = buffer if buffer is not None and buffer.vocab_size == vocab else LogitsBuffer(vocab)
    padded = buffer.rows(rows)
    padded[:, :vocab].copy_(logits)
    inv_t = inv_temperature.to(torch.float32)
    peak, mass = span_stats(padded, inv_t, buffer.span)
    return SpanLogits(vocab_size=vocab, inv_temperature=inv_t, span_max=peak, span_sum=mass, buffer=buffer,
                      padded=padded)
