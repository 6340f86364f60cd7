"""Llama 3 RoPE scaling as llama.cpp stores it: a `rope_freqs` tensor of per-frequency divisors
(Llama 3.x, EXAONE 4), turned back into HF's `rope_scaling`."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from hybridserve.core.errors import ConfigError
from hybridserve.models.loaders.gguf_header import GGUFHeader, dequantize_tensor
from hybridserve.models.loaders.gguf_spec import float32_value

ROPE_FREQS_TENSOR = "rope_freqs.weight"


def rope_freqs_scaling(header: GGUFHeader, theta: float, head_dim: int) -> dict[str, Any] | None:
    """HF `rope_scaling` from the file's rope_freqs tensor; None without one or when it scales nothing."""
    rope_freqs = next((t for t in header.tensors if t.name == ROPE_FREQS_TENSOR), None)
    if rope_freqs is None:
        return None
    return llama3_rope_scaling(dequantize_tensor(header, rope_freqs), theta, head_dim)


def llama3_factors(theta: float, head_dim: int, scaling: dict[str, Any]) -> np.ndarray:
    """Per-frequency divisors of Llama 3 RoPE scaling, as llama.cpp stores them in rope_freqs."""
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    smooth = (original / wavelen - low) / (high - low)
    medium = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, medium))


def llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any] | None:
    """HF `rope_scaling` reproducing a GGUF `rope_freqs` tensor, None when it scales nothing.

    Llama 3.1 and 3.2 used low/high frequency factors 1 and 4 over an 8192-token original
    context; only `factor` (the largest divisor) varies, so it is read from the tensor and the
    whole curve is checked before it is trusted.
    """
    if np.allclose(factors, 1.0):
        return None
    scaling = {
        "rope_type": "llama3",
        "factor": float32_value(float(factors.max())),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    expected = llama3_factors(theta, head_dim, scaling)
    if factors.shape != expected.shape or not np.allclose(expected, factors, rtol=1e-4):
        raise ConfigError("the GGUF's rope_freqs tensor matches no known Llama 3 RoPE scaling")
    return scaling
