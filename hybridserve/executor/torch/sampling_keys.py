"""The random number behind each sampled token, keyed by (request seed, token position).

Every request has a seed: its own, or one the runner draws for it when it arrives. The
draws for the token at position p of its sequence are outputs 8p + 1.. of SplitMix64
started from that seed (a few outputs per position: a filtered row may draw more than once), a
counter-based generator: it depends on nothing but the pair. So a
request's tokens do not depend on which rows share its batch, on sync or async
scheduling, on a preemption that recomputes it, or on n-gram drafts (a verify row draws
with its own position's key, exactly what plain decoding of that position would draw).

SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators",
OOPSLA 2014) passes BigCrush; it is computed here in numpy's wrapping uint64 arithmetic,
for a whole batch at once.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


# Draws per position (a row may need several: span_sampler.ATTEMPTS + 1 <= this).
DRAWS_PER_POSITION = 8


def uniforms(seeds: Sequence[int], positions: Sequence[int], count: int = 1) -> np.ndarray:
    """float64 [S, count] in [0, 1), 53 random bits each: draw k of (seed, position) is
    output DRAWS_PER_POSITION * position + k of SplitMix64 from the seed."""
    if count > DRAWS_PER_POSITION:
        raise ValueError(f"at most {DRAWS_PER_POSITION} draws per position")
    s = np.array(seeds, dtype=np.uint64)[:, None]
    counter = np.array(positions, dtype=np.uint64)[:, None] * np.uint64(DRAWS_PER_POSITION) + np.arange(
        count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = _mix(_mix(s) + (counter + np.uint64(1)) * _GAMMA)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53
