"""KV cache specs: page sizes, admission caps, startup sizing and layer grouping.

Every number here is worked out by hand from the admission formulas (each spec's
`max_admission_blocks_per_request` docstring states its own), so a change to a
formula (or to who calls it) fails a test with a concrete expected value.
"""

from __future__ import annotations


import pytest

from hybridserve.core.errors import ConfigError
from hybridserve.core.kv.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    WindowTail,
    blocks_per_request,
    bytes_per_block,
    group_layers,
    with_mamba_checkpoints,
)

BS = 16
MAX_MODEL_LEN = 16384


def sliding(window: int = 1024, block_size: int = BS) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size, 8, 128, "bfloat16", sliding_window=window)


def chunked(chunk: int = 1024, block_size: int = BS) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(block_size, 8, 128, "bfloat16", attention_chunk_size=chunk)


def full(block_size: int = BS) -> FullAttentionSpec:
    return FullAttentionSpec(block_size, 8, 128, "bfloat16")


# -- page sizes -------------------------------------------------------------------


def test_attention_page_size_is_k_plus_v_for_every_slot() -> None:
    # 2 (K,V) * 16 slots * 8 heads * 128 dims * 2 bytes
    assert full().page_size_bytes == 65536
    assert sliding().page_size_bytes == 65536
    assert chunked().page_size_bytes == 65536
    assert FullAttentionSpec(16, 1, 8, "float32").page_size_bytes == 2 * 16 * 1 * 8 * 4
    assert FullAttentionSpec(32, 4, 64, "float8").page_size_bytes == 2 * 32 * 4 * 64 * 1


def test_mamba_page_size_is_sum_of_state_shapes() -> None:
    spec = MambaSpec(16, shapes=((4, 3), (8, 16)), dtype="float32")
    assert spec.page_size_bytes == (12 + 128) * 4
    assert MambaSpec(16, shapes=((2, 5),), dtype="bfloat16").page_size_bytes == 20


def test_unknown_dtype_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="dtype"):
        _ = FullAttentionSpec(16, 1, 8, "float13").page_size_bytes


# -- admission caps ------------------------------------------------------------------


@pytest.mark.parametrize(("in_flight", "expected"), [(1024, 129), (2048, 193)])
def test_sliding_window_admission_cap(in_flight: int, expected: int) -> None:
    # cdiv(min(W - 1 + in_flight, max_model_len), bs) + 1
    assert sliding(1024).max_admission_blocks_per_request(in_flight, MAX_MODEL_LEN) == expected


@pytest.mark.parametrize(("in_flight", "expected"), [(1024, 128), (2048, 192)])
def test_chunked_local_admission_cap(in_flight: int, expected: int) -> None:
    # cdiv(min(C + in_flight, max_model_len), bs)
    assert chunked(1024).max_admission_blocks_per_request(in_flight, MAX_MODEL_LEN) == expected


def test_caps_are_bounded_by_max_model_len() -> None:
    # min(1023 + 1024, 512) = 512 tokens -> 32 blocks, +1 for the misaligned window start.
    assert sliding(1024).max_admission_blocks_per_request(1024, 512) == 33
    assert chunked(1024).max_admission_blocks_per_request(1024, 512) == 32


def test_full_attention_cap_is_whole_model_len() -> None:
    assert full().max_admission_blocks_per_request(1024, MAX_MODEL_LEN) == 1024
    assert full().max_admission_blocks_per_request(1, 1000) == 63  # cdiv(1000, 16)
    assert full().max_admission_blocks_per_request(99_999, 1000) == 63  # in flight is irrelevant


@pytest.mark.parametrize(("num_spec", "expected"), [(0, 1), (3, 4)])
def test_mamba_cap_is_state_blocks(num_spec: int, expected: int) -> None:
    spec = MambaSpec(16, shapes=((4, 4),), num_speculative_blocks=num_spec)
    assert spec.num_state_blocks == expected
    assert spec.max_admission_blocks_per_request(2048, MAX_MODEL_LEN) == expected


# -- startup sizing uses the same function ----------------------------------------------


def one_full_five_sliding(num_blocks: int) -> KVCacheConfig:
    groups = (KVCacheGroup(full(), ("l5",)),) + tuple(KVCacheGroup(sliding(), (f"l{i}",)) for i in range(5))
    return KVCacheConfig(num_blocks=num_blocks, groups=groups)


def test_min_num_blocks_and_max_concurrency() -> None:
    config = one_full_five_sliding(num_blocks=1 + 2 * (1024 + 5 * 129))
    assert blocks_per_request(config.groups, 1024, MAX_MODEL_LEN) == 1024 + 5 * 129
    assert config.min_num_blocks(1024, MAX_MODEL_LEN) == 1 + 1024 + 5 * 129  # null block + one request
    assert config.max_concurrency(1024, MAX_MODEL_LEN) == pytest.approx(2.0)
    assert config.min_num_blocks(2048, MAX_MODEL_LEN) == 1 + 1024 + 5 * 193


