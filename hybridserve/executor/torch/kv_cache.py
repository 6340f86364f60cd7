"""Paged KV cache memory: one raw buffer per slot index, shared across KV cache groups.

Layer j of every group uses slot buffer j (see KVCacheConfig): one block id costs
`max(layers per group) * max(page size)` bytes, and a block id belongs to one group at
a time, so groups never overwrite each other. An attention layer views its buffer as

    [num_blocks, block_size, 2 (K, V), num_kv_heads, head_size]     (block-major)

so one token slot holds its K and V side by side: a step writes all its slots with one
index_copy_ and gathers whole blocks with one index_select per layer. A Mamba layer
(MambaSpec) keeps one request's conv state and SSM state, flattened back to back, in
the rows of its slot buffer: one block of each of its page groups (MambaPages).

Block 0 is the null block: it is zero-filled here and never written by the runner, so
a masked read of it is always finite.
"""

from __future__ import annotations

from math import prod

import torch

from hybridserve.config import parse_size
from hybridserve.core.errors import ConfigError
from hybridserve.core.kv.spec import AttentionSpec, KVCacheConfig, KVCacheGroup, MambaSpec, bytes_per_block
from hybridserve.executor.torch.kv_pages import zero_buffers

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype) -> str:
    """TORCH_DTYPES' name of `dtype`."""
    return next(k for k, v in TORCH_DTYPES.items() if v == dtype)

def num_blocks_for_memory(groups: tuple[KVCacheGroup, ...], kv_cache_memory: int | str) -> int:
    """How many blocks (null block included) fit in the budget."""
    budget = parse_size("kv_cache_memory", kv_cache_memory)
    n = budget // bytes_per_block(groups)
    if n < 2:
        raise ConfigError(f"kv_cache_memory {kv_cache_memory!r} holds fewer than 2 blocks "
                          f"({bytes_per_block(groups)} bytes each)")
    return n


def _check_specs(config: KVCacheConfig) -> str:
    """The cache dtype; checks that every attention page has one layout."""
    specs = [g.spec for g in config.groups]
    bad = [type(s).__name__ for s in specs if not isinstance(s, (AttentionSpec, MambaSpec))]
    if bad:
        raise ConfigError(f"the torch runner does not support KV cache spec(s) {sorted(set(bad))} yet")
    attn = [s for s in specs if isinstance(s, AttentionSpec)]
    shapes = {(s.num_kv_heads, s.head_size, s.dtype, s.block_size) for s in attn}
    if len(shapes) > 1:
        raise ConfigError(
            "all attention layers must share one page layout (kv heads, head size, dtype, block size); "
            f"got {sorted(shapes)}"
        )
    dtypes = {s.dtype for s in specs}  # type: ignore[attr-defined]
    if len(dtypes) != 1 or next(iter(dtypes)) not in TORCH_DTYPES:
        raise ConfigError(f"KV cache dtype(s) {sorted(dtypes)} not supported by the torch runner (one of "
                          f"{sorted(TORCH_DTYPES)})")
    return next(iter(dtypes))


def _slot_buffers(count: int, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """`count` zero-filled [rows, cols] buffers. On CPU fresh zero pages that the kernel
    hands out only when written (kv_pages.py, which also picks their page size): a pool
    sized for the default budget (1 GiB) then costs memory only for the blocks requests
    actually fill."""
    nbytes = rows * cols * torch.tensor([], dtype=dtype).element_size()
    if device.type != "cpu" or nbytes == 0:
        return [torch.zeros(rows, cols, dtype=dtype, device=device) for _ in range(count)]
    return [raw.view(dtype).view(rows, cols) for raw in zero_buffers(count, nbytes)]


class MambaPages:
    """One Mamba layer's state in the pool: its elements (conv state, then SSM state,
    flattened) cut into `num_pages` slices, slice k in the block of page group k (see
    MambaSpec), all in the layer's slot buffer. Reads and writes take ids [R, num_pages]."""

    def __init__(self, buffer: torch.Tensor, spec: MambaSpec, page_groups: tuple[int, ...]) -> None:
        self.page_groups = page_groups
        self.page_elems = spec.page_elems
        self.shapes = spec.shapes
        self.sizes = [prod(s) for s in spec.shapes]
        # A page may be narrower than the slot buffer's row (a larger page elsewhere).
        self.pages = buffer if buffer.shape[1] == self.page_elems else buffer[:, : self.page_elems]

    def read(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """Each state part, [R, *shape], gathered from the pages of ids [R, num_pages]."""
        rows = ids.shape[0]
        flat = self.pages.index_select(0, ids.reshape(-1)).view(rows, -1)
        parts = flat[:, : sum(self.sizes)].split(self.sizes, dim=1)
        return [part.reshape(rows, *shape).contiguous() for part, shape in zip(parts, self.shapes)]

    def write(self, ids: torch.Tensor, *parts: torch.Tensor) -> None:
        """Store each request's state parts (as read returns them) into its pages."""
        rows = ids.shape[0]
        flat = torch.cat([p.reshape(rows, -1) for p in parts], dim=1)
        pad = ids.shape[1] * self.page_elems - flat.shape[1]
        if pad:
            flat = torch.nn.functional.pad(flat, (0, pad))
        self.pages.index_copy_(0, ids.reshape(-1), flat.reshape(-1, self.page_elems))


class PagedKVCache:
    """Slot buffers plus, per layer name, its group index and its view: attention layers
    [nb, bs, 2, kvh, d] in `layer_view`; Mamba layers their MambaPages in `state_pages`
    (a state spans one block of each of the layer's page groups)."""

    def __init__(self, config: KVCacheConfig, device: torch.device) -> None:
        dtype = TORCH_DTYPES[_check_specs(config)]
        self.config = config
        self.block_size = config.block_size
        self.num_blocks = config.num_blocks
        elem = torch.tensor([], dtype=dtype).element_size()
        page_elems = max(g.spec.page_size_bytes for g in config.groups) // elem
        num_slots = max(len(g.layer_names) for g in config.groups)
        self.buffers = _slot_buffers(num_slots, config.num_blocks, page_elems, dtype, device)
        self.layer_group: dict[str, int] = {}
        self.layer_view: dict[str, torch.Tensor] = {}
        self.state_pages: dict[str, MambaPages] = {}
        page_groups: dict[tuple[str, ...], list[int]] = {}  # a Mamba group's layers -> its page groups
        for gi, group in enumerate(config.groups):
            if isinstance(group.spec, MambaSpec):
                page_groups.setdefault(group.layer_names, []).append(gi)
        for gi, group in enumerate(config.groups):
            spec = group.spec
            for j, name in enumerate(group.layer_names):
                if isinstance(spec, MambaSpec):
                    if spec.page_index == 0:
                        self.layer_group[name] = gi
                        self.state_pages[name] = MambaPages(self.buffers[j], spec, tuple(page_groups[group.layer_names]))
                    continue
                assert isinstance(spec, AttentionSpec)
                self.layer_group[name] = gi
                # Attention pages all have one size, so without Mamba groups the view is
                # contiguous and flattens to token slots; a larger Mamba page leaves gaps
                # between blocks (StepAttention then writes by (block, offset)).
                self.layer_view[name] = self.buffers[j][:, : spec.page_size_bytes // elem].view(
                    config.num_blocks, spec.block_size, 2, spec.num_kv_heads, spec.head_size
                )

    @property
    def num_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)
