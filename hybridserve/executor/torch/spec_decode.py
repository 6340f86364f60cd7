"""N-gram speculative decoding in the PyTorch runner: propose, then verify in one step.

A decode step that the scheduler gave d draft slots computes its one known token plus
up to d drafts proposed here (n-gram prompt lookup over the request's runner-side
tokens, which are current even under async scheduling)::

    positions     s      s+1   s+2   s+3          (s = runner's num_computed)
    inputs        x      d1    d2    d3           x: last known token, d: drafts
    sampled       t0     t1    t2    t3           one target token per position
    accepted      d1 == t0?  d2 == t1?  ...       stop at the first mismatch

With a accepted drafts the step outputs t0..ta (a accepted + one bonus token) and the
runner's num_computed advances by 1 + a; the K/V written at the rejected positions
s+a+1.. is garbage that later steps overwrite before anyone reads it.

Acceptance rule: a draft is accepted iff it equals the token sampling picks at its
position. Greedy: the argmax, so the output is exactly plain greedy decoding. Random
sampling: each position draws from its own (filtered) distribution p, keyed by the
request's seed and that position (sampling_keys.py); for a point-mass drafter (q = one
token d) this *is* the standard speculative rejection-sampling rule: accept d with
probability min(1, p(d)/q(d)) = p(d), else resample from norm(max(0, p - q)) = p without
d, which is what a draw x ~ p with "accept iff x == d" gives. So the output distribution
equals plain sampling, and since a position's draw is the one plain decoding makes there,
a seeded stream is the same token for token with drafts on or off (up to the float
rounding of a batched verify step's logits).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridserve.core.errors import ConfigError


@dataclass(frozen=True)
class NgramDrafter:
    """Prompt-lookup drafting with suffix n-grams of min_n..max_n tokens (longest first)."""

    min_n: int = 2
    max_n: int = 4

    def __post_init__(self) -> None:
        if self.min_n < 1 or self.max_n < self.min_n:
            raise ConfigError(f"n-gram sizes need 1 <= min <= max, got min={self.min_n}, max={self.max_n}")

    def propose(self, token_ids: list[int], num_drafts: int) -> list[int]:
        """Up to num_drafts tokens continuing token_ids (every known token of the request).

        A lookup whose continuation runs into the end of the tokens is continued as an
        overlapping copy (the source advances with the copy, as in LZ77), so a loop of
        period P keeps being predicted instead of yielding fewer than num_drafts::

            tokens  ... a b a b a b       suffix "b a b" last seen 2 earlier: P = 2
            lookup  a b                   (cut by the end of the tokens)
            drafts  a b a b               (num_drafts = 4)
        """
        if num_drafts <= 0 or len(token_ids) <= self.min_n:
            return []
        drafts = lookup(token_ids, num_drafts, self.min_n, self.max_n)
        if drafts and len(drafts) < num_drafts:  # cut short only by the end of token_ids
            period = len(drafts)
            drafts = [drafts[i % period] for i in range(num_drafts)]
        return drafts


def lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """What the numpy reference (tests/helpers/ngram_reference.py, propose_ngram_drafts) returns,
    found on a Python list without copying it to numpy (it runs once per decode request
    per step).

    Only earlier positions e <= len - 2 holding the last token can end a match; C-speed
    list.index finds them, then n-grams are compared from the longest n down, most
    recent e first.
    """
    length = len(tokens)
    last = tokens[-1]
    ends: list[int] = []
    e = -1
    try:
        while True:
            e = tokens.index(last, e + 1, length - 1)
            ends.append(e)
    except ValueError:
        pass
    if not ends:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for e in reversed(ends):
            if e >= n - 1 and tokens[e - n + 1 : e + 1] == suffix:
                return tokens[e + 1 : e + 1 + k]
    return []


def num_accepted(drafts: list[int], targets: list[int]) -> int:
    """Length of the longest prefix of drafts that equals the sampled targets.

    targets[j] is the token sampled at the position of drafts[j] (the one after the
    previous input), so len(targets) == len(drafts) + 1 and targets[a] is the bonus.
    """
    a = 0
    for d, t in zip(drafts, targets):
        if d != t:
            break
        a += 1
    return a