def test_startup_sizing_calls_the_admission_function(monkeypatch: pytest.MonkeyPatch) -> None:
    """Change the cap and both sizing numbers follow: they cannot drift apart."""
    config = one_full_five_sliding(num_blocks=1 + 1024 + 5 * 10)
    monkeypatch.setattr(SlidingWindowSpec, "max_admission_blocks_per_request", lambda self, f, m, tail=None: 10)
    assert config.min_num_blocks(1024, MAX_MODEL_LEN) == 1 + 1024 + 50
    assert config.max_concurrency(1024, MAX_MODEL_LEN) == pytest.approx(1.0)


def test_bytes_per_block_is_max_layers_times_max_page() -> None:
    groups = (
        KVCacheGroup(full(), ("a", "b", "c")),
        KVCacheGroup(SlidingWindowSpec(BS, 8, 256, "bfloat16", sliding_window=64), ("d",)),
    )
    assert KVCacheConfig(num_blocks=10, groups=groups).bytes_per_block == 3 * (2 * 16 * 8 * 256 * 2)
    assert KVCacheConfig(num_blocks=10, groups=groups).block_size == BS


# -- grouping ---------------------------------------------------------------------------


def test_group_layers_5_to_1_makes_six_groups_of_three() -> None:
    # Gemma-3 style: every 6th layer is global.
    layers: dict[str, KVCacheSpec] = {f"layers.{i}": full() if i % 6 == 5 else sliding() for i in range(18)}
    groups = group_layers(layers)
    assert len(groups) == 6
    assert all(len(g.layer_names) == 3 for g in groups)
    full_groups = [g for g in groups if isinstance(g.spec, FullAttentionSpec)]
    sliding_groups = [g for g in groups if isinstance(g.spec, SlidingWindowSpec)]
    assert len(full_groups) == 1 and len(sliding_groups) == 5
    assert full_groups[0].layer_names == ("layers.5", "layers.11", "layers.17")
    assert sliding_groups[0].layer_names == ("layers.0", "layers.1", "layers.2")
    names = [n for g in groups for n in g.layer_names]
    assert sorted(names) == sorted(layers) and len(set(names)) == 18


def test_group_layers_uneven_splits_in_groups_of_the_smallest_count() -> None:
    # 4 sliding + 3 full: groups of 3, the last sliding group holds 1 layer.
    layers: dict[str, KVCacheSpec] = {f"s{i}": sliding() for i in range(4)}
    layers.update({f"f{i}": full() for i in range(3)})
    groups = group_layers(layers)
    assert [(type(g.spec), len(g.layer_names)) for g in groups] == [
        (SlidingWindowSpec, 3),
        (SlidingWindowSpec, 1),
        (FullAttentionSpec, 3),
    ]
    assert bytes_per_block(groups) == 3 * full().page_size_bytes


def test_group_layers_distinct_windows_are_distinct_groups() -> None:
    layers: dict[str, KVCacheSpec] = {"a": sliding(512), "b": sliding(1024), "c": sliding(512), "d": sliding(1024)}
    groups = group_layers(layers)
    assert sorted(g.layer_names for g in groups) == [("a", "c"), ("b", "d")]


def test_group_layers_rejects_empty_and_mixed_block_sizes() -> None:
    with pytest.raises(ConfigError):
        group_layers({})
    with pytest.raises(ConfigError, match="block size"):
        group_layers({"a": full(16), "b": sliding(block_size=32)})


# -- invalid values -------------------------------------------------------------------


@pytest.mark.parametrize("window", [0, -1])
def test_invalid_sliding_window_raises(window: int) -> None:
    with pytest.raises(ConfigError, match="sliding_window"):
        SlidingWindowSpec(16, 1, 8, sliding_window=window)


@pytest.mark.parametrize("chunk", [0, -4])
def test_invalid_chunk_size_raises(chunk: int) -> None:
    with pytest.raises(ConfigError, match="attention_chunk_size"):
        ChunkedLocalAttentionSpec(16, 1, 8, attention_chunk_size=chunk)


@pytest.mark.parametrize(
    "make",
    [
        lambda: FullAttentionSpec(0, 1, 8),
        lambda: SlidingWindowSpec(-16, 1, 8, sliding_window=4),
        lambda: FullAttentionSpec(16, 0, 8),
        lambda: FullAttentionSpec(16, 1, 0),
        lambda: MambaSpec(16, shapes=((2, 2),), num_speculative_blocks=-1),
    ],
    ids=["block0", "block_neg", "heads0", "head_size0", "mamba_spec_neg"],
)
def test_invalid_geometry_raises_config_error(make) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError):
        make()


@pytest.mark.parametrize("chunk, fits", [(100, 4), (24, 8), (8191, 1), (48, 16)])
def test_a_chunk_that_blocks_do_not_divide_names_the_block_size_that_does(chunk: int, fits: int) -> None:
    """100 = 4 x 25, 24 = 8 x 3, 8191 is odd, 48 = 16 x 3: the largest power of two dividing each."""
    with pytest.raises(ConfigError, match=rf"use --block-size {fits} \(block_size={fits}\)"):
        ChunkedLocalAttentionSpec(32, 1, 8, attention_chunk_size=chunk)
    assert ChunkedLocalAttentionSpec(fits, 1, 8, attention_chunk_size=chunk).attention_chunk_size == chunk


