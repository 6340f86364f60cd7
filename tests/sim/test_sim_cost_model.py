"""Cost model and presets: hand-computed numbers on tiny layouts, real preset sizing."""

from __future__ import annotations

import pytest

from hybridserve.core.errors import ConfigError
from hybridserve.core.kv.spec import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from hybridserve.sim.cost_model import CostModel, chunked_pairs, full_pairs, sliding_pairs
from hybridserve.sim.presets import (
    EngineOverheads,
    GpuPreset,
    MambaShape,
    ModelLayout,
    get_gpu,
    get_layout,
    kv_cache_config,
)

GPU = GpuPreset("tiny-gpu", memory_bytes=10**6, memory_bandwidth_bytes_per_s=1e5, peak_flops=1e6)
OVERHEAD = EngineOverheads(fixed_step_overhead_s=0.001, cpu_step_overhead_s=0.0, pp_stage_overhead_s=0.0)


def tiny(kinds: tuple[str, ...], total: float = 1000, active: float = 1000, **kw: object) -> ModelLayout:
    return ModelLayout(
        name="tiny", layer_kinds=kinds, hidden_size=8, num_q_heads=2, num_kv_heads=1, head_dim=4,
        total_params=total, active_params=active, weight_bytes_per_param=2.0, vocab_size=100,
        max_position_embeddings=64, **kw,  # type: ignore[arg-type]
    )


def brute_pairs(ctx: int, new: int, keys_at) -> int:  # type: ignore[no-untyped-def]
    return sum(keys_at(p) for p in range(ctx, ctx + new))


def test_closed_form_pair_sums_match_brute_force() -> None:
    for ctx in (0, 1, 3, 4, 5, 9, 17):
        for new in (1, 2, 4, 7, 13):
            end = ctx + new
            assert full_pairs(end) - full_pairs(ctx) == brute_pairs(ctx, new, lambda p: p + 1)
            assert sliding_pairs(end, 4) - sliding_pairs(ctx, 4) == brute_pairs(ctx, new, lambda p: min(p + 1, 4))
            assert chunked_pairs(end, 4) - chunked_pairs(ctx, 4) == brute_pairs(ctx, new, lambda p: p % 4 + 1)


def test_sliding_and_full_step_hand_computed() -> None:
    cm = CostModel(GPU, tiny(("sliding", "full"), sliding_window=4), overheads=OVERHEAD)
    cost = cm.step_cost([(0, 6), (10, 1)])
    # full pairs 21 + 11, sliding pairs 18 + 4; 4*q_heads*head_dim = 32 FLOPs per pair.
    assert cost.flops == 2 * 1000 * 7 + 32 * (32 + 22)
    # weights 2000 B; KV reads full 6+11, sliding 6+4; writes 7 tokens x 2 layers; 16 B/token.
    assert cost.bytes_moved == 2000 + (17 + 10 + 14) * 16
    assert cost.seconds == pytest.approx(0.001 + 2656 / 1e5)


def test_chunked_step_counts_keys_from_chunk_start() -> None:
    cm = CostModel(GPU, tiny(("chunked",), attention_chunk_size=4), overheads=OVERHEAD)
    cost = cm.step_cost([(3, 6)])
    # positions 3..8 see 4,1,2,3,4,1 keys; the step reads keys 0..8.
    assert cost.flops == 2 * 1000 * 6 + 32 * 15
    assert cost.bytes_moved == 2000 + (9 + 6) * 16


def test_mamba_cost_does_not_grow_with_context() -> None:
    shape = MambaShape(d_inner=4, d_conv=3, nheads=2, head_dim=2, d_state=3)
    cm = CostModel(GPU, tiny(("mamba",), mamba=shape), overheads=OVERHEAD)
    short, long = cm.step_cost([(5, 1)]), cm.step_cost([(5000, 1)])
    assert short == long
    # scan 6*2*2*3 + conv 2*4*3 = 96 FLOPs per token; state 20 bf16 elements read + written.
    assert short.flops == 2 * 1000 + 96
    assert short.bytes_moved == 2000 + 2 * 40


def test_moe_reads_active_weights_per_token_capped_at_total() -> None:
    cm = CostModel(GPU, tiny(("full",), total=1000, active=100), overheads=OVERHEAD)
    assert cm.step_cost([(0, 3)]).bytes_moved == 300 * 2 + (3 + 3) * 16
    assert cm.step_cost([(0, 20)]).bytes_moved == 1000 * 2 + (20 + 20) * 16
    assert cm.step_cost([(0, 20)]).flops == 2 * 100 * 20 + 32 * full_pairs(20)


def test_empty_step_costs_only_overhead_and_window_caps_cost() -> None:
    lay = get_layout("gemma3-27b-like")
    cm = CostModel(get_gpu("H100"), lay)
    assert cm.step_time([]) == cm.overheads.fixed_step_overhead_s
    # Decode past the window: only the 10 full layers grow with context, the 52 sliding
    # layers stay at W = 1024 keys per query.
    grow = cm.step_cost([(30000, 1)] * 64).flops - cm.step_cost([(1024, 1)] * 64).flops
    assert grow == pytest.approx(64 * 10 * (4 * 32 * 128) * (30001 - 1025), rel=1e-12)


def test_llama3_8b_pool_size_on_h100() -> None:
    cfg = kv_cache_config("llama3-8b-like", "H100", 16)
    per_block = 32 * 2 * 16 * 8 * 128 * 2
    assert cfg.bytes_per_block == per_block
    assert cfg.num_blocks == int((85520809984 * 0.9 - 8.03e9 * 2) // per_block)
    assert kv_cache_config("llama3-8b-like", "h100", 16, num_blocks=123).num_blocks == 123


def test_layer_specs_follow_the_layouts() -> None:
    specs = get_layout("gemma3-27b-like").layer_specs(16)
    assert len(specs) == 62
    assert sum(isinstance(s, SlidingWindowSpec) for s in specs.values()) == 52
    assert isinstance(specs["layers.5.attn"], FullAttentionSpec)
    assert specs["layers.0.attn"] == SlidingWindowSpec(16, 16, 128, "bfloat16", 1024)
    jamba = get_layout("jamba-like").layer_specs(16, num_speculative_blocks=2)
    assert jamba["layers.0.mamba"] == MambaSpec(16, ((8192, 3), (128, 64, 16)), "bfloat16", 2)
    assert isinstance(jamba["layers.4.attn"], FullAttentionSpec)
    assert sum(isinstance(s, MambaSpec) for s in jamba.values()) == 28
    scout = kv_cache_config("llama4-scout-like", "H200", 16)
    assert len(scout.groups) == 4  # 3 chunked groups of 12 layers + 1 full group


def test_weights_that_do_not_fit_raise_config_error() -> None:
    with pytest.raises(ConfigError, match="jamba-like weights need 104.0 GB"):
        kv_cache_config("jamba-like", "H100", 16)
    # Two pipeline stages halve the weights per GPU.
    assert kv_cache_config("jamba-like", "H100", 16, pipeline_parallel_size=2).num_blocks > 1000
    with pytest.raises(ConfigError, match="unknown GPU"):
        get_gpu("B200")
    with pytest.raises(ConfigError, match="unknown model layout"):
        get_layout("llama2")
