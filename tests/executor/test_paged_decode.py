"""The in-place decode attention kernel (executor/torch/paged_decode.c): each request's
query against exactly its run of keys, read from its blocks, equals the softmax written out
in float64 over those keys; a decode step through StepAttention gives the general path's
(gather + SDPA) output; and without a compiler the general path serves alone."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hybridserve.executor.torch import attention as attention_module  # noqa: E402
from hybridserve.executor.torch import paged_decode as paged_decode_module  # noqa: E402
from hybridserve.executor.torch.attention import StepAttention  # noqa: E402
from hybridserve.executor.torch.paged_decode import PagedDecode, paged_decode  # noqa: E402
from hybridserve.executor.torch.requests import BlockTables  # noqa: E402
from hybridserve.models.platform.native_build import NativeBuildError  # noqa: E402
from tests.helpers.block_tables import consecutive_tables  # noqa: E402
from tests.helpers.native_kernels import check_refused  # noqa: E402

KERNEL = paged_decode()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler: the kernel is not built")


def _expected(q, cache, ids, first, count, scale, softcap, sinks) -> torch.Tensor:
    """Attention written out in float64: request b's keys are the tokens first[b] ..
    first[b] + count[b] - 1 of its blocks laid end to end."""
    B, H, D = q.shape
    kvh = cache.shape[3]
    out = torch.empty(B, H, D, dtype=torch.float64)
    for b in range(B):
        tokens = cache[ids[b]].reshape(-1, 2, kvh, D)[int(first[b]) : int(first[b] + count[b])].double()
        for h in range(H):
            kv = h // (H // kvh)
            scores = tokens[:, 0, kv] @ q[b, h].double() * scale
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            weights = scores.exp()
            denominator = weights.sum() + (0.0 if sinks is None else float(np.exp(float(sinks[h]))))
            out[b, h] = (weights / denominator) @ tokens[:, 1, kv]
    return out


def _case(seed: int, batch: int, heads: int, kv_heads: int, dim: int, block_size: int, dtype: torch.dtype,
          cache_dtype: torch.dtype | None = None):
    """A query in `dtype` over a cache in `cache_dtype` (default: the same)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks, per_row = 24, 5
    cache = torch.randn(num_blocks, block_size, 2, kv_heads, dim, generator=g).to(cache_dtype or dtype)
    ids = torch.randint(1, num_blocks, (batch, per_row), generator=g)
    first = torch.randint(0, block_size, (batch,), generator=g)
    count = torch.tensor([int(torch.randint(1, per_row * block_size - int(f) + 1, (), generator=g)) for f in first])
    q = torch.randn(batch, heads, dim, generator=g).to(dtype)
    return q, cache, ids, first, count


