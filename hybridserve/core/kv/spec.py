"""KV cache specs: what one layer stores per block, and how many blocks a request may hold.

Every spec is a frozen dataclass, so equal layers compare (and hash) equal and fall into
the same KV cache group. All groups share one block pool and one block size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import prod

from hybridserve.core.errors import ConfigError

# Tokens per KV block when none is chosen: the one definition the engine, the simulator,
# the executors' pool builders and the test helpers default to.
DEFAULT_BLOCK_SIZE = 16

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8": 1,
    "int8": 1,
}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dtype_size(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ConfigError(f"unknown KV cache dtype {dtype!r}; use one of {sorted(DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class WindowTail:
    """Window-tail allocation is on: a step's in-chunk keys come from the batch itself,
    so a sliding-window group needs real blocks only for the retained window and the
    tail of each scheduled chunk (see SlidingWindowSpec.max_admission_blocks_per_request).
    """

    max_in_flight_steps: int
    max_draft_tokens: int = 0


def blocks_touched(num_tokens: int, block_size: int) -> int:
    """Most blocks a run of num_tokens consecutive positions can touch (any alignment)."""
    return 0 if num_tokens <= 0 else 1 + cdiv(num_tokens - 1, block_size)


@dataclass(frozen=True)
class KVCacheSpec:
    """Base of all specs. `block_size` tokens share one block id."""

    block_size: int

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")

    @property
    def page_size_bytes(self) -> int:
        """Bytes one layer of this spec stores in one block."""
        raise NotImplementedError

    def max_admission_blocks_per_request(
        self, max_in_flight_tokens: int, max_model_len: int, window_tail: WindowTail | None = None
    ) -> int:
        """Most blocks one request of this group can hold at once.

        Admission control and startup sizing both call this, so the two never disagree.
        """
        raise NotImplementedError


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int
    head_size: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_kv_heads < 1 or self.head_size < 1:
            raise ConfigError(f"num_kv_heads and head_size must be >= 1, got {self.num_kv_heads}, {self.head_size}")
        dtype_size(self.dtype)

    @property
    def page_size_bytes(self) -> int:
        # K and V for every token slot of the block.
        return 2 * self.block_size * self.num_kv_heads * self.head_size * dtype_size(self.dtype)


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Every token attends to every earlier token: nothing is ever out of window."""

    def max_admission_blocks_per_request(
        self, max_in_flight_tokens: int, max_model_len: int, window_tail: WindowTail | None = None
    ) -> int:
        return cdiv(max_model_len, self.block_size)


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """Token n attends to n-W+1..n.

    A request holds the W-1 processed tokens still in the window plus everything in
    flight; the window may start mid-block, hence one extra block::

        settled window (W-1) | in flight (max_in_flight_tokens)
        [..|xxxx|xxxx|xxxx|xx..]   <- +1 block for the misaligned start
    """

    sliding_window: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window < 1:
            raise ConfigError(f"sliding_window must be >= 1, got {self.sliding_window}")

    def max_admission_blocks_per_request(
        self, max_in_flight_tokens: int, max_model_len: int, window_tail: WindowTail | None = None
    ) -> int:
        """Settled basis: cdiv(min(W - 1 + max_in_flight_tokens, max_model_len), bs) + 1.

        With window-tail allocation (k = max_in_flight_steps, d = max_draft_tokens)::

            touch(L) = 1 + cdiv(L - 1, bs)    most blocks L consecutive tokens can touch
            cap      = min(settled, touch(W - 1) + k * touch(W - 1 + d))

        Proof. At allocation time, after pruning on the processed count P, a request's
        real blocks are those of (a) the retained window P-W+1 .. P-1, which the oldest
        in-flight step reads from the cache, and (b) each scheduled chunk s..e's tail,
        the last W-1+d positions e-W-d+2 .. e (clipped to the chunk), which later steps
        read, even after up to d rejected drafts pull the next start back to e+1-d.
        Every other slot of a chunk gets the null block: only the chunk's own queries
        read it, from the batch. At most k chunks are in flight counting the one being
        allocated, and the window is W-1 tokens, so real blocks <= touch(W-1) +
        k * touch(W-1+d); never more than the settled basis holds. The cap does not
        depend on max_num_batched_tokens.
        """
        tokens = min(self.sliding_window - 1 + max_in_flight_tokens, max_model_len)
        settled = cdiv(tokens, self.block_size) + 1
        if window_tail is None:
            return settled
        w, bs = self.sliding_window - 1, self.block_size
        tail = blocks_touched(w, bs) + window_tail.max_in_flight_steps * blocks_touched(w + window_tail.max_draft_tokens, bs)
        return min(settled, tail)


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Token n attends to its own chunk: (n // C) * C .. n.

    A request holds at most the current chunk (C tokens) plus everything in flight.
    Chunks start on multiples of C, and C is a multiple of the block size in every
    real model, so no extra block is needed for misalignment.
    """

    attention_chunk_size: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.attention_chunk_size < 1:
            raise ConfigError(f"attention_chunk_size must be positive, got {self.attention_chunk_size}")
        if self.attention_chunk_size % self.block_size:
            # Block sizes are powers of two: the largest that divides the chunk is its lowest set bit.
            fits = self.attention_chunk_size & -self.attention_chunk_size
            raise ConfigError(
                f"attention_chunk_size={self.attention_chunk_size} is not a multiple of block_size="
                f"{self.block_size}; use --block-size {fits} (block_size={fits}), the largest that divides it"
            )

    def max_admission_blocks_per_request(
        self, max_in_flight_tokens: int, max_model_len: int, window_tail: WindowTail | None = None
    ) -> int:
        tokens = min(self.attention_chunk_size + max_in_flight_tokens, max_model_len)
        return cdiv(tokens, self.block_size)


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """A state-space layer: a fixed-size state (conv state and SSM state), not per-token KV.

    Two layouts of a request's table:

    - `block_checkpoints=False`: 1 + num_speculative_blocks state blocks, whatever the
      length; column 0 carries the state. No prefix hits are possible. The engine and
      the simulator pass num_speculative_blocks=0: a verify chunk's per-token states
      stay outside the pool (the torch runner's TokenStates), so drafts need no block.
    - `block_checkpoints=True` (prefix caching on, see `with_mamba_checkpoints`): the
      table is positional like attention's, and block i holds the state after the
      tokens up to the end of block i; the running state lives in the block of the last
      computed token, so once a request passes a block boundary that block is a frozen
      checkpoint, published under the prefix's block hash (the request keeps the last
      one, for a KV connector to store at its finish)::

          tokens  0..15 | 16..31 | 32..39
          blocks  [S16]   [S32]    [S40 running]    (bs 16, 40 tokens computed)

      A step over s..e-1 reads block (s-1)//bs, writes the state at every boundary it
      crosses into that boundary's block and its final state into block (e-1)//bs.
      Older blocks are freed (they stay cached until evicted).

    Pages (`num_pages` > 1): a state bigger than the pool's page is cut into num_pages
    slices of its flattened elements; slice k lives in its own KV cache group (same
    layers, `page_index` k), so a state costs num_pages small blocks and every group of
    the pool keeps one page size. The page groups make identical decisions, and a prefix
    hit needs every slice (the coordinator already requires every group to agree).

    Running state in place (`running_in_place`, what the engine uses with prefix
    caching, see `with_mamba_checkpoints` and InPlaceMambaManager): the table is
    positional, but its last entry is always the running block, which every step reads
    and writes in place and which moves to the new last entry when the table grows; the
    entries it leaves get checkpoint blocks only when the pool has some to spare.
    """

    shapes: tuple[tuple[int, ...], ...] = ()
    dtype: str = "float32"
    num_speculative_blocks: int = 0
    block_checkpoints: bool = False
    num_pages: int = 1
    page_index: int = 0
    # In place: the running state stays in one block, the table's last entry, for the
    # request's life; checkpoints are best-effort blocks outside the admission cap.
    running_in_place: bool = False
    # In place: hold the last whole-block checkpoint below the running state (what a KV
    # connector stores at a request's finish); without a connector it is only cached.
    keep_last_checkpoint: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_speculative_blocks < 0:
            raise ConfigError(f"num_speculative_blocks must be >= 0, got {self.num_speculative_blocks}")
        if not 0 <= self.page_index < self.num_pages:
            raise ConfigError(f"page_index must be in [0, num_pages={self.num_pages}), got {self.page_index}")
        dtype_size(self.dtype)

    @property
    def state_elems(self) -> int:
        """Elements of one layer's whole state (conv + SSM), all pages together."""
        return sum(prod(s) for s in self.shapes)

    @property
    def page_elems(self) -> int:
        """Elements of one page: the state cut into num_pages equal slices (the last padded)."""
        return cdiv(self.state_elems, self.num_pages)

    @property
    def state_size_bytes(self) -> int:
        return self.state_elems * dtype_size(self.dtype)

    @property
    def page_size_bytes(self) -> int:
        return self.page_elems * dtype_size(self.dtype)

    @property
    def num_state_blocks(self) -> int:
        return 1 + self.num_speculative_blocks

    def max_admission_blocks_per_request(
        self, max_in_flight_tokens: int, max_model_len: int, window_tail: WindowTail | None = None
    ) -> int:
        """State blocks; with checkpoints in place (k steps and d drafts in flight alike)::

            cap = 1   the running state: every step reads and writes it in place, so a
                      state written by step N is read by step N+1 after N finishes

        What else a request holds is not required: checkpoints are taken only from blocks
        to spare (null otherwise) and freed once their step is processed; a prefix hit's
        or a connector load's source block is read by the first step only and freed once
        that is processed (admission counts it among the blocks it takes, see
        KVCacheManager._growth_after). The positional layout (without in-flight limits)
        holds the last whole-block checkpoint, then a block per boundary in flight: after
        pruning on the processed count P, blocks P//bs - 1 .. (e-1)//bs with e - P <= B =
        max_in_flight_tokens, at most touch(B) + 1, never more than max_model_len needs.
        """
        if not self.block_checkpoints:
            return self.num_state_blocks
        if self.running_in_place:
            return 1
        return min(blocks_touched(max_in_flight_tokens, self.block_size) + 1, cdiv(max_model_len, self.block_size))


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one spec and one block table per request."""

    spec: KVCacheSpec
    layer_names: tuple[str, ...]


@dataclass(frozen=True)
class KVCacheConfig:
    """The pool (num_blocks, block 0 being the null block) and the groups drawing from it.

    Block memory is shared across groups the way production engines do it: layer j of
    every group uses slot tensor j, so one block id costs
    `max(layers per group) * max(page size)` bytes, not the sum over all layers.
    """

    num_blocks: int
    groups: tuple[KVCacheGroup, ...]

    @property
    def block_size(self) -> int:
        return self.groups[0].spec.block_size

    @property
    def bytes_per_block(self) -> int:
        return bytes_per_block(self.groups)

    def min_num_blocks(
        self, max_in_flight_tokens: int, max_model_len: int, window_tail: WindowTail | None = None
    ) -> int:
        """Smallest pool (null block included) that admits one max_model_len request."""
        return 1 + blocks_per_request(self.groups, max_in_flight_tokens, max_model_len, window_tail)

    def max_concurrency(
        self, max_in_flight_tokens: int, max_model_len: int, window_tail: WindowTail | None = None
    ) -> float:
        """How many max_model_len requests the pool admits at once."""
        need = blocks_per_request(self.groups, max_in_flight_tokens, max_model_len, window_tail)
        return (self.num_blocks - 1) / need


def with_mamba_checkpoints(
    groups: tuple[KVCacheGroup, ...],
    in_flight: WindowTail | None = None,
    keep_last_checkpoint: bool = True,
) -> tuple[KVCacheGroup, ...]:
    """The groups with every Mamba group keeping state checkpoints: what prefix caching
    needs to serve a Mamba model a hit (see MambaSpec).

    With `in_flight` (the scheduler's limits, what the engine passes) the running state
    stays in place: a request's cap is one block a Mamba group whatever the steps and
    drafts in flight, and checkpoints are best-effort (InPlaceMambaManager); it holds its
    last whole-block checkpoint only if `keep_last_checkpoint` (a KV connector stores it
    at the request's finish). Without it (unit tests of the positional layout) every
    block keeps a checkpoint and a request reserves one per boundary in flight."""
    dense = tuple(
        KVCacheGroup(replace(g.spec, block_checkpoints=True), g.layer_names) if isinstance(g.spec, MambaSpec) else g
        for g in groups
    )
    if in_flight is None:
        return dense
    return tuple(
        KVCacheGroup(replace(g.spec, keep_last_checkpoint=keep_last_checkpoint, running_in_place=True), g.layer_names)
        if isinstance(g.spec, MambaSpec) else g
        for g in dense
    )


def bytes_per_block(groups: tuple[KVCacheGroup, ...] | list[KVCacheGroup]) -> int:
    layers = max(len(g.layer_names) for g in groups)
    return layers * max(g.spec.page_size_bytes for g in groups)


def blocks_per_request(
    groups: tuple[KVCacheGroup, ...] | list[KVCacheGroup],
    max_in_flight_tokens: int,
    max_model_len: int,
    window_tail: WindowTail | None = None,
) -> int:
    return sum(
        g.spec.max_admission_blocks_per_request(max_in_flight_tokens, max_model_len, window_tail) for g in groups
    )


def group_layers(layer_specs: dict[str, KVCacheSpec]) -> tuple[KVCacheGroup, ...]:
    """Group layers by spec, in groups of at most g layers, g = the smallest spec's count.

    Layer j of every group shares slot tensor j (see KVCacheConfig), so a block costs
    g pages. A 5:1 sliding/global model of 18 layers becomes 1 full + 5 sliding groups of
    3 layers; 52 sliding + 10 full layers become 6 sliding groups (the last of 2 layers)
    and 1 full group of 10, so a block costs 10 pages, not 52.

    A Mamba state bigger than the largest attention page is cut into that many pages
    (MambaSpec.num_pages), each slice its own group: the pool's page is the attention
    page, not the state (a Bamba-9B state is 33 pages of 16 tokens of KV).
    """
    if not layer_specs:
        raise ConfigError("a model needs at least one KV cache layer")
    block_sizes = {s.block_size for s in layer_specs.values()}
    if len(block_sizes) != 1:
        raise ConfigError(f"all KV cache groups must share one block size, got {sorted(block_sizes)}")
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in layer_specs.items():
        by_spec.setdefault(spec, []).append(name)
    size = min(len(v) for v in by_spec.values())
    attention_pages = [s.page_size_bytes for s in by_spec if not isinstance(s, MambaSpec)]
    page = max(attention_pages, default=0)
    groups: list[KVCacheGroup] = []
    for spec, names in by_spec.items():
        pages = [spec]
        if isinstance(spec, MambaSpec) and attention_pages and spec.state_size_bytes > page:
            n = cdiv(spec.state_size_bytes, page)
            pages = [replace(spec, num_pages=n, page_index=k) for k in range(n)]
        for i in range(0, len(names), size):
            groups.extend(KVCacheGroup(p, tuple(names[i : i + size])) for p in pages)
    return tuple(groups)
