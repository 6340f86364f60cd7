"""A float32 model keeping its KV cache in bf16 (EngineConfig.kv_cache_dtype;
models/kv_specs.resolve_kv_dtype picks it by default for a float32 model with quantized
weights): K/V are rounded to bf16 as they are written and widened as attention reads them.

The attention then computes exactly what a float32 cache holding those rounded values
computes: the chunk's own keys, where read from the batch, are the rounded ones too, so a
token's attention does not depend on whether its keys were cached. The rules of which
cache dtype a model may keep, and the engine's choice, are checked on a tiny Gemma 3 GGUF."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from hybridserve import LLM, SamplingParams  # noqa: E402
from hybridserve.config import EngineConfig  # noqa: E402
from hybridserve.core.errors import ConfigError  # noqa: E402
from hybridserve.executor.torch.attention import StepAttention  # noqa: E402
from hybridserve.executor.torch.paged_decode import paged_decode  # noqa: E402
from hybridserve.models.arch.mamba_config import MAMBA  # noqa: E402
from hybridserve.models.kv_specs import kv_dtype_problem, resolve_kv_dtype  # noqa: E402
from hybridserve.models.layers.head import GROUP_LAYERS  # noqa: E402
from hybridserve.models.layers.int8_groups import group_kernel  # noqa: E402

from tests.helpers.block_tables import consecutive_tables  # noqa: E402
from tests.helpers.tiny_gguf import TOKENS, mixed_linear_types, write_tiny_gemma3  # noqa: E402

BS, HEADS, KV_HEADS, DIM = 4, 4, 2, 16
WINDOWS, CHUNKS = [None, 6, None], [None, None, 8]  # full, sliding, chunked local
BLOCKS = 8  # per request and group


def _run(cache: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, starts: np.ndarray, counts: np.ndarray,
         in_place: bool) -> torch.Tensor:
    """Every layer's attention of one step (float32 queries) over `cache`, which it writes."""
    n = len(starts)
    tables = consecutive_tables(len(WINDOWS), n, BLOCKS)
    step = StepAttention([(g, cache[g]) for g in range(len(WINDOWS))], WINDOWS, tables, BS, np.arange(n), starts,
                         counts, DIM ** -0.5, None, torch.device("cpu"), torch.float32, chunks=CHUNKS,
                         in_place_decode=in_place)
    return torch.stack([step.attention(layer, q, kv) for layer in range(len(WINDOWS))])