def _on_threads(threads: int, *args) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The kernel's output with torch's thread count set to `threads` for the call."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return KERNEL(*args)
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("shape", [(3, 4, 1, 256, 16), (5, 8, 2, 24, 4), (4, 10, 2, 64, 8), (3, 4, 1, 32, 3)])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_float32_query_over_a_bf16_cache(shape, threads: int) -> None:
    """A float32 model keeping K/V in bf16: the float32 query against the bf16 keys and
    values (widened exactly) gives float32 outputs within float32 sums of the written-out
    attention over those same bf16 values, with head sizes read as pairs and as single
    vectors, on one thread and with one stream's keys split."""
    batch, heads, kv_heads, dim, block_size = shape
    q, cache, ids, first, count = _case(sum(shape) + 1, *shape, torch.float32, torch.bfloat16)
    got = _on_threads(threads, q, cache, ids, first, count, 0.3, None, None)
    want = _expected(q, cache, ids, first, count, 0.3, None, None)
    assert got.dtype == torch.float32 and got.shape == (batch, heads, dim)
    assert torch.allclose(got.double(), want, rtol=0, atol=2e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [
    (3, 4, 1, 256, 16),  # Gemma 3 270M's heads: one kv head shared by four
    (5, 8, 2, 24, 4),  # groups of 4, a head size that is not whole vectors
    (2, 6, 3, 7, 16),  # groups of 2, 7 values a head
    (4, 10, 2, 64, 8),  # groups of 5: one whole group of four and one head
    (1, 2, 2, 16, 1),  # no grouping, one token a block
    (3, 4, 1, 32, 3),  # one pair of vectors a head (AVX-512), blocks of 3: cursors wrap every 3 keys
])
@pytest.mark.parametrize("extra", ["plain", "softcap", "sinks"])
def test_kernel_equals_attention_written_out(dtype, shape, extra) -> None:
    batch, heads, kv_heads, dim, block_size = shape
    q, cache, ids, first, count = _case(sum(shape), *shape, dtype)
    softcap = 2.0 if extra == "softcap" else None  # small: the cap bends the scores visibly
    sinks = torch.linspace(-1.0, 2.0, heads) if extra == "sinks" else None
    got = KERNEL(q, cache, ids, first, count, 0.3, softcap, sinks)
    want = _expected(q, cache, ids, first, count, 0.3, softcap, sinks)
    assert got.dtype == dtype and got.shape == (batch, heads, dim)
    if dtype == torch.float32:
        assert torch.allclose(got.double(), want, rtol=0, atol=2e-5)  # float32 sums of 256 products
    else:  # float32 inside, one rounding to bf16 at the end: within half a bf16 step of the value
        assert ((got.double() - want).abs() <= want.abs() * 2.0 ** -8 + 1e-6).all()


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("extra", ["plain", "sinks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_stream_split_over_threads(threads: int, extra: str, dtype: torch.dtype) -> None:
    """One request on one kv head (fewer pairs than threads): its keys are split into ranges
    on several threads and their states combined; the output is still the written-out one
    (bf16: the states of the pair loads, kept in even / odd order, put back in order)."""
    q, cache, ids, first, count = _case(3, 1, 4, 1, 64, 4, dtype)
    count = torch.tensor([5 * 4 - int(first[0])])  # every key of the five blocks
    sinks = torch.tensor([0.5, -1.0, 3.0, 0.0]) if extra == "sinks" else None
    got = _on_threads(threads, q, cache, ids, first, count, 0.3, None, sinks)
    want = _expected(q, cache, ids, first, count, 0.3, None, sinks)
    if dtype == torch.float32:
        assert torch.allclose(got.double(), want, rtol=0, atol=2e-6)
    else:  # one rounding to bf16 at the end
        assert ((got.double() - want).abs() <= want.abs() * 2.0 ** -8 + 1e-6).all()


@needs_kernel
def test_one_key_is_its_value_and_far_keys_are_never_read() -> None:
    """A run of one key returns that key's value exactly; keys outside the run are never read
    (NaN there would poison any sum that touched them)."""
    q, cache, ids, first, count = _case(7, 3, 4, 1, 32, 4, torch.float32)
    cache[...] = float("nan")
    count = torch.ones(3, dtype=torch.int64)
    for b in range(3):
        blk, slot = ids[b, first[b] // 4], first[b] % 4
        cache[blk, slot] = torch.arange(2 * 32, dtype=torch.float32).view(2, 1, 32) + b
    got = KERNEL(q, cache, ids, first, count, 0.5, None, None)
    for b in range(3):
        assert torch.equal(got[b], (torch.arange(32, 64, dtype=torch.float32) + b).expand(4, 32))


@needs_kernel
def test_blocks_further_apart_than_their_size() -> None:
    """A hybrid pool's attention view: blocks padded to a larger page (the gap is never read)."""
    q, cache, ids, first, count = _case(11, 4, 4, 2, 16, 4, torch.bfloat16)
    page = torch.full((cache.shape[0], cache[0].numel() + 40), float("nan"), dtype=torch.bfloat16)
    page[:, : cache[0].numel()] = cache.reshape(cache.shape[0], -1)
    strided = page[:, : cache[0].numel()].view(cache.shape)
    assert strided.stride(0) == cache[0].numel() + 40 and KERNEL.supports(q, strided)
    assert torch.equal(KERNEL(q, strided, ids, first, count, 0.25, None, None),
                       KERNEL(q, cache, ids, first, count, 0.25, None, None))


def test_supports_only_what_it_reads() -> None:
    cache = torch.zeros(4, 4, 2, 1, 8)
    assert PagedDecode.supports(torch.zeros(2, 2, 8), cache)
    assert not PagedDecode.supports(torch.zeros(2, 2, 8, dtype=torch.float16), cache.half())
    assert not PagedDecode.supports(torch.zeros(2, 2, 8, dtype=torch.bfloat16), cache)  # a bf16 query, float32 keys
    assert PagedDecode.supports(torch.zeros(2, 2, 8), cache.bfloat16())  # a float32 model's bf16 cache
    assert not PagedDecode.supports(torch.zeros(2, 2, 8), cache.transpose(1, 2).contiguous().transpose(1, 2))


BS, HEADS, KV_HEADS, DIM = 4, 4, 2, 16
WINDOWS, CHUNKS = [None, 6, None], [None, None, 8]  # full, sliding, chunked local


def _decode_step(starts: np.ndarray, cache: torch.Tensor, tables: BlockTables, in_place: bool,
                 softcap: float | None) -> StepAttention:
    n = len(starts)
    return StepAttention([(g, cache[g]) for g in range(len(WINDOWS))], WINDOWS, tables, BS, np.arange(n), starts,
                         np.ones(n, dtype=np.int64), DIM ** -0.5, softcap, torch.device("cpu"), cache.dtype,
                         chunks=CHUNKS, in_place_decode=in_place)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_decode_step_in_place_equals_gather_and_sdpa(dtype, softcap, monkeypatch) -> None:
    """Every layer of a decode step (requests at positions 0 to 29, full / sliding / chunked
    groups) gives the general path's output, and the kernel did compute them."""
    starts = np.array([0, 3, 5, 11, 17, 29])
    n, blocks = len(starts), 8
    tables = consecutive_tables(len(WINDOWS), n, blocks)
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(len(WINDOWS), 1 + len(WINDOWS) * n * blocks, BS, 2, KV_HEADS, DIM, generator=g).to(dtype)
    cache[:, 0] = 0  # the null block
    q = torch.randn(n, HEADS, DIM, generator=g).to(dtype)
    kv = torch.randn(n, 2, KV_HEADS, DIM, generator=g).to(dtype)
    calls = []
    real_call = PagedDecode.__call__
    monkeypatch.setattr(PagedDecode, "__call__", lambda self, *a, **k: calls.append(1) or real_call(self, *a, **k))
    for layer in range(len(WINDOWS)):
        general = _decode_step(starts, cache.clone(), tables, False, softcap).attention(layer, q, kv)
        in_place = _decode_step(starts, cache, tables, True, softcap).attention(layer, q, kv)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(in_place.float(), general.float(), rtol=tol, atol=tol), layer
    assert len(calls) == len(WINDOWS)


@needs_kernel
def test_a_kernel_giving_wrong_outputs_is_not_used(monkeypatch, caplog) -> None:
    """The first-use check: a kernel whose output is off (here by a shifted key run) is
    refused with a warning, and steps gather instead."""
    def shifted(real, self, q, cache, ids, first, count, *rest):  # type: ignore[no-untyped-def]
        return real(self, q, cache, ids, first + 1, count - 1, *rest)

    check_refused(monkeypatch, caplog, PagedDecode, paged_decode, shifted, "gives wrong outputs")


def test_without_a_compiler_the_general_path_serves(monkeypatch) -> None:
    def no_build(*_args):
        raise NativeBuildError("no C compiler")

    monkeypatch.setattr(paged_decode_module, "build", no_build)
    paged_decode.cache_clear()
    try:
        assert paged_decode_module.paged_decode() is None
        tables = BlockTables(len(WINDOWS))
        tables.table[:, 0, :2] = [[1, 2], [3, 4], [5, 6]]
        tables.lengths[:, 0] = 2
        cache = torch.randn(len(WINDOWS), 7, BS, 2, KV_HEADS, DIM)
        step = _decode_step(np.array([5]), cache, tables, True, None)
        assert step.decode_kernel is None
        out = step.attention(0, torch.randn(1, HEADS, DIM), torch.randn(1, 2, KV_HEADS, DIM))
        assert out.shape == (1, HEADS * DIM) and torch.isfinite(out).all()
    finally:
        monkeypatch.undo()
        paged_decode.cache_clear()  # later tests build the kernel again
    assert (attention_module.paged_decode() is None) == (KERNEL is None)
