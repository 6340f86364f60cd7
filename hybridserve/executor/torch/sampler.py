"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

A structured output's grammar mask (grammar.py), the per-request logits controls
(logits_controls.py) and the min_tokens ban change the logits first; then each row draws
its token from the distribution that temperature -> top-k -> top-p -> min-p define
(span_sampler.py says how, exactly, without a softmax, a sort or a random number per
vocabulary entry). The draw's randomness is keyed by the request's seed and the token's
position (sampling_keys.py). Logprobs are those of the model's raw distribution
(log_softmax of the logits, soft-capping included, before any change or filter), the
way HF's output logits report them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Callable

import numpy as np
import torch

from hybridserve.core.request import SamplingParams
from hybridserve.core.sched.output import LogprobInfo
from hybridserve.executor.torch.grammar import apply_bitmask
from hybridserve.executor.torch.logits_controls import TokenHistory, apply_logits_controls
from hybridserve.executor.torch.penalties import NativePenalties, penalties_only
from hybridserve.executor.torch.sampling_keys import uniforms
from hybridserve.executor.torch.span_sampler import ATTEMPTS, draw
from hybridserve.models.layers.span_kernel import KERNEL
from hybridserve.models.layers.span_logits import SPAN, SpanLogits, span_logits_from
from hybridserve.models.platform.native_build import checked

# The reason a row cannot be sampled when every token of it is masked.
ALL_MASKED = "every token of the vocabulary is masked (allowed tokens, bans, grammar)"
# A row's (logprob of its token, top-n alternatives or None), or None without logprobs.
RowLogprobs = tuple[float, list[tuple[int, float]] | None] | None


@dataclass
class SampleRow:
    """One logits row to sample: its request's parameters and the key of its draw."""

    params: SamplingParams
    seed: int = 0  # the request's seed (its own, or the one the runner drew for it)
    position: int = 0  # the index of the token this row draws in its request's sequence
    # Tokens this row may not produce (EOS and stop tokens before min_tokens outputs).
    banned: tuple[int, ...] = ()
    # The tokens before this row, when its request has logits controls (penalties, bias...).
    history: TokenHistory | None = None
    # Tokens a structured output allows here: an llguidance bitmask (int32 words), or None.
    bitmask: torch.Tensor | None = None


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature == 0.0 or params.top_k == 1


def reads_one_span_per_row(rows: list[SampleRow], vocab_size: int) -> bool:
    """Whether sampling these rows reads the logits of one span per row only: every row
    greedy (it reads its maximum's span) or drawing at a temperature alone (no top-k below
    the vocabulary, top-p or min-p, which read a dozen spans or more), and none with logits
    controls, bans, a grammar mask or logprobs. Then the head need not store its logits
    (OutputHead.span_logits with stored=False): the span a row draws from is computed
    again, bit for bit, and any other use of them computes them all first."""
    for r in rows:
        p = r.params
        if p.logprobs is not None or r.banned or r.history is not None or r.bitmask is not None:
            return False
        if not is_greedy(p) and ((0 < p.top_k < vocab_size) or p.top_p < 1.0 or p.min_p > 0.0):
            return False
    return True


def inv_temperatures(rows: list[SampleRow]) -> torch.Tensor:
    """[S] float32 1 / temperature (1 for greedy rows, which ignore it): what the span
    summaries are taken at."""
    return torch.tensor([1.0 if is_greedy(r.params) else 1.0 / r.params.temperature for r in rows],
                        dtype=torch.float32)


def sample(logits: SpanLogits | torch.Tensor, rows: list[SampleRow]
           ) -> tuple[list[int], list[RowLogprobs], dict[int, str]]:
    """logits [S, V] (or their SpanLogits at inv_temperatures(rows)) -> (token per row,
    logprobs per row, {row: reason} for rows that cannot be sampled). A failing row (a
    control naming a token outside the vocabulary, every token masked) fails alone: it
    gets the raw argmax as a stand-in token, and the engine fails its request."""
    sl = logits if isinstance(logits, SpanLogits) else span_logits_from(logits.float(), inv_temperatures(rows))
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    changes = [i for i, r in enumerate(rows) if r.banned or r.history is not None or r.bitmask is not None]
    # The raw logits stay for logprobs (a copy of those rows, the rest left in pieces).
    raw_rows = sl.whole_rows(torch.tensor(want))[:, : sl.vocab_size] if want and changes else None
    failed = _apply_changes(sl, rows, changes) if changes else {}
    params = [r.params for r in rows]
    greedy = torch.tensor([is_greedy(p) for p in params])
    # A top_k of the vocabulary or more keeps every token: the same as no top_k (0), and
    # it may not even fit the tensor's int64.
    top_k = torch.tensor([p.top_k if p.top_k < sl.vocab_size else 0 for p in params], dtype=torch.long)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
    u = torch.from_numpy(uniforms([r.seed for r in rows], [r.position for r in rows], ATTEMPTS + 1))
    tokens = draw(sl, greedy, top_k, top_p, min_p, u)
    for i in (sl.span_max.amax(dim=1) == float("-inf")).nonzero().squeeze(1).tolist():
        failed.setdefault(i, ALL_MASKED)
    for i in failed:  # any token will do: the engine fails the request
        tokens[i] = sl.logits[i].max(dim=0).indices
    token_list = tokens.tolist()
    if not want:
        return token_list, [None] * len(rows), failed
    if raw_rows is None:
        raw_rows = sl.whole_rows(torch.tensor(want))[:, : sl.vocab_size]
    info = target_logprobs(raw_rows, tokens[want],
                           max((rows[i].params.logprobs or 0) for i in want))
    out: list[RowLogprobs] = [None] * len(rows)
    for k, i in enumerate(want):
        n = rows[i].params.logprobs or 0
        top = info.top_logprobs[k][:n] if n and info.top_logprobs is not None else None
        out[i] = (info.token_logprobs[k], top)
    return token_list, out, failed