def _inputs(seed: int, tokens: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    n_blocks = 1 + len(WINDOWS) * 6 * BLOCKS
    cache = torch.randn(len(WINDOWS), n_blocks, BS, 2, KV_HEADS, DIM, generator=g).to(torch.bfloat16)
    cache[:, 0] = 0  # the null block
    q = torch.randn(tokens, HEADS, DIM, generator=g)
    kv = torch.randn(tokens, 2, KV_HEADS, DIM, generator=g) * 3
    return cache, q, kv


# (starts, counts): first chunks with nothing cached (keys from the batch), a mix of first and
# later chunks, and later chunks of different lengths (read after write, padded batches)
PREFILLS = [([0, 0, 0], [5, 7, 3]), ([0, 9, 0, 14], [6, 3, 2, 11]), ([3, 10, 17], [4, 1, 12])]


@pytest.mark.parametrize("starts, counts", PREFILLS)
def test_a_bf16_cache_computes_what_a_float32_cache_of_the_rounded_values_does(starts, counts) -> None:
    """The general path (gather + SDPA): the outputs and the written cache equal, bit for
    bit, those of a float32 cache holding the same bf16 values, fed the K/V rounded to bf16."""
    starts, counts = np.array(starts), np.array(counts)
    cache, q, kv = _inputs(int(counts.sum()), int(counts.sum()))
    wide = cache.float()
    got = _run(cache, q, kv, starts, counts, in_place=False)
    want = _run(wide, q, kv.bfloat16().float(), starts, counts, in_place=False)
    assert got.dtype == torch.float32
    assert torch.equal(got, want)
    assert torch.equal(cache.float(), wide)  # the same slots written, with the same rounded values
    # and rounding mattered: the unrounded K/V give other outputs
    assert not torch.equal(_run(cache.float(), q, kv, starts, counts, in_place=False), want)


@pytest.mark.skipif(paged_decode() is None, reason="no C compiler: the in-place decode kernel is not built")
def test_a_decode_step_reads_the_bf16_cache_in_place() -> None:
    """A decode step (one token per request, keys all in the cache) goes to the in-place
    kernel with the float32 query over the bf16 cache: within float32 sums of the general
    path over a float32 cache of the same values."""
    starts = np.array([0, 3, 5, 11, 17, 29])
    counts = np.ones(len(starts), dtype=np.int64)
    cache, q, kv = _inputs(3, len(starts))
    wide = cache.float()
    got = _run(cache, q, kv, starts, counts, in_place=True)
    want = _run(wide, q, kv.bfloat16().float(), starts, counts, in_place=False)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(cache.float(), wide)


class _Cfg:
    def __init__(self, *kinds: str) -> None:
        self.layer_types = list(kinds)


def test_which_cache_dtypes_a_model_may_keep() -> None:
    attention = _Cfg("full_attention", "sliding_attention")
    assert kv_dtype_problem("float32", "float32", attention) == ""
    assert kv_dtype_problem("bfloat16", "bfloat16", attention) == ""
    assert kv_dtype_problem("bfloat16", "float32", attention) == ""
    assert "states stay float32" in kv_dtype_problem("bfloat16", "float32", _Cfg("full_attention", MAMBA))
    assert "model's dtype" in kv_dtype_problem("float32", "bfloat16", attention)
    assert "model's dtype" in kv_dtype_problem("float16", "float32", attention)


def test_auto_keeps_bf16_only_under_a_quantized_float32_model() -> None:
    attention, hybrid = _Cfg("full_attention"), _Cfg("full_attention", MAMBA)
    assert resolve_kv_dtype("auto", "float32", GROUP_LAYERS, attention) == "bfloat16"
    assert resolve_kv_dtype("auto", "float32", "int8", attention) == "bfloat16"
    assert resolve_kv_dtype("auto", "float32", "none", attention) == "float32"  # the exact reference
    assert resolve_kv_dtype("auto", "float32", "int8", hybrid) == "float32"  # recurrent states
    assert resolve_kv_dtype("auto", "bfloat16", "int8", attention) == "bfloat16"
    assert resolve_kv_dtype("float32", "float32", "int8", attention) == "float32"
    assert resolve_kv_dtype("bfloat16", "float32", "none", attention) == "bfloat16"
    with pytest.raises(ConfigError, match="float32 model needs attention layers only"):
        resolve_kv_dtype("bfloat16", "float32", "none", hybrid)
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp8")


needs_kernels = pytest.mark.skipif(group_kernel() is None, reason="no C compiler: the native kernels are not built")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bf16_cache") / "gemma3.gguf"
    write_tiny_gemma3(path, hidden_size=256, intermediate_size=512, linear_types=mixed_linear_types())
    return path


def _llm(path: Path, **kwargs) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(str(path), quantization=GROUP_LAYERS, dtype="float32", max_model_len=128, progress=False,
               enable_prefix_caching=False, **kwargs)


@needs_kernels
def test_the_engine_keeps_a_quantized_float32_models_cache_in_bf16(gemma: Path) -> None:
    """By default the float32 GGUF groups' cache is bf16, its blocks half a float32 cache's
    bytes, and the engine serves a batch from it (its decode steps on the decode stack:
    tests/models/test_decode_stack.py; its accuracy on the default model against float32
    and llama.cpp: tests/models/test_accuracy.py); named float32, the cache is float32."""
    prompts = [[(7 * i + 3 * j) % (len(TOKENS) - 3) + 3 for j in range(5 + 3 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    block_bytes = {}
    for kv_dtype, want in (("auto", torch.bfloat16), ("float32", torch.float32)):
        llm = _llm(gemma, kv_cache_dtype=kv_dtype)
        try:
            executor = llm.parts.engine.executor
            assert executor.kv_dtype == str(want).removeprefix("torch.")
            assert all(b.dtype == want for b in executor.runner.kv.buffers)
            block_bytes[kv_dtype] = executor.runner.kv.config.bytes_per_block
            out = llm.generate(prompts, params, use_tqdm=False)
            assert [len(o.outputs[0].token_ids) for o in out] == [8] * len(prompts)
        finally:
            llm.shutdown()
    assert block_bytes["float32"] == 2 * block_bytes["auto"]


@needs_kernels
def test_a_cache_dtype_the_model_cannot_keep_is_one_config_error(gemma: Path) -> None:
    with pytest.raises(ConfigError, match="kv_cache_dtype float16 under a float32 model"):
        _llm(gemma, kv_cache_dtype="float16")
