"""EngineConfig: each invalid setting fails at start, naming the setting and the smallest value that works."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hybridserve.config import EngineConfig, format_size, parse_size, resolve_engine_settings
from hybridserve.core.errors import ConfigError
from hybridserve.core.kv.spec import FullAttentionSpec, SlidingWindowSpec, group_layers
from hybridserve.testing import NullConnector


def groups(block_size: int = 16, window: int = 16) -> tuple:
    specs = {}
    for i in range(6):
        if i in (2, 5):
            specs[f"layers.{i}"] = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=16)
        else:
            specs[f"layers.{i}"] = SlidingWindowSpec(block_size=block_size, num_kv_heads=2, head_size=16,
                                                     sliding_window=window)
    return group_layers(specs)


def test_block_size_must_be_a_power_of_two() -> None:
    with pytest.raises(ConfigError, match=r"block_size must be a power of two, got 24; .* 16 and 32"):
        EngineConfig(block_size=24)
    assert EngineConfig(block_size=32).block_size == 32


def test_max_num_batched_tokens_below_block_size_names_the_smallest_value() -> None:
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens must be >= block_size \(32\), got 16; "
                                          r"the smallest value that works is 32"):
        EngineConfig(block_size=32, max_num_batched_tokens=16)


@pytest.mark.parametrize("kwargs, pattern", [
    ({"num_blocks": 1}, r"num_blocks must be >= 2"),
    ({"max_model_len": 1}, r"max_model_len must be >= 2"),
    ({"max_num_seqs": 0}, r"max_num_seqs must be >= 1"),
    ({"num_speculative_tokens": -1}, r"num_speculative_tokens must be >= 0"),
    ({"seed": -3}, r"seed must be >= 0"),
    ({"block_size": True}, r"block_size must be an integer"),
    ({"dtype": "float64"}, r"dtype must be one of float32, bfloat16, float16"),
    ({"device": "tpu"}, r"device must be 'cpu', 'cuda', 'cuda:N' or 'auto'"),
    ({"kv_cache_memory": "lots"}, r"kv_cache_memory: cannot parse size 'lots'"),
    ({"kv_cache_memory": "1GiB", "num_blocks": 10}, r"give kv_cache_memory or num_blocks, not both"),
    ({"async_scheduling": "yes"}, r"async_scheduling must be true or false"),
    ({"prefix_cache_retention": 1.5}, r"prefix_cache_retention must be between 0 and 1, got 1.5"),
    ({"prefix_cache_retention": "most"}, r"prefix_cache_retention must be a number"),
])
def test_bad_values_name_the_setting(kwargs: dict, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        EngineConfig(**kwargs)


def test_kv_offload_memory_is_checked() -> None:
    assert EngineConfig(kv_offload_memory=0).kv_offload_memory == 0
    assert EngineConfig(kv_offload_memory="4GiB").kv_offload_memory == "4GiB"
    with pytest.raises(ConfigError, match=r"kv_offload_memory must be >= 0"):
        EngineConfig(kv_offload_memory=-1)
    with pytest.raises(ConfigError, match=r"kv_offload_memory needs enable_prefix_caching"):
        EngineConfig(kv_offload_memory="4GiB", enable_prefix_caching=False)


def test_unknown_engine_argument_is_one_config_error() -> None:
    with pytest.raises(ConfigError, match=r"unknown engine argument\(s\) \['max_num_seq'\]"):
        EngineConfig.from_kwargs(max_num_seq=4)


def test_sizes_parse_in_binary_units() -> None:
    assert parse_size("x", "2GiB") == 2 << 30
    assert parse_size("x", "1.5M") == 3 << 19
    assert parse_size("x", 4096) == 4096
    assert format_size(3 << 19) == "1.50MiB"


def test_pool_too_small_by_num_blocks_names_the_admission_minimum() -> None:
    g = groups()
    cfg = EngineConfig(num_blocks=10, max_model_len=256, max_num_batched_tokens=64)
    # Two steps of 64 tokens in flight; with window-tail allocation a W=16 group holds
    # touch(15) + 2 * touch(15) = 2 + 2 * 2 = 6 blocks, the full group 256 / 16 = 16:
    # 1 null + 6 + 6 + 16.
    need = 29
    with pytest.raises(ConfigError) as info:
        resolve_engine_settings(cfg, g, model_max_len=2048, window_tail=True)
    msg = str(info.value)
    assert f"num_blocks=10 is too small: one max_model_len=256 request needs {need} blocks" in msg
    assert f"the smallest num_blocks that works is {need}" in msg
    # The pool of exactly `need` blocks is accepted.
    ok = resolve_engine_settings(EngineConfig(num_blocks=need, max_model_len=256, max_num_batched_tokens=64), g,
                                 model_max_len=2048, window_tail=True)
    assert ok.kv_cache_config.num_blocks == need


def test_pool_too_small_by_memory_names_the_smallest_memory_and_the_longest_length() -> None:
    g = groups()
    per_block = 2 * (2 * 16 * 2 * 16 * 4)  # 2 layers per group x K and V of 16 slots, 2 heads of 16 float32
    cfg = EngineConfig(kv_cache_memory=per_block * 12, max_model_len=1024, max_num_batched_tokens=64)
    # No window tail: a W=16 group holds cdiv(15 + 2 * 64, 16) + 1 = 10 blocks, the full
    # group 1024 / 16 = 64: 1 null + 10 + 10 + 64.
    need = 85
    with pytest.raises(ConfigError) as info:
        resolve_engine_settings(cfg, g, model_max_len=2048, window_tail=False)
    msg = str(info.value)
    assert f"(12 blocks of {per_block} bytes) is too small" in msg
    assert f"the smallest kv_cache_memory that works is {need * per_block}" in msg
    # A length L <= 143 needs 1 + 2 * (cdiv(L, 16) + 1) + cdiv(L, 16) blocks: 12 at L = 48,
    # 15 at L = 49.
    assert msg.endswith("lower max_model_len to 48")


def test_max_model_len_defaults_from_the_model_and_is_capped() -> None:
    g = groups()
    assert resolve_engine_settings(EngineConfig(), g, model_max_len=2048, window_tail=True).max_model_len == 2048
    assert resolve_engine_settings(EngineConfig(), g, model_max_len=131072, window_tail=True).max_model_len == 8192
    with pytest.raises(ConfigError, match=r"max_model_len=4096 exceeds the model's context .* largest value that "
                                          r"works is 2048"):
        resolve_engine_settings(EngineConfig(max_model_len=4096), g, model_max_len=2048, window_tail=True)


def test_default_pool_fits_max_num_seqs_full_requests_within_one_gib() -> None:
    g = groups()
    cfg = EngineConfig(max_model_len=256, max_num_seqs=4)
    # Per request (as in the num_blocks test above, whatever the batch budget): 6 + 6 + 16.
    got = resolve_engine_settings(cfg, g, model_max_len=2048, window_tail=True).kv_cache_config.num_blocks
    assert got == 4 * 28 + 1


@pytest.mark.parametrize(("async_scheduling", "offload", "need"), [
    # Bamba-9B at 8192 tokens, 8192 per step: 512 attention blocks; 330 Mamba page groups
    # (10 groups x 33 pages), each holding its running state in place: 1 block, whatever
    # the steps in flight, with or without a KV connector (checkpoints are best-effort).
    (False, False, 1 + 512 + 330),
    (True, False, 1 + 512 + 330),
    (True, True, 1 + 512 + 330),
])
def test_startup_sizing_and_admission_agree_for_paged_mamba_states(async_scheduling, offload, need) -> None:
    from hybridserve.core.sched.scheduler import Scheduler
    from hybridserve.sim.presets import get_layout

    g = group_layers(get_layout("bamba-9b-like").layer_specs(16, "bfloat16"))
    kw = dict(max_model_len=8192, max_num_batched_tokens=8192, async_scheduling=async_scheduling,
              kv_offload_memory="1GiB" if offload else 0)
    with pytest.raises(ConfigError, match=f"the smallest num_blocks that works is {need}"):
        resolve_engine_settings(EngineConfig(num_blocks=need - 1, **kw), g, model_max_len=65536, window_tail=False)
    ok = resolve_engine_settings(EngineConfig(num_blocks=need, **kw), g, model_max_len=65536, window_tail=False)
    # The scheduler's KV manager (admission) takes exactly that pool, one block less not.
    Scheduler(ok.scheduler_config, ok.kv_cache_config, connector=None if not offload else NullConnector())
    with pytest.raises(ConfigError, match=f"need at least {need}"):
        Scheduler(ok.scheduler_config, replace(ok.kv_cache_config, num_blocks=need - 1),
                  connector=None if not offload else NullConnector())
