"""Paged attention in plain PyTorch, exact at chunk, block and window boundaries.

For a request whose step computes positions s..s+c-1 (its chunk), a query at position
p attends to keys lo(p)..p, where the per-query lower bound is

    full attention        lo(p) = 0
    sliding window W      lo(p) = max(0, p-W+1)
    chunked local, size A lo(p) = (p // A) * A        (A: attention_chunk_size)

lo never decreases with p, so the step reads nothing before lo(s). The chunk's K/V is
written only to slots whose block id is not the null block 0. Keys come from one of
two places, chosen per group:

- read-after-write: when every slot of the step is a real block (always under plain
  allocation, and for decodes under window-tail allocation), the step first writes its
  K/V, then gathers positions lo(s)..s+c-1 from the blocks;
- from the batch: when some slot of the step is the null block (window-tail
  allocation), positions lo(s)..s-1 come from the blocks and the chunk's own keys
  from the batch, so no value of a null slot is used.

Gathers take whole blocks, so a null block (a window's skipped blocks, padding rows) can
be gathered beside real ones; its positions are masked out. A mask only works on finite
scores, so this relies on block 0 staying finite: kv_cache.py zero-fills it and the
runner never writes it (a test checks that it is still all zeros after serving).

The cache is in the model's dtype, or in bf16 under a float32 model (EngineConfig's
kv_cache_dtype): K/V are then rounded as they are written, and the chunk's own keys read
from the batch are the rounded ones too, so attention reads the same values either way.

Requests are computed in padded batches: all decode-sized requests together (one
gather per layer, no per-request loop), long prefill chunks one by one. A batch of
single-token queries reading after write (a decode step) skips the gather: the kernel of
paged_decode.py reads its keys from the blocks in place. Such a step's plans are made by
StepAttention._plan_decode, a fast path beside the general planner that gives its plans.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import torch
import torch.nn.functional as F

from hybridserve.executor.torch.decode_plan import native_decode_plan
from hybridserve.executor.torch.paged_decode import PagedDecode, paged_decode
from hybridserve.executor.torch.requests import BlockTables
from hybridserve.models.platform.cpu_features import read_cpu_flags

# Dtypes whose CPU attention runs on float32 copies: ATen's CPU flash attention in bfloat16
# is several times slower than the conversions to float32 and back plus float32 attention
# on CPUs without AMX (`python benchmarks/attention_dtype.py`; benchmarks/results/attention_dtype.md).
# With AMX's bfloat16 tiles it is the other way round, decode and prefill alike, so there
# bfloat16 attention runs as it is (native_half_dtypes).
HALF_DTYPES = (torch.bfloat16, torch.float16)
# Requests with at most this many query tokens share one padded batch.
SMALL_CHUNK = 16
# (batch index, sliding window, attention chunk size, keys from the batch)
_PlanKey = tuple[int, int | None, int | None, bool]


@dataclass
class BatchLayout:
    """Which requests one attention call computes, and how its queries map to flat rows."""

    req: np.ndarray  # indices into the step's request list
    B: int
    C: int  # padded query length
    row_slice: tuple[int, int] | None  # contiguous flat rows when no padding is needed
    q_gather: torch.Tensor | None  # [B*C] flat rows (padding -> row 0) otherwise
    valid_rows: torch.Tensor | None  # flat rows of the non-padding queries
    valid_sel: torch.Tensor | None  # their positions in the padded [B*C]


@dataclass
class KeyPlan:
    """Per (batch, window, mode): the blocks to gather and the mask over the keys."""

    first_blk: np.ndarray  # [B] first gathered block column per request
    num_blocks: int  # NB gathered per request (padded)
    from_batch: bool  # True: keys = gathered cached part + the chunk's own keys
    # [B, 1, C, keys] additive (0 or -inf; SDPA's CPU kernel is faster with a float mask
    # than a bool one); None: plain causal over the chunk. A decode plan builds it on first
    # use (decode_mask), since the in-place decode kernel reads first_key / key_count instead.
    _mask: torch.Tensor | None
    # Single-token queries reading after write: per request, the first key position counted
    # from the start of its first gathered block, and the number of keys (the mask's
    # allowed run, for the in-place decode kernel); None otherwise.
    first_key: torch.Tensor | None = None
    key_count: torch.Tensor | None = None
    _pending: tuple[np.ndarray, np.ndarray, int, torch.device, torch.dtype] | None = None  # decode_mask's inputs

    @property
    def mask(self) -> torch.Tensor | None:
        if self._pending is not None:
            self._mask, self._pending = decode_mask(self.first_blk, *self._pending, self.num_blocks), None
        return self._mask


@dataclass
class GroupPlan:
    slots: torch.Tensor  # [Tw] token slots (block id * bs + offset) written this step
    write_sel: torch.Tensor | None  # [Tw] flat rows written (None: all rows, in order)
    gather_ids: list[torch.Tensor | None]  # per batch: [B * NB] block ids, None if NB == 0
    plans: list[KeyPlan]  # per batch


class StepAttention:
    """The AttentionBackend of one step: built once, then called by every layer."""

    def __init__(self, layers: list[tuple[int, torch.Tensor]], groups: list[int | None], tables: BlockTables,
                 block_size: int, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray, scale: float,
                 softcap: float | None, device: torch.device, dtype: torch.dtype,
                 chunks: list[int | None] | None = None, in_place_decode: bool = True,
                 per_token: bool = False, num_tokens: int | None = None) -> None:
        """`layers[i]` = (group, cache view) of model layer i; `groups[g]` = window of group g
        (None: not sliding); `chunks[g]` = attention chunk size of a chunked-local group g
        (None or omitted: not chunked); rows/starts/counts: per request of the step.
        `in_place_decode`: decode batches read the blocks in place where the kernel is
        built (False: always gather, the general path). `per_token` (a batch-invariant
        model's steps): every token is a query of its own, its keys read back from the
        cache after the step's writes by the in-place kernel, which never splits a query's
        keys between threads: each row's attention is then computed alike whatever the
        step holds (RuntimeError where the kernel is not built, or a token has no block).
        `num_tokens`: counts' sum where the caller has it (a numpy sum after the step's
        kernels costs tens of microseconds)."""
        self.layers = layers
        self.decode_kernel: PagedDecode | None = paged_decode() if in_place_decode else None
        self.per_token = per_token
        if per_token:
            if self.decode_kernel is None:
                raise RuntimeError("batch-invariant attention needs the in-place decode kernel (a C compiler)")
            if int(counts.sum()) != len(counts):  # each token a request of one, at its position
                req_offsets = np.cumsum(counts) - counts
                tok_req = np.repeat(np.arange(len(counts)), counts)
                starts = starts[tok_req] + (np.arange(len(tok_req)) - req_offsets[tok_req])
                rows, counts = rows[tok_req], np.ones(len(tok_req), dtype=counts.dtype)
        self.scale = scale
        self.softcap = softcap
        self.num_tokens = T = int(counts.sum()) if num_tokens is None else num_tokens
        bs = block_size
        chunk_of = chunks if chunks is not None else [None] * len(groups)
        self._batches: list[BatchLayout] | None = None
        self._groups: list[GroupPlan] | None = None
        self._handed: list[tuple[torch.Tensor, ...]] = []  # decode_plan_addresses' arrays, kept alive
        self.planned_decode = T == len(counts) and self._plan_decode(groups, chunk_of, tables, bs, rows, starts,
                                                                     device, dtype)
        if self.planned_decode:
            return
        offsets = np.cumsum(counts) - counts
        self._batches = _partition(counts, offsets, device)
        if T == len(counts):  # a pure decode step: one token per request
            tok_pos, tok_rows = starts, rows
        else:
            tok_req = np.repeat(np.arange(len(counts)), counts)
            tok_pos = np.repeat(starts - offsets, counts) + np.arange(T)
            tok_rows = rows[tok_req]
        blk_col = tok_pos // bs
        if np.any(blk_col >= tables.lengths[:, tok_rows]):
            raise RuntimeError("a scheduled token has no block in its table (scheduler and runner out of sync)")
        blk = tables.table[:, tok_rows, blk_col]  # [G, T]: every group looked up at once
        real = blk != 0
        all_real = real.all(axis=1)
        slots = torch.from_numpy(blk * bs + tok_pos % bs).to(device)
        # Groups that share (window, chunk, read mode) share their key plans and gather together.
        plans: dict[_PlanKey, KeyPlan] = {}
        by_plan: dict[_PlanKey, list[int]] = {}
        if per_token and not all_real.all():
            raise RuntimeError("batch-invariant attention reads every token's keys back: a token has no block "
                               "(window-tail allocation must be off)")
        for b, layout in enumerate(self.batches):
            # Nothing cached for any request of the batch: its keys are all in the batch.
            nothing_cached = not starts[layout.req].any() and not per_token
            for g, window in enumerate(groups):
                by_plan.setdefault((b, window, chunk_of[g], nothing_cached or not all_real[g]), []).append(g)
        gather_ids: dict[tuple[int, int], torch.Tensor | None] = {}
        for key, gs in by_plan.items():
            b, window, chunk, from_batch = key
            layout = self.batches[b]
            plan = plans[key] = _key_plan(layout, starts, counts, window, bs, from_batch, device, dtype, chunk)
            if plan.num_blocks == 0:
                gather_ids.update({(g, b): None for g in gs})
                continue
            cols = plan.first_blk[:, None] + np.arange(plan.num_blocks)[None, :]
            ids = torch.from_numpy(tables.gather(gs, rows[layout.req], cols).reshape(len(gs), -1)).to(device)
            gather_ids.update({(g, b): ids[k] for k, g in enumerate(gs)})
        plan_of = {(g, key[0]): plans[key] for key, gs in by_plan.items() for g in gs}
        self._groups = []
        for g in range(len(groups)):
            sel = None if all_real[g] else np.nonzero(real[g])[0]
            self._groups.append(GroupPlan(
                slots=slots[g] if sel is None else slots[g][torch.from_numpy(sel).to(device)],
                write_sel=None if sel is None else torch.from_numpy(sel).to(device),
                gather_ids=[gather_ids[(g, b)] for b in range(len(self.batches))],
                plans=[plan_of[(g, b)] for b in range(len(self.batches))],
            ))

    def _plan_decode(self, groups: list[int | None], chunks: list[int | None], tables: BlockTables, bs: int,
                     rows: np.ndarray, starts: np.ndarray, device: torch.device, dtype: torch.dtype) -> bool:
        """The plans __init__'s general path makes for a decode step (one token per request)
        whose every token has a real block in every group and some request has keys cached
        (or the steps are batch-invariant), made in one native call (decode_plan.c): one
        batch without padding, every group reading after write, one key plan per (window,
        chunk). True once set; False (nothing set) for other decode steps, and where the
        planner is not built: the general path plans those. The step's GroupPlans and
        BatchLayout are made from the native plan only when something reads them (the
        model's own layer loop); the decode stack reads its addresses
        (decode_plan_addresses). Why: a decode step is most steps, and its plan runs between
        kernels that have evicted the caches, where each numpy and torch call costs several
        times its warm time (tests/executor/test_decode_key_plan.py: the same plans)."""
        planner = native_decode_plan()
        if planner is None:
            return False
        plan = planner(tables, np.ascontiguousarray(rows, dtype=np.int64), np.ascontiguousarray(starts, dtype=np.int64),
                       bs, tuple(groups), tuple(chunks), self.per_token)
        if plan is None:
            return False  # a null slot (window-tail allocation), or every key in the batch
        self._native_plan, self._plan_device, self._plan_dtype, self._plan_bs = plan, device, dtype, bs
        return True

    @property
    def batches(self) -> list[BatchLayout]:
        if self._batches is None:  # a natively planned decode step: one batch, no padding
            n = self.num_tokens
            self._batches = [BatchLayout(np.arange(n), n, 1, (0, n), None, None, None)]
        return self._batches

    @property
    def groups(self) -> list[GroupPlan]:
        if self._groups is None:
            self._groups = self._groups_of_native_plan()
        return self._groups

    def _groups_of_native_plan(self) -> list[GroupPlan]:
        """The GroupPlans of a natively planned decode step, as the general path makes them."""
        plan, device, dtype, bs = self._native_plan, self._plan_device, self._plan_dtype, self._plan_bs
        key_plans = []
        for p, nb in enumerate(plan.num_blocks):
            first, count, first_blk = plan.run(p)
            lo = first_blk * bs + first
            key_plans.append(KeyPlan(first_blk, nb, False, None, first_key=torch.from_numpy(first).to(device),
                                     key_count=torch.from_numpy(count).to(device),
                                     _pending=(lo, lo + count, bs, device, dtype)))
        return [GroupPlan(slots=torch.from_numpy(plan.slots(g)).to(device), write_sel=None,
                          gather_ids=[torch.from_numpy(plan.ids(g)).reshape(-1).to(device)],
                          plans=[key_plans[plan.plan_of[g]]])
                for g in range(len(plan.plan_of))]

    def decode_plan(self, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(slots [T], block ids [T, NB], first key [T], key count [T]) of `group`, all int64
        and contiguous, where this step is what `attention` hands the in-place decode kernel
        for it: one token per request, every token written to its slot, no padding. None
        otherwise (models/arch/decode_stack.py then leaves the step to the model's loop)."""
        if self.decode_kernel is None or len(self.batches) != 1 or self.batches[0].row_slice != (0, self.num_tokens):
            return None
        gp = self.groups[group]
        plan, ids = gp.plans[0], gp.gather_ids[0]
        if gp.write_sel is not None or plan.key_count is None or plan.first_key is None or ids is None:
            return None
        return gp.slots.contiguous(), ids.view(self.num_tokens, -1).contiguous(), plan.first_key, plan.key_count

    def decode_plan_addresses(self, group: int) -> tuple[int, int, int, int, int] | None:
        """decode_plan(group)'s arrays as (slots, block ids, first key, key count addresses,
        blocks per request), valid while this step lives; a natively planned step's without
        making a tensor."""
        if self.planned_decode and self.decode_kernel is not None and self._plan_device.type == "cpu":
            return self._native_plan.addresses(group)
        handed = self.decode_plan(group)
        if handed is None:
            return None
        slots, ids, first, count = handed
        self._handed.append(handed)
        return slots.data_ptr(), ids.data_ptr(), first.data_ptr(), count.data_ptr(), ids.shape[1]

    def attention(self, layer_idx: int, q: torch.Tensor, kv: torch.Tensor, sinks: torch.Tensor | None = None
                  ) -> torch.Tensor:
        """q [T, H, D], kv [T, 2, KVH, D] -> [T, H*D] (q's dtype); also stores this step's K/V,
        converted to the cache's dtype where it differs (a float32 model's bf16 cache).
        `sinks` [H]: a learned logit per head that joins each softmax's denominator only (gpt-oss)."""
        g, cache = self.layers[layer_idx]  # cache: [num_blocks, bs, 2, KVH, D]
        gp = self.groups[g]
        if kv.dtype != cache.dtype:
            # A float32 model keeping K/V in bf16 (executor.py): the chunk's own keys, where
            # read from the batch, are the rounded ones the cache holds, so a token's
            # attention does not depend on whether its keys were cached or in its step.
            stored = kv.to(cache.dtype)
            if any(p.from_batch or p.num_blocks == 0 for p in gp.plans):
                kv = stored.to(kv.dtype)
            kv_written = stored
        else:
            kv_written = kv
        if gp.slots.numel():
            src = kv_written if gp.write_sel is None else kv_written[gp.write_sel]
            src = src.reshape(src.shape[0], -1)
            if cache.is_contiguous():
                cache.view(-1, src.shape[1]).index_copy_(0, gp.slots, src)
            else:  # a hybrid pool (Mamba state pages are larger): gaps between blocks' rows
                bs = cache.shape[1]
                cache.view(cache.shape[0], bs, -1).index_put_((gp.slots // bs, gp.slots % bs), src)
        T, H, D = q.shape
        if len(self.batches) == 1 and self.batches[0].row_slice is not None:
            return self._batch(0, self.batches[0], gp, cache, q, kv, sinks).reshape(T, H * D)
        flat = q.new_empty(T, H * D)
        for b, layout in enumerate(self.batches):
            out = self._batch(b, layout, gp, cache, q, kv, sinks).reshape(layout.B * layout.C, H * D)
            if layout.row_slice is not None:
                flat[layout.row_slice[0] : layout.row_slice[1]] = out
            else:
                flat[layout.valid_rows] = out[layout.valid_sel]
        return flat

    def _batch(self, b: int, layout: BatchLayout, gp: GroupPlan, cache: torch.Tensor, q: torch.Tensor,
               kv: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
        """Attention of one padded batch -> [B, C, H, D]."""
        B, C = layout.B, layout.C
        _, H, D = q.shape
        plan = gp.plans[b]
        if layout.row_slice is not None:
            a, e = layout.row_slice
            qb = q[a:e].view(B, C, H, D)
            fresh = kv[a:e].view(B, C, *kv.shape[1:]) if plan.from_batch or plan.num_blocks == 0 else None
        else:
            qb = q[layout.q_gather].view(B, C, H, D)
            fresh = kv[layout.q_gather].view(B, C, *kv.shape[1:]) if plan.from_batch or plan.num_blocks == 0 else None
        ids = gp.gather_ids[b]
        if (plan.key_count is not None and layout.row_slice is not None and self.decode_kernel is not None
                and self.decode_kernel.supports(q, cache)):
            a, e = layout.row_slice
            out = self.decode_kernel(q[a:e], cache, ids.view(B, -1), plan.first_key, plan.key_count, self.scale,
                                     self.softcap, sinks, split_keys=not self.per_token)
            return out.view(B, C, H, D)
        if ids is None:
            keys = fresh  # nothing cached and nothing written: the chunk's own keys
        else:
            # Gather whole blocks as flat rows (a plain row copy), then view as token slots.
            keys = cache.view(cache.shape[0], -1).index_select(0, ids).view(B, -1, *cache.shape[2:])
            if keys.dtype != q.dtype:  # a bf16 cache under a float32 model
                keys = keys.to(q.dtype)
            if plan.from_batch:
                keys = torch.cat((keys, fresh), dim=1)
        assert keys is not None
        out = self._sdpa(qb.transpose(1, 2), keys[:, :, 0].transpose(1, 2), keys[:, :, 1].transpose(1, 2), plan.mask,
                         sinks)
        return out.transpose(1, 2)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, H, C, D], k/v [B, KVH, N, D], mask [B, 1, C, N], sinks [H] -> [B, H, C, D]."""
        if self.softcap is None and sinks is None:
            if q.device.type == "cpu" and q.dtype in HALF_DTYPES and q.dtype not in native_half_dtypes():
                # ATen's CPU flash attention is far slower in bfloat16 than in float32 on
                # CPUs without AMX (see HALF_DTYPES): run it on float32 copies.
                out = self._sdpa(q.float(), k.float(), v.float(), None if mask is None else mask.float())
                return out.to(q.dtype)
            if mask is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
        # Soft-capping and sinks sit between the scores and the softmax: no fused kernel for them.
        B, H, C, D = q.shape
        kvh, N = k.shape[1], k.shape[2]
        qg = q.reshape(B, kvh, H // kvh * C, D)  # query heads of one kv head, then positions
        scores = torch.matmul(qg, k.transpose(-1, -2)) * self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is None:
            causal = torch.ones(C, N, dtype=torch.bool, device=q.device).tril(N - C)
            mask = torch.zeros(C, N, dtype=q.dtype, device=q.device).masked_fill_(~causal, float("-inf"))
        scores = scores.view(B, kvh, H // kvh, C, N) + mask.view(-1, 1, 1, C, N)
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            probs = softmax_with_sinks(scores, sinks.view(1, kvh, H // kvh, 1, 1))
        probs = probs.view(B, kvh, H // kvh * C, N)
        return torch.matmul(probs, v).view(B, H, C, D)


@cache
def native_half_dtypes() -> frozenset[torch.dtype]:
    """The half-precision dtypes CPU attention computes in as they are, not on float32
    copies: bfloat16 where the CPU has AMX's bfloat16 tiles (see HALF_DTYPES)."""
    return frozenset({torch.bfloat16}) if "amx_bf16" in read_cpu_flags() else frozenset()


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim as if one more key, whose score is the (broadcast) sink,
    were there with a zero value: the sink only enlarges the denominator, so a head may
    attend to nothing. Computed as HF's gpt-oss does: softmax of [scores, sink], sink dropped."""
    sink_column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat((scores, sink_column), dim=-1), dim=-1)[..., :-1]


def _partition(counts: np.ndarray, offsets: np.ndarray, device: torch.device) -> list[BatchLayout]:
    """One padded batch when padding is cheap; else small chunks together, big ones alone."""
    n, total, cmax = len(counts), int(counts.sum()), int(counts.max())
    if cmax <= 1 or n == 1:
        return [BatchLayout(np.arange(n), n, cmax, (0, total), None, None, None)]
    if cmax <= SMALL_CHUNK or n * cmax <= 2 * total:
        return [_padded(np.arange(n), counts, offsets, device)]
    small = np.nonzero(counts <= SMALL_CHUNK)[0]
    out = [_padded(small, counts, offsets, device)] if len(small) else []
    for i in np.nonzero(counts > SMALL_CHUNK)[0]:
        a = int(offsets[i])
        out.append(BatchLayout(np.array([i]), 1, int(counts[i]), (a, a + int(counts[i])), None, None, None))
    return out


def _padded(req: np.ndarray, counts: np.ndarray, offsets: np.ndarray, device: torch.device) -> BatchLayout:
    c = counts[req]
    B, C = len(req), int(c.max())
    if np.all(c == C) and np.all(np.diff(offsets[req]) == C):
        # Equal lengths, adjacent rows (decodes; a burst of equal prompts): no padding, so
        # the batch is a view of the flat rows, with no gather in or scatter out.
        a = int(offsets[req[0]])
        return BatchLayout(req, B, C, (a, a + B * C), None, None, None)
    j = np.arange(C)[None, :]
    valid = j < c[:, None]
    rows = offsets[req][:, None] + j
    flat_valid = valid.reshape(-1)
    return BatchLayout(
        req, B, C, None,
        torch.from_numpy(np.where(valid, rows, 0).reshape(-1)).to(device),
        torch.from_numpy(rows.reshape(-1)[flat_valid]).to(device),
        torch.from_numpy(np.nonzero(flat_valid)[0]).to(device),
    )


def _key_plan(layout: BatchLayout, starts: np.ndarray, counts: np.ndarray, window: int | None, bs: int,
              from_batch: bool, device: torch.device, dtype: torch.dtype, chunk: int | None = None) -> KeyPlan:
    s = starts[layout.req]
    c = counts[layout.req]
    C = layout.C
    # [B, C] query positions; padding queries repeat the last real one, so their mask rows
    # are never all -inf (a chunked bound past the request's last key would make them so).
    qp = s[:, None] + np.minimum(np.arange(C)[None, :], c[:, None] - 1)
    if window is not None:
        qlo = np.maximum(0, qp - window + 1)
    elif chunk is not None:
        qlo = qp // chunk * chunk
    else:
        qlo = np.zeros_like(qp)
    lo = qlo[:, 0]  # the first query's bound is the smallest
    # Gathered positions: lo..s-1 (from the batch) or lo..s+c-1 (read after write).
    end = s if from_batch else s + c
    first_blk = lo // bs
    nblk = np.where(end > lo, (end - 1) // bs - first_blk + 1, 0)
    NB = int(nblk.max())
    if C == 1 and NB and not from_batch:
        # A decode query at s reads the run lo..s: where it starts in the gathered blocks and
        # its length (the in-place kernel's operands); the mask only where SDPA needs it.
        return KeyPlan(first_blk, NB, False, None,
                       first_key=torch.from_numpy((lo - first_blk * bs).astype(np.int64)).to(device),
                       key_count=torch.from_numpy((end - lo).astype(np.int64)).to(device),
                       _pending=(lo, end, bs, device, dtype))
    if NB == 0 and layout.B == 1 and window is None and chunk is None:
        return KeyPlan(first_blk, 0, True, _mask=None)  # a first chunk under full attention: plain causal
    parts = []
    if NB:
        kp, in_range = _keys_in_range(first_blk, lo, end, bs, NB)
        if C == 1:  # a decode query reading from the batch: in range is causal and in window
            parts.append(in_range[:, None, :])
        else:
            parts.append(in_range[:, None, :] & (kp[:, None, :] <= qp[:, :, None])
                         & (kp[:, None, :] >= qlo[:, :, None]))
    if (from_batch or NB == 0) and C == 1:
        parts.append(np.ones((layout.B, 1, 1), dtype=bool))  # a decode query sees its own key
    elif from_batch or NB == 0:
        j = np.arange(C)
        ok = (j[None, None, :] <= j[None, :, None]) & (j[None, None, :] < c[:, None, None])
        key_pos = s[:, None] + j[None, :]  # [B, C] positions of the chunk's own keys
        parts.append(ok & (key_pos[:, None, :] >= qlo[:, :, None]))
    allowed = np.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]
    if NB == 0 and np.array_equal(allowed, np.broadcast_to(np.tri(C, dtype=bool), allowed.shape)):
        # Every query sees exactly the chunk's keys up to itself (first chunks of equal
        # length within the window): SDPA's own causal form, which skips the masked blocks.
        return KeyPlan(first_blk, 0, True, _mask=None)
    return KeyPlan(first_blk, NB, from_batch or NB == 0, additive_mask(allowed, device, dtype))


def additive_mask(allowed: np.ndarray, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[B, C, keys] bool -> SDPA's [B, 1, C, keys] additive mask: 0 where allowed, else -inf."""
    return torch.from_numpy(np.where(allowed[:, None], np.float32(0), np.float32(-np.inf))).to(device, dtype)


def decode_mask(first_blk: np.ndarray, lo: np.ndarray, end: np.ndarray, bs: int, device: torch.device,
                dtype: torch.dtype, num_blocks: int) -> torch.Tensor:
    """The mask of single-token queries reading after write: over the num_blocks blocks
    gathered from first_blk, each query sees the keys lo..end-1 (in range is causal and in
    window already)."""
    return additive_mask(_keys_in_range(first_blk, lo, end, bs, num_blocks)[1][:, None, :], device, dtype)


def _keys_in_range(first_blk: np.ndarray, lo: np.ndarray, end: np.ndarray, bs: int,
                   num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """([B, num_blocks*bs] key positions of the blocks gathered from first_blk, whether each
    is within its request's lo..end-1)."""
    kp = first_blk[:, None] * bs + np.arange(num_blocks * bs)[None, :]
    return kp, (kp >= lo[:, None]) & (kp < end[:, None])