# -- Mamba hybrids: paged states, sparse checkpoints (numbers derived by hand) ----------------
def test_bamba_9b_state_is_33_attention_pages() -> None:
    """Bamba-9B (config.json): conv state (8192 + 2*1*128) x (4-1) = 25,344 elements, SSM
    state 128 x 64 x 128 = 1,048,576; bf16: 2,147,840 bytes. An attention page of 16
    tokens: 2 * 16 * 8 * 128 * 2 = 65,536 bytes. 2,147,840 / 65,536 = 32.8 -> 33 pages of
    cdiv(1,073,920, 33) = 32,544 elements (65,088 bytes, 0.7% padding). 3 attention layers
    -> groups of 3 layers: 1 attention group, 29 Mamba layers in 10 groups (the last of 2),
    each as 33 page groups; a block is 3 pages: 196,608 bytes (it was 3 x 2,147,840)."""
    from hybridserve.sim.presets import get_layout

    specs = get_layout("bamba-9b-like").layer_specs(16, "bfloat16")
    assert sorted(i for i, name in enumerate(specs) if name.endswith(".attn")) == [9, 18, 27]
    groups = group_layers(specs)
    mamba = [g for g in groups if isinstance(g.spec, MambaSpec)]
    assert len(groups) == 1 + 10 * 33 and len(mamba) == 330
    s = mamba[0].spec
    assert (s.state_size_bytes, s.num_pages, s.page_elems, s.page_size_bytes) == (2_147_840, 33, 32_544, 65_088)
    assert sorted(len(g.layer_names) for g in mamba)[:33] == [2] * 33
    assert bytes_per_block(groups) == 196_608


def test_jamba_like_state_is_5_attention_pages() -> None:
    """Jamba-like: conv 8192 x 3 = 24,576 + SSM 128 x 64 x 16 = 131,072 elements, bf16:
    311,296 bytes = 4.75 pages of 65,536 -> 5 pages of 31,130 elements. 4 attention layers:
    28 Mamba layers in 7 groups of 4, 35 page groups; a block is 4 pages, 262,144 bytes."""
    from hybridserve.sim.presets import get_layout

    groups = group_layers(get_layout("jamba-like").layer_specs(16, "bfloat16"))
    s = groups[0].spec
    assert isinstance(s, MambaSpec) and (s.state_size_bytes, s.num_pages, s.page_elems) == (311_296, 5, 31_130)
    assert len(groups) == 36 and bytes_per_block(groups) == 262_144


def test_a_state_that_fits_a_page_is_not_cut() -> None:
    groups = group_layers({"a": FullAttentionSpec(16, 1, 8), "m": MambaSpec(16, shapes=((4, 4),))})
    assert [g.spec.num_pages for g in groups if isinstance(g.spec, MambaSpec)] == [1]


@pytest.mark.parametrize("steps,drafts", [(1, 0), (2, 0), (2, 4)])
def test_in_place_mamba_cap_is_one_block_a_page_group(steps: int, drafts: int) -> None:
    """Prefix caching with the scheduler's in-flight limits: the running state stays in
    place, so a Mamba page group's cap is 1 whatever the steps and drafts in flight
    (checkpoints are best-effort). Bamba-9B-like at L = 8192, B = steps * 8192:
    attention cdiv(8192, 16) = 512 blocks + 330 page groups x 1 = 842 blocks of 196,608
    bytes = 165,543,936 bytes, 20,208 per token; the need is 3 x 65,536 x 512 attention
    + 29 x 2,147,840 states = 162,950,656 bytes (19,891 per token): 1.016x, the rest
    is the 10th group's third layer slot and the pages' padding. Jamba-like: 512 + 35 =
    547 blocks of 262,144 bytes = 143,392,768 (17,504 per token) against 4 x 65,536 x
    512 + 28 x 311,296 = 142,934,016: 1.003x. Sync and async alike (the positional
    layout needed 1 + k blocks a page group: 28,128 and 36,048 bytes a token for Bamba)."""
    from hybridserve.sim.presets import get_layout

    for name, blocks, block_bytes in (("bamba-9b-like", 842, 196_608), ("jamba-like", 547, 262_144)):
        groups = with_mamba_checkpoints(group_layers(get_layout(name).layer_specs(16, "bfloat16")),
                                        WindowTail(steps, drafts))
        mamba = [g.spec for g in groups if isinstance(g.spec, MambaSpec)]
        assert all(s.running_in_place and s.max_admission_blocks_per_request(steps * 8192, 8192) == 1 for s in mamba)
        assert blocks_per_request(groups, steps * 8192, 8192) == blocks
        assert bytes_per_block(groups) == block_bytes
    # Without the in-flight limits: the positional layout, a checkpoint per block in flight.
    plain = with_mamba_checkpoints((KVCacheGroup(MambaSpec(16, shapes=((40, 40),)), ("m",)),))
    assert not plain[0].spec.running_in_place
    assert plain[0].spec.max_admission_blocks_per_request(256, 1024) == 17 + 1
