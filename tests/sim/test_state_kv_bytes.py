"""KV bytes per token of a max-length request (hybridserve/sim/state_kv_bytes.py, what
benchmarks/state_kv_bytes.py prints), numbers derived by hand from real config.json
numbers, for a Gated DeltaNet hybrid and a short-convolution one, sync and async."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from hybridserve.config import EngineConfig, resolve_engine_settings
from hybridserve.core.errors import ConfigError
from hybridserve.core.kv.spec import FullAttentionSpec, MambaSpec, group_layers
from hybridserve.sim.state_kv_bytes import engine_bytes, mainstream_bytes, need_bytes

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "state_kv_bytes.py"


def qwen3_next_80b() -> dict:
    """Qwen3-Next-80B-A3B: 48 layers, every 4th full attention (12 layers, 2 KV heads of 256:
    2 * 2 * 256 * 2 = 2,048 bytes a token, 32,768 a 16-token page); 36 Gated DeltaNet
    layers: conv over q, k, v = 2 * 16 * 128 + 32 * 128 = 8,192 channels x (4 - 1) inputs,
    recurrent 32 value heads x 128 x 128. bf16."""
    attn = FullAttentionSpec(16, 2, 256, "bfloat16")
    gdn = MambaSpec(16, shapes=((8192, 3), (32, 128, 128)), dtype="bfloat16")
    return {f"layers.{i}": attn if (i + 1) % 4 == 0 else gdn for i in range(48)}


def test_gated_deltanet_state_bytes_by_hand() -> None:
    gdn = qwen3_next_80b()["layers.0"]
    assert isinstance(gdn, MambaSpec)
    # 24,576 + 524,288 = 548,864 elements, 1,097,728 bytes.
    assert gdn.state_size_bytes == 1_097_728


@pytest.mark.parametrize("steps", [1, 2, 3], ids=["sync", "async-2", "async-3"])
def test_qwen3_next_bytes_per_token_by_hand(steps: int) -> None:
    """need at L = 8,192: 12 x 2,048 x 8,192 + 36 x 1,097,728 = 201,326,592 + 39,518,208 =
    240,844,800 bytes: 29,400 a token. At L = 131,072: 12 x 2,048 + 39,518,208 / 131,072 =
    24,576 + 301.5 = 24,877.5.

    hybridserve: the state is cdiv(1,097,728, 32,768) = 34 pages of 16,144 elements
    (32,288 bytes); groups of min(12, 36) = 12 layers: 1 attention group, 3 state groups
    of 34 page groups each = 102, a block = 12 x 32,768 = 393,216 bytes. A request holds
    cdiv(L, 16) attention blocks + 1 block a page group (the running state in place,
    whatever the steps in flight): 512 + 102 = 614 blocks at 8,192 = 614 x 48 = 29,472
    bytes a token; 8,192 + 102 = 8,294 at 131,072 = 8,294 x 3 = 24,882.

    mainstream: the attention block grows to 16 x cdiv(1,097,728, 16 x 2,048) = 16 x 34 =
    544 tokens, a page of 544 x 2,048 = 1,114,112 bytes, a block 12 pages = 13,369,344
    bytes (1,632 a token of 8,192, 102 of 131,072). Blocks: cdiv(8,192, 544) = 16 or
    cdiv(131,072, 544) = 241 attention + 3 state groups x 1 (no prefix caching) or x 2:
    8,192: 19 x 1,632 = 31,008 and 22 x 1,632 = 35,904; 131,072: 244 x 102 = 24,888 and
    247 x 102 = 25,194."""
    specs = qwen3_next_80b()
    tokens = steps * 8192
    assert need_bytes(specs, 8192, tokens) == 240_844_800
    assert need_bytes(specs, 131_072, tokens) / 131_072 == 24_877.5
    for length, engine, none, align in ((8192, 29_472, 31_008, 35_904), (131_072, 24_882, 24_888, 25_194)):
        got = engine_bytes(specs, length, steps, batched_tokens=8192)
        assert (got.per_token(length), got.block_size) == (engine, 16)
        plain = mainstream_bytes(specs, length, prefix_caching=False)
        assert (plain.per_token(length), plain.block_size) == (none, 544)
        assert mainstream_bytes(specs, length, prefix_caching=True).per_token(length) == align


def test_short_conv_bytes_by_hand() -> None:
    """LFM2-1.2B: 16 layers, attention at 2, 5, 8, 10, 12, 14 (8 KV heads of 2,048 / 32 =
    64: 2,048 bytes a token, 32,768 a page); 10 conv layers keep 2,048 x (3 - 1) inputs,
    8,192 bytes, within a page (not cut). Groups of 6: 1 attention, 2 conv groups (6 and 4
    layers); a block 6 x 32,768 = 196,608 bytes. At 8,192: 512 + 2 = 514 blocks =
    101,056,512 bytes (12,336 a token); need 6 x 2,048 x 8,192 + 10 x 8,192 = 100,745,216.
    The mainstream block stays 16 (16 x cdiv(8,192, 32,768) = 16): 514 blocks too, 516
    with prefix caching."""
    attn = FullAttentionSpec(16, 8, 64, "bfloat16")
    conv = MambaSpec(16, shapes=((2048, 2),), dtype="bfloat16")
    specs = {f"layers.{i}": attn if i in (2, 5, 8, 10, 12, 14) else conv for i in range(16)}
    assert need_bytes(specs, 8192, 8192) == 100_745_216
    for steps in (1, 2):
        assert engine_bytes(specs, 8192, steps, batched_tokens=8192).total == 101_056_512
    assert mainstream_bytes(specs, 8192, prefix_caching=False).total == 514 * 196_608
    assert mainstream_bytes(specs, 8192, prefix_caching=True).total == 516 * 196_608


def test_a_model_without_attention_keeps_the_state_as_its_page() -> None:
    """4 Mamba-2 layers of 4 x 3 + 2 x 4 x 8 = 76 float32 elements, 304 bytes: one group
    of 4, a block 4 x 304 = 1,216 bytes, 1 block a request (2 with prefix caching in the
    mainstream rule)."""
    specs = {f"layers.{i}": MambaSpec(16, shapes=((4, 3), (2, 4, 8))) for i in range(4)}
    assert need_bytes(specs, 1024, 64) == 1_216
    assert engine_bytes(specs, 1024, 2, batched_tokens=64).total == 1_216
    assert mainstream_bytes(specs, 1024, prefix_caching=False).total == 1_216
    assert mainstream_bytes(specs, 1024, prefix_caching=True).total == 2_432


def _script():  # type: ignore[no-untyped-def]
    """benchmarks/state_kv_bytes.py as a module."""
    spec = importlib.util.spec_from_file_location("state_kv_bytes_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_the_script_reads_each_model_through_the_engines_parser() -> None:
    """benchmarks/state_kv_bytes.py parses each config.json with the engine's own parser into
    layers that cost what was derived by hand: Qwen3-Next and LFM2 as above; Jamba-v0.1 has
    4 attention layers of 8 KV heads of 4,096 / 32 = 128 (2 * 8 * 128 * 2 = 4,096 bytes a
    token each) and 28 Mamba-1 layers of conv 8,192 x 3 + SSM 8,192 x 16 in bf16 (311,296
    bytes each): at 8,192, 4 x 4,096 x 8,192 + 28 x 311,296 = 142,934,016 bytes."""
    script = _script()
    specs = {label: script.layer_specs(raw) for label, _, raw in script.MODELS}
    assert need_bytes(specs["Qwen3-Next-80B-A3B"], 8192, 8192) == 240_844_800
    assert engine_bytes(specs["Qwen3-Next-80B-A3B"], 8192, 2, batched_tokens=8192).per_token(8192) == 29_472
    assert need_bytes(specs["LFM2-1.2B"], 8192, 8192) == 100_745_216
    assert engine_bytes(specs["LFM2-1.2B"], 8192, 2, batched_tokens=8192).total == 101_056_512
    assert need_bytes(specs["Jamba-v0.1"], 8192, 8192) == 142_934_016


def test_the_script_gives_nemotron_h_mlp_layers_no_state() -> None:
    """Nemotron-H-8B by its config.json: 4 attention layers of 8 KV heads x 128 (K and V,
    bf16: 16,384 B a token) and 24 Mamba-2 states of (10,240 x 3 + 128 x 64 x 128) x 2 B =
    2,158,592 B each; its 24 MLP-only layers add nothing. Need at 8K: 16,384 + 24 x
    2,158,592 / 8,192 = 22,708 B a token."""
    script = _script()
    raw = next(r for label, _, r in script.MODELS if label == "Nemotron-H-8B")
    specs = script.layer_specs(raw)
    assert len(specs) == 28
    assert need_bytes(specs, 8192, 8192) == 22_708 * 8192


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_engine_bytes_are_what_the_engine_sizes_its_pool_by(async_scheduling: bool) -> None:
    """config.resolve_engine_settings admits a pool of 1 + 614 blocks for Qwen3-Next-80B
    at L = 8,192 (614 = 29,472 x 8,192 / 393,216, the figure above) and refuses one less."""
    groups = group_layers(qwen3_next_80b())

    def resolve(num_blocks: int):  # type: ignore[no-untyped-def]
        cfg = EngineConfig(max_model_len=8192, max_num_batched_tokens=8192, async_scheduling=async_scheduling,
                           num_blocks=num_blocks)
        return resolve_engine_settings(cfg, groups, 8192, window_tail=False)

    assert engine_bytes(qwen3_next_80b(), 8192, 2 if async_scheduling else 1, batched_tokens=8192).total == 614 * 393_216
    assert resolve(615).kv_cache_config.bytes_per_block == 393_216
    with pytest.raises(ConfigError, match="num_blocks=614 is too small"):
        resolve(614)
