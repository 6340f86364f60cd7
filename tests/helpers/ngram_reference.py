"""N-gram prompt-lookup drafting: propose the tokens that followed the last match.

For the longest suffix n-gram (n from max_n down to min_n) of a request's tokens that
also occurs earlier, propose the k tokens that followed its most recent earlier
occurrence::

    tokens   ... a b c d e ... x a b c   (suffix "a b c" seen before)
    drafts                d e ...        (what followed it last time)

The numpy reference the PyTorch runner's list-based `spec_decode.lookup` is tested
against (tests/engine/test_spec_decode.py); no engine code imports it.
"""

from __future__ import annotations

import numpy as np


def propose_ngram_drafts(tokens: list[int] | np.ndarray, k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """Up to k draft tokens continuing `tokens`, or [] when no suffix n-gram recurs."""
    if k <= 0:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    length = len(arr)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = arr[length - n :]
        # Windows of n tokens that end before the suffix starts: positions 0 .. length-n-1.
        windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # token after the most recent earlier occurrence
            return arr[start : start + k].tolist()
    return []
