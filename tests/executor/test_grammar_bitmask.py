"""Grammar bitmasks applied to logits: bit t % 32 of word t // 32 allows token t.

The expected sets come from Python integers, never from the unpacking under test. One test
runs in a child process with ATen's AVX2 kernels, where llguidance's torch.compile'd kernel
(which this code replaced) got about a quarter of the tokens wrong.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from hybridserve.executor.torch.grammar import apply_bitmask, bitmask_penalty  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def words(values: list[int]) -> torch.Tensor:
    """int32 words from unsigned 32-bit values (bit 31 set is a negative int32)."""
    return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in values], dtype=torch.int32)


def allowed_by_hand(values: list[int], vocab_size: int) -> set[int]:
    return {t for t in range(min(vocab_size, 32 * len(values))) if values[t // 32] >> (t % 32) & 1}


def test_hand_made_mask() -> None:
    # word 0 = 0b101: tokens 0 and 2; word 1 = bit 31 only: token 63; tokens 64.. lie past the mask
    logits = torch.arange(70, dtype=torch.float32)
    apply_bitmask(logits, words([0b101, 1 << 31]))
    assert [t for t in range(70) if logits[t] != -math.inf] == [0, 2, 63]
    assert logits[0] == 0.0 and logits[2] == 2.0 and logits[63] == 63.0  # allowed logits untouched


def test_bfloat16_logits_and_a_vocab_shorter_than_the_mask() -> None:
    logits = torch.full((40,), 1.5, dtype=torch.bfloat16)
    apply_bitmask(logits, words([0xFFFFFFFF, 0b10]))  # all of word 0, token 33 of word 1
    assert logits.dtype == torch.bfloat16
    assert [t for t in range(40) if logits[t] != -math.inf] == list(range(32)) + [33]
    assert set(logits[logits != -math.inf].tolist()) == {1.5}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, (1 << 32) - 1), min_size=1, max_size=6), st.integers(1, 200))
def test_allowed_tokens_are_the_set_bits(values: list[int], vocab_size: int) -> None:
    penalty = bitmask_penalty(words(values), vocab_size)
    assert penalty.shape == (vocab_size,)
    allowed = allowed_by_hand(values, vocab_size)
    assert {t for t in range(vocab_size) if penalty[t] == 0.0} == allowed
    assert all(penalty[t] == -math.inf for t in range(vocab_size) if t not in allowed)


def test_right_with_avx2_kernels() -> None:
    """A random 262k-token mask in a child process limited to ATen's AVX2 kernels."""
    code = """
import random
import torch
from hybridserve.executor.torch.grammar import apply_bitmask
from tests.executor.test_grammar_bitmask import words
rng = random.Random(7)
values = [rng.getrandbits(32) for _ in range(8192)]
mask = words(values)
logits = torch.zeros(8192 * 32)
apply_bitmask(logits, mask)
wrong = sum(1 for t in range(8192 * 32) if (logits[t].item() == 0.0) != bool(values[t // 32] >> (t % 32) & 1))
print(wrong)
"""
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0"]
