"""Next-token KL divergence of a reduced-precision run from a reference, position by position.

Both runs are teacher-forced along the same token sequence, so at every position they saw
the same context and each gives a full distribution over the vocabulary for the next
token. Per position: KL(reference || candidate) = sum_i p_i (log p_i - log q_i) in nats,
with p and q the softmax of each run's logits (float64, so a vocabulary of 262k entries
adds no rounding of its own), and whether both runs' most likely token is the same (a
tie counts as the lowest id, as a greedy argmax picks). Reported over all positions of
all sequences, each position weighing the same: mean and max KL, and the share of
positions whose top token agrees.

numpy only; benchmarks/kl_accuracy.py feeds it the engine's and llama.cpp's logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Rows converted to float64 at a time: 64 rows of a 262k vocabulary are 128 MiB per array.
ROWS_PER_CHUNK = 64


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax of [rows, vocab] logits, in float64."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl_rows(reference_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """KL(reference || candidate) in nats for each row of two [rows, vocab] logit arrays."""
    if reference_logits.shape != logits.shape or reference_logits.ndim != 2:
        raise ValueError(f"need two [rows, vocab] arrays of one shape, got {reference_logits.shape} and {logits.shape}")
    log_p = log_softmax(reference_logits)
    return (np.exp(log_p) * (log_p - log_softmax(logits))).sum(axis=-1)


@dataclass(frozen=True)
class KLSummary:
    mean_kl: float
    max_kl: float
    top1_agreement: float  # share of positions whose most likely token is the reference's
    positions: int


class KLAccumulator:
    """Adds sequences' [positions, vocab] logits pairs; `summary()` pools every position."""

    def __init__(self) -> None:
        self._sum = 0.0
        self._max = 0.0
        self._same_top1 = 0
        self._positions = 0

    def add(self, reference_logits: np.ndarray, logits: np.ndarray) -> None:
        if reference_logits.shape != logits.shape:
            raise ValueError(f"reference logits {reference_logits.shape} and candidate {logits.shape} differ in shape")
        for a in range(0, len(reference_logits), ROWS_PER_CHUNK):
            ref, cand = reference_logits[a:a + ROWS_PER_CHUNK], logits[a:a + ROWS_PER_CHUNK]
            kl = kl_rows(ref, cand)
            self._sum += float(kl.sum())
            self._max = max(self._max, float(kl.max()))
            self._same_top1 += int((ref.argmax(axis=-1) == cand.argmax(axis=-1)).sum())
            self._positions += len(kl)

    def summary(self) -> KLSummary:
        if not self._positions:
            raise ValueError("no positions added")
        return KLSummary(mean_kl=self._sum / self._positions, max_kl=self._max,
                         top1_agreement=self._same_top1 / self._positions, positions=self._positions)
