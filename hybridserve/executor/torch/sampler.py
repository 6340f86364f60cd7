"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

A structured output's grammar mask (grammar.py), the per-request logits controls
(logits_controls.py) and the min_tokens ban come first; then
filters apply in the order temperature -> top-k -> top-p -> min-p, each to the result
of the previous one. Random rows draw with the Gumbel-free "exponential race"
(argmax p_i / E_i with E_i ~ Exp(1)), which samples exactly from p and lets every
request use its own torch.Generator. Logprobs are those of the model's raw
distribution (log_softmax of the logits, soft-capping included, before any sampling
filter), the way HF's output logits report them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridserve.core.request import SamplingParams
from hybridserve.core.sched.output import LogprobInfo
from hybridserve.executor.torch.grammar import apply_bitmask
from hybridserve.executor.torch.logits_controls import TokenHistory, apply_logits_controls


@dataclass
class SampleRow:
    """One logits row to sample: its request's parameters and generator."""

    params: SamplingParams
    generator: torch.Generator | None
    # Tokens this row may not produce (EOS and stop tokens before min_tokens outputs).
    banned: tuple[int, ...] = ()
    # The tokens before this row, when its request has logits controls (penalties, bias...).
    history: TokenHistory | None = None
    # Tokens a structured output allows here: an llguidance bitmask (int32 words), or None.
    bitmask: torch.Tensor | None = None


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature == 0.0 or params.top_k == 1


def sample(logits: torch.Tensor, rows: list[SampleRow], default_generator: torch.Generator
           ) -> tuple[list[int], list[tuple[float, list[tuple[int, float]] | None] | None]]:
    """logits [S, V] -> (token per row, (logprob, top-n or None) per row or None)."""
    greedy = [is_greedy(r.params) for r in rows]
    raw = logits
    if any(r.banned or r.history is not None or r.bitmask is not None for r in rows):
        logits = logits.clone()  # the raw logits stay for logprobs
        for i, r in enumerate(rows):
            if r.bitmask is not None:
                apply_bitmask(logits[i], r.bitmask)
            if r.history is not None:
                apply_logits_controls(logits[i], r.params, r.history)
            if r.banned:
                logits[i, list(r.banned)] = float("-inf")
    tokens = logits.argmax(dim=-1)
    if not all(greedy):
        idx = [i for i, g in enumerate(greedy) if not g]
        picked = _sample_random(logits[idx].float(), [rows[i] for i in idx], default_generator)
        tokens[idx] = picked
    token_list = tokens.tolist()
    want = [r.params.logprobs is not None for r in rows]
    if not any(want):
        return token_list, [None] * len(rows)
    info = target_logprobs(raw, tokens, max((r.params.logprobs or 0) for r in rows))
    out: list[tuple[float, list[tuple[int, float]] | None] | None] = []
    for i, r in enumerate(rows):
        if not want[i]:
            out.append(None)
            continue
        n = r.params.logprobs or 0
        top = info.top_logprobs[i][:n] if n and info.top_logprobs is not None else None
        out.append((info.token_logprobs[i], top))
    return token_list, out


def sample_isolated(logits: torch.Tensor, rows: list[SampleRow], default_generator: torch.Generator
                    ) -> tuple[list[int], list[tuple[float, list[tuple[int, float]] | None] | None], dict[int, str]]:
    """`sample`, but a failure is confined to the rows that cause it: on an exception the
    rows are sampled one at a time, and a row that still fails gets the raw argmax as a
    stand-in token, its index in the returned {row: reason} (the engine then fails that
    request alone). The fast path is `sample` itself; a failure is exceptional."""
    try:
        tokens, lps = sample(logits, rows, default_generator)
        return tokens, lps, {}
    except Exception:  # noqa: BLE001 - narrowed to the failing rows below
        pass
    tokens, lps, failed = [], [], {}
    for i, row in enumerate(rows):
        try:
            t, lp = sample(logits[i : i + 1], [row], default_generator)
            tokens.append(t[0])
            lps.append(lp[0])
        except Exception as exc:  # noqa: BLE001 - reported per request
            tokens.append(int(logits[i].argmax()))
            lps.append(None)
            failed[i] = f"{type(exc).__name__}: {exc}"
    return tokens, lps, failed


def _sample_random(logits: torch.Tensor, rows: list[SampleRow], default_generator: torch.Generator) -> torch.Tensor:
    dev = logits.device
    temp = torch.tensor([r.params.temperature for r in rows], device=dev, dtype=logits.dtype)
    x = logits / temp[:, None]
    x = _top_k_top_p(x, [r.params.top_k for r in rows], [r.params.top_p for r in rows])
    min_p = [r.params.min_p for r in rows]
    if any(p > 0.0 for p in min_p):
        probs = x.softmax(dim=-1)
        limit = torch.tensor(min_p, device=dev, dtype=x.dtype)[:, None] * probs.max(dim=-1, keepdim=True).values
        x = x.masked_fill(probs < limit, float("-inf"))
    probs = x.softmax(dim=-1)
    noise = torch.empty_like(probs)
    shared = [i for i, r in enumerate(rows) if r.generator is None]
    if shared:
        noise[shared] = torch.empty(len(shared), probs.shape[1], device=dev).exponential_(generator=default_generator)
    for i, r in enumerate(rows):
        if r.generator is not None:
            noise[i].exponential_(generator=r.generator)
    return (probs / noise).argmax(dim=-1)


def _top_k_top_p(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """x with the tokens outside each row's top-k (k = 0: off; ties with the k-th value
    stay) and then outside its top-p nucleus (over the top-k survivors, renormalised) set
    to -inf. A 262k-wide row is costly to sort, so the logits are sorted at most once: one
    descending sort serves both filters where a row wants top-p; top-k alone needs only the
    largest k values (`topk`)."""
    dev = x.device
    neg_inf = float("-inf")
    want_k = any(k > 0 for k in top_k)
    want_p = any(p < 1.0 for p in top_p)
    if not want_k and not want_p:
        return x
    k = torch.tensor([min(k, x.shape[1]) for k in top_k], device=dev)

    def kth_largest(values_desc: torch.Tensor) -> torch.Tensor:
        """Each row's k-th largest value from its values in descending order; -inf where k = 0."""
        kth = values_desc.gather(1, (k.clamp(min=1) - 1)[:, None])
        return kth.masked_fill((k == 0)[:, None], neg_inf)

    if not want_p:
        return x.masked_fill(x < kth_largest(x.topk(int(k.max()), dim=-1).values), neg_inf)
    sorted_x, order = x.sort(dim=-1, descending=True)
    if want_k:
        sorted_x = sorted_x.masked_fill(sorted_x < kth_largest(sorted_x), neg_inf)
    probs = sorted_x.softmax(dim=-1)
    # Drop a token once the mass strictly before it already reaches top_p; the most likely
    # token is always kept.
    drop = (probs.cumsum(dim=-1) - probs) >= torch.tensor(top_p, device=dev, dtype=x.dtype)[:, None]
    return torch.empty_like(x).scatter_(1, order, sorted_x.masked_fill(drop, neg_inf))


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
