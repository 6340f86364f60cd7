"""Sampling a batch of plain rows: the fast path beside sampler.sample, the general one.

A plain row (RequestState.plain) draws from its request's temperature, top-k, top-p and
min-p alone: no logprobs, no min_tokens bans, no logits controls, no grammar, no drafts.
Its draw parameters never change while its request runs, so a batch's are built once
(DrawParams) and kept while the same requests sample in the same order; a step then
adds only its positions. The native draw (span_draw.c's span_draw_keyed) keys each row's
draws itself, by (seed, position) as sampling_keys.uniforms does, and marks the rows
whose every token is masked: one call where sampler.sample makes a dozen tensors and
array operations, each several times its warm cost in a step whose weights have just
streamed through the caches.

sample_plain gives sampler.sample's tokens and failed rows for the same rows, seeds and
positions (tests/executor/test_plain_sampling.py).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from hybridserve.core.request import SamplingParams
from hybridserve.executor.torch.requests import RequestState
from hybridserve.executor.torch.sampler import (ALL_MASKED, SampleRow, inv_temperatures, is_greedy,
                                                reads_one_span_per_row)
from hybridserve.executor.torch.sampling_keys import uniforms
from hybridserve.executor.torch.span_draw import MASKED, UNDECIDED
from hybridserve.executor.torch.span_sampler import ATTEMPTS, CANDIDATE_SPANS, draw_undecided, native_draw
from hybridserve.models.layers.span_logits import SpanLogits

class DrawParams:
    """One batch's draw parameters, a row per request in batch order, in the dtypes the
    native draw reads (contiguous): greedy uint8, top_k int64 (0 where it keeps the whole
    vocabulary), top_p and min_p float32, inv_t float32 (1 for greedy rows: what the
    span summaries are taken at), seeds uint64. `stored`: whether the head must hold its
    logits (a row that reads more than one span: sampler.reads_one_span_per_row)."""

    def __init__(self, params: Sequence[SamplingParams], seeds: Sequence[int], vocab_size: int) -> None:
        self.greedy = torch.tensor([is_greedy(p) for p in params], dtype=torch.uint8)
        self.top_k = torch.tensor([p.top_k if p.top_k < vocab_size else 0 for p in params], dtype=torch.int64)
        self.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        self.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
        rows = [SampleRow(p) for p in params]
        self.inv_t = inv_temperatures(rows)
        self.seeds = np.array(seeds, dtype=np.uint64)
        # what the native draw reads, in its order (NativeDraw.keyed)
        self.addresses = (self.greedy.data_ptr(), self.top_k.data_ptr(), self.top_p.data_ptr(),
                          self.min_p.data_ptr(), self.seeds.ctypes.data)
        self.stored = not reads_one_span_per_row(rows, vocab_size)


class DrawParamsCache:
    """The DrawParams of the last batch, reused while the same request states sample in
    the same order (a request's parameters and seed are fixed for its life). The states
    are held, compared by identity: a request that ends and another of the same id make
    a new batch."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._states: tuple[RequestState, ...] = ()
        self._params: DrawParams | None = None

    def of(self, states: Sequence[RequestState]) -> DrawParams:
        held = self._states
        if self._params is None or len(held) != len(states) or any(a is not b for a, b in zip(held, states)):
            self._params = DrawParams([s.params for s in states], [s.seed for s in states], self.vocab_size)
            self._states = tuple(states)
        return self._params


def sample_plain(sl: SpanLogits, dp: DrawParams, positions: Sequence[int]) -> tuple[list[int], dict[int, str]] | None:
    """sampler.sample's (tokens, failed rows) for plain rows with dp's parameters drawing
    the tokens at `positions`; sl the head's span logits at dp.inv_t. None where the
    native draw is not built or cannot read these logits (the caller samples by the
    general path)."""
    native = native_draw()
    if native is None:
        return None
    tokens = native.keyed(sl, dp.addresses, positions, ATTEMPTS, CANDIDATE_SPANS)
    if tokens is None:
        return None
    failed: dict[int, str] = {}
    undecided = []
    if min(tokens) < 0:
        for i, t in enumerate(tokens):
            if t == MASKED:
                failed[i] = ALL_MASKED
            elif t == UNDECIDED:
                undecided.append(i)
    if undecided:
        u = torch.from_numpy(uniforms(dp.seeds.tolist(), positions, ATTEMPTS + 1))
        for i, token in zip(undecided, draw_undecided(sl, undecided, dp.top_k, dp.top_p, dp.min_p, u)):
            tokens[i] = token
    for i in failed:  # any token will do: the engine fails the request
        tokens[i] = int(sl.logits[i].max(dim=0).indices)
    return tokens, failed