def sample_isolated(logits_of: Callable[[list[int]], SpanLogits], rows: list[SampleRow]
                    ) -> tuple[list[int], list[RowLogprobs], dict[int, str]]:
    """`sample` over logits_of(every row), but an unexpected fault is confined to the rows
    that cause it: the rows are then sampled one at a time, each from fresh logits (the
    failed attempt may have changed the shared ones in place), and a row that still fails
    gets a stand-in token, its index in the returned {row: reason} (the engine then fails
    that request alone). The fast path is `sample` itself; a fault is exceptional."""
    try:
        return sample(logits_of(list(range(len(rows)))), rows)
    except Exception:  # noqa: BLE001 - narrowed to the failing rows below
        pass
    tokens: list[int] = []
    lps: list[RowLogprobs] = []
    failed: dict[int, str] = {}
    for i, row in enumerate(rows):
        try:
            t, lp, f = sample(logits_of([i]), [row])
            tokens.append(t[0])
            lps.append(lp[0])
            if f:
                failed[i] = f[0]
        except Exception as exc:  # noqa: BLE001 - reported per request
            tokens.append(0)
            lps.append(None)
            failed[i] = f"{type(exc).__name__}: {exc}"
    return tokens, lps, failed


def _apply_changes(sl: SpanLogits, rows: list[SampleRow], changed: list[int]) -> dict[int, str]:
    """Grammar masks, logits controls and min_tokens bans, in that order, on the rows that
    have any; the span summaries brought up to date after them. Only a grammar mask or
    allowed_token_ids makes the logits dense; the rest change single entries in place.
    Where every change is a logit bias or a penalty, the native path (penalties.c) does it."""
    if all(rows[i].history is not None and rows[i].bitmask is None and not rows[i].banned
           and penalties_only(rows[i].params) for i in changed):
        native = _native_penalties()
        if native is not None and native(sl, [(i, rows[i].params, rows[i].history) for i in changed]):
            return {}
    dense = [i for i in changed if rows[i].bitmask is not None]
    for i in dense:
        apply_bitmask(sl.logits[i], rows[i].bitmask)  # type: ignore[arg-type]
    controls, failed = apply_logits_controls(
        sl, [(i, rows[i].params, rows[i].history) for i in changed if rows[i].history is not None])
    ban_rows = [np.full(len(set(rows[i].banned)), i) for i in changed if rows[i].banned]
    sparse_rows, sparse_ids = [controls.rows], [controls.ids]
    if ban_rows:
        r = torch.from_numpy(np.concatenate(ban_rows))
        t = torch.tensor([t for i in changed for t in sorted(set(rows[i].banned))], dtype=torch.long)
        sl.put(r, t, torch.full(r.shape, float("-inf")))
        sparse_rows.append(r)
        sparse_ids.append(t)
    sl.refresh_spans(torch.cat(sparse_rows), torch.cat(sparse_ids), KERNEL.summarise)
    sl.refresh_rows(torch.tensor(sorted(set(dense) | set(controls.dense_rows)), dtype=torch.long), KERNEL.summarise)
    return failed


@cache
def _native_penalties() -> NativePenalties | None:
    return checked(lambda: NativePenalties(SPAN), _penalties_mismatch, "penalties and logit bias in numpy")


def _penalties_mismatch(native: NativePenalties) -> str:
    """'' where the native penalties change a small batch's logits and summaries as the
    general path does (bias, each penalty, their mix, a row without controls)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 6 * SPAN, generator=g) * 3
    history = TokenHistory([5, 9, 5, 700, 9, 5, 130], num_prompt=3)
    requests = [(0, SamplingParams(repetition_penalty=1.3), history),
                (1, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, logit_bias={9: 1.5, 2: -3.0}), history),
                (3, SamplingParams(repetition_penalty=0.8, frequency_penalty=0.1, logit_bias={5: 2.0}), history)]
    a, b = (span_logits_from(logits, torch.linspace(0.5, 2.0, 4)) for _ in range(2))
    if not native(a, requests):
        return "it declined a batch it applies"
    controls, _ = apply_logits_controls(b, requests)
    b.refresh_spans(controls.rows, controls.ids, KERNEL.summarise)
    if not torch.equal(a.padded, b.padded):
        return "its logits differ from the general path's"
    if not (torch.equal(a.span_max, b.span_max) and torch.equal(a.span_sum, b.span_sum)):
        return "its span summaries differ from the general path's"
    return ""


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor, n_top: int) -> LogprobInfo:
    """logits [S, V], targets [S] (long) -> the logprob of each row's target token in the
    raw distribution (as `sample` reports a sampled token's), with the row's n_top most
    likely (token id, logprob) when n_top > 0."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    values = lp.gather(1, targets[:, None]).squeeze(1).tolist()
    if not n_top:
        return LogprobInfo(values)
    tv, ti = lp.topk(min(n_top, lp.shape[1]), dim=-1)
    return LogprobInfo(values, [list(zip(ids, vals)) for ids, vals in zip(ti.tolist(), tv.tolist())])


def logprob_info(entries: list[tuple[float, list[tuple[int, float]] | None]]) -> LogprobInfo:
    """Fold per-token (logprob, top-n) pairs of one request into a LogprobInfo."""
    tops = [t for _, t in entries]
    return LogprobInfo(
        token_logprobs=[lp for lp, _ in entries],
        top_logprobs=tops if any(t is not None for t in tops) else None,
    )
