"""The KL divergence measure on hand-computed three-token distributions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hybridserve.models.kl_divergence import ROWS_PER_CHUNK, KLAccumulator, KLSummary, kl_rows

P = [0.5, 0.25, 0.25]
Q = [0.8, 0.1, 0.1]
# KL(P || Q) = 0.5 ln(0.5/0.8) + 2 * 0.25 ln(0.25/0.1) = 0.5 ln(0.625 * 2.5) = ln 1.25
KL_PQ = math.log(1.25)
# KL(Q || P) = 0.8 ln(0.8/0.5) + 2 * 0.1 ln(0.1/0.25) = 0.8 ln 1.6 + 0.2 ln 0.4
KL_QP = 0.8 * math.log(1.6) + 0.2 * math.log(0.4)


def logits(probs: list[float], shift: float) -> list[float]:
    """Logits whose softmax is probs (any shift: softmax ignores it)."""
    return [math.log(p) + shift for p in probs]


def test_kl_of_three_token_distributions_by_hand() -> None:
    ref = np.array([logits(P, 3.0), logits(Q, -7.0), logits(P, 0.0)], dtype=np.float32)
    cand = np.array([logits(Q, 0.5), logits(P, 2.0), logits(P, 11.0)], dtype=np.float32)
    got = kl_rows(ref, cand)
    assert got == pytest.approx([KL_PQ, KL_QP, 0.0], abs=1e-6)
    assert KL_PQ == pytest.approx(0.2231436, abs=1e-7) and KL_QP == pytest.approx(0.1927448, abs=1e-7)


def test_summary_pools_positions_of_every_sequence() -> None:
    acc = KLAccumulator()
    # sequence 1: positions with KL ln 1.25 (same top token: id 0 in both) and 0;
    # sequence 2: one position with KL(Q || P), top tokens 0 and 2 (P reordered to [0.25, 0.25, 0.5]).
    acc.add(np.array([logits(P, 0.0), logits(Q, 0.0)]), np.array([logits(Q, 1.0), logits(Q, 4.0)]))
    acc.add(np.array([logits(Q, 0.0)]), np.array([logits(P[::-1], 0.0)]))
    # KL(Q || reversed P) = 0.8 ln(0.8/0.25) + 0.1 ln(0.1/0.25) + 0.1 ln(0.1/0.5)
    kl_reversed = 0.8 * math.log(3.2) + 0.1 * math.log(0.4) + 0.1 * math.log(0.2)
    got = acc.summary()
    assert got.positions == 3 and got.top1_agreement == pytest.approx(2 / 3)
    assert got.mean_kl == pytest.approx((KL_PQ + 0.0 + kl_reversed) / 3, abs=1e-9)
    assert got.max_kl == pytest.approx(kl_reversed, abs=1e-9)


def test_rows_beyond_one_chunk_count_once_each() -> None:
    n = ROWS_PER_CHUNK * 2 + 3
    acc = KLAccumulator()
    acc.add(np.array([logits(P, 0.0)] * n), np.array([logits(Q, 0.0)] * n))
    got = acc.summary()
    assert got == KLSummary(mean_kl=pytest.approx(KL_PQ), max_kl=pytest.approx(KL_PQ), top1_agreement=1.0,
                            positions=n)


def test_bad_shapes_and_empty_summary_raise() -> None:
    with pytest.raises(ValueError, match="one shape"):
        kl_rows(np.zeros((2, 3)), np.zeros((2, 4)))
    with pytest.raises(ValueError, match="differ in shape"):
        KLAccumulator().add(np.zeros((2, 3)), np.zeros((1, 3)))
    with pytest.raises(ValueError, match="no positions"):
        KLAccumulator().summary()
