"""Decode attention read from the paged KV cache in place: the hand-written C kernel of
paged_decode.c (it says how), built by models/platform/native_build.py.

StepAttention (attention.py) takes this fast path for a batch of single-token queries
whose keys are all in the cache (a decode step), and its general path (gather the blocks,
then SDPA with a mask) for everything else, or where the library cannot be built; a test
holds the two to the same outputs."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from hybridserve.models.platform.native_build import build, checked

SOURCE = Path(__file__).with_name("paged_decode.c")
DTYPES = (torch.float32, torch.bfloat16)


class PagedDecode:
    """(q, cache, block ids, first key, key count, scale, ...) -> the attention output."""

    def __init__(self) -> None:
        fn = build("paged_decode", SOURCE).paged_decode_attention
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, ptr, i64, ptr, ptr, i64, i64, ctypes.c_float,
                       ctypes.c_float, ptr, ptr, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32]
        fn.restype = None
        self._fn = fn

    @staticmethod
    def supports(q: torch.Tensor, cache: torch.Tensor) -> bool:
        """Whether the kernel reads this query and cache: a CPU cache of float32 or bf16 with
        every block's [block_size, 2, kv_heads, D] contiguous (a hybrid pool's blocks may be
        further apart), and a query of the same dtype, or a float32 query over a bf16 cache
        (a float32 model keeping its K/V in bf16)."""
        if q.device.type != "cpu" or cache.device.type != "cpu" or cache.dtype not in DTYPES:
            return False
        if q.dtype != cache.dtype and (q.dtype, cache.dtype) != (torch.float32, torch.bfloat16):
            return False
        _, bs, two, kvh, d = cache.shape
        return two == 2 and cache.stride()[1:] == (2 * kvh * d, kvh * d, d, 1) and q.shape[1] % kvh == 0

    def __call__(self, q: torch.Tensor, cache: torch.Tensor, ids: torch.Tensor, first: torch.Tensor,
                 count: torch.Tensor, scale: float, softcap: float | None, sinks: torch.Tensor | None,
                 split_keys: bool = True) -> torch.Tensor:
        """q [B, H, D] -> [B, H, D] in q's dtype: each request's query against keys first[b] ..
        first[b] + count[b] - 1, counted from the start of its blocks ids[b] ([B, NB] int64,
        block ids of `cache` [num_blocks, block_size, 2, KVH, D]). `sinks` [H] or None.
        With fewer (request, kv head) pairs than threads the kernel splits each query's keys
        between threads and joins their softmax states, which rounds otherwise than one
        pass: `split_keys` False runs those on one thread instead (batch invariance)."""
        B, H, D = q.shape
        _, bs, _, kvh, d = cache.shape
        if d != D or ids.shape[0] != B or first.shape != (B,) or count.shape != (B,):
            raise ValueError(f"paged decode: q {tuple(q.shape)}, cache {tuple(cache.shape)}, ids "
                             f"{tuple(ids.shape)}, first {tuple(first.shape)}, count {tuple(count.shape)}")
        if q.stride(2) != 1 or q.stride(1) != D:
            q = q.contiguous()
        ids = ids.contiguous()
        sink_values = None if sinks is None else sinks.to(torch.float32).contiguous()
        out = torch.empty(B, H, D, dtype=q.dtype)
        threads = torch.get_num_threads()
        if not split_keys and B * kvh < threads:
            threads = 1
        self._fn(q.data_ptr(), q.stride(0), cache.data_ptr(), cache.stride(0), bs, kvh, D, ids.data_ptr(),
                 ids.shape[1], first.data_ptr(), count.data_ptr(), B, H, scale, softcap or 0.0,
                 None if sink_values is None else sink_values.data_ptr(), out.data_ptr(),
                 int(cache.dtype == torch.bfloat16), int(q.dtype == torch.bfloat16), threads)
        return out


@cache
def paged_decode() -> PagedDecode | None:
    """The kernel, built and checked on first use; None where it cannot be built (no
    compiler) or its check fails (a miscompile): the general path then serves every step,
    and a warning says why."""
    return checked(PagedDecode, _mismatch, "decode attention gathers its blocks")


def _mismatch(kernel: PagedDecode) -> str:
    """What is wrong with the kernel's output on a small case (grouped heads, a head size
    that is not whole vectors, keys starting mid-block and crossing blocks) against the
    same attention in float64, in each pair of (query, cache) dtypes it reads; '' when
    nothing is."""
    g = torch.Generator().manual_seed(0)
    pairs = [(dtype, dtype) for dtype in DTYPES] + [(torch.float32, torch.bfloat16)]
    # a head size of whole pairs of vectors (attend_pairs, where the cache is bf16) and one of none
    for (q_dtype, dtype), d in ((pair, d) for pair in pairs for d in (20, 64)):
        cache_ = torch.randn(6, 4, 2, 2, d, generator=g).to(dtype)
        q = torch.randn(2, 6, d, generator=g).to(q_dtype)
        ids = torch.tensor([[3, 1, 5], [2, 4, 0]])
        first, count = torch.tensor([1, 2]), torch.tensor([10, 3])
        got = kernel(q, cache_, ids, first, count, 0.5, None, None).double()
        for b in range(2):
            keys = cache_[ids[b]].reshape(-1, 2, 2, d)[int(first[b]) : int(first[b] + count[b])].double()
            for h in range(6):
                weights = torch.softmax(keys[:, 0, h // 3] @ q[b, h].double() * 0.5, dim=0)
                want = weights @ keys[:, 1, h // 3]
                if not torch.allclose(got[b, h], want, rtol=1e-2, atol=1e-2):
                    return f"gives wrong outputs ({q_dtype} over {dtype}, head size {d}, request {b}, head {h})"
    return ""
