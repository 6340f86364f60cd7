"""Per-request logits controls: allowed tokens, bad words, logit bias, and the
repetition / frequency / presence penalties (SamplingParams documents each one).

They change a request's logits row in place, before temperature and the sampling
filters, and only for rows whose request asks for any (`has_logits_controls`), so
requests without them cost nothing. A row sees the tokens before its own position: the
prompt, the outputs so far and, in a verify step, the drafts before it, so a verified
draft is judged exactly as the same token sampled one step at a time would be.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from hybridserve.core.request import SamplingParams


@dataclass
class TokenHistory:
    """The tokens before a row's position: tokens[:num_prompt] are the prompt."""

    tokens: Sequence[int]
    num_prompt: int


def apply_logits_controls(logits: torch.Tensor, params: SamplingParams, history: TokenHistory) -> None:
    """Apply the controls of `params` to one row `logits` [V] in place."""
    vocab = logits.shape[0]
    device = logits.device
    if params.allowed_token_ids is not None:
        keep = torch.full((vocab,), float("-inf"), dtype=logits.dtype, device=device)
        keep[list(params.allowed_token_ids)] = 0.0
        logits += keep
    if params.bad_words_token_ids:
        banned = _bad_word_endings(params.bad_words_token_ids, history.tokens)
        if banned:
            logits[list(banned)] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=device)
        logits[ids] += torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype, device=device)
    if params.repetition_penalty != 1.0 and len(history.tokens):
        seen = torch.tensor(sorted(set(history.tokens)), device=device)
        picked = logits[seen]
        p = params.repetition_penalty
        logits[seen] = torch.where(picked > 0, picked / p, picked * p)
    if (params.frequency_penalty or params.presence_penalty) and len(history.tokens) > history.num_prompt:
        outputs = torch.tensor(list(history.tokens[history.num_prompt:]), device=device)
        counts = torch.bincount(outputs, minlength=vocab)[:vocab].to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)


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
