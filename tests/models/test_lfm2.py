"""LFM2's config parsing and the memory its conv-state kind costs, derived by hand.

The model itself runs in the recurrent matrices (tests/helpers/hf_tiny_mamba.py KINDS:
greedy, chunked prefill, checkpoints, prefix hits, preemption, drafts, offload, PP / TP).
"""

from __future__ import annotations

import pytest

from hybridserve.core.errors import ConfigError
from hybridserve.core.kv.spec import (FullAttentionSpec, MambaSpec, WindowTail, blocks_per_request, bytes_per_block,
                                      group_layers, with_mamba_checkpoints)
from hybridserve.models.arch.lfm2_config import SHORT_CONV
from hybridserve.models.config import FULL, parse_model_config
from hybridserve.models.kv_specs import model_kv_layer_specs

# LFM2-1.2B's config.json numbers (the fields that size the KV cache and the MLP).
LFM2_1B2 = {
    "architectures": ["Lfm2ForCausalLM"], "vocab_size": 65536, "hidden_size": 2048, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "block_ff_dim": 12288, "block_multiple_of": 256,
    "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": True, "conv_L_cache": 3, "conv_bias": False,
    "full_attn_idxs": [2, 5, 8, 10, 12, 14], "norm_eps": 1e-5, "rope_theta": 1000000.0, "tie_embedding": True,
    "max_position_embeddings": 128000,
}


def test_lfm2_1b2_config() -> None:
    cfg = parse_model_config(LFM2_1B2)
    attention = {2, 5, 8, 10, 12, 14}
    assert cfg.layer_types == tuple(FULL if i in attention else SHORT_CONV for i in range(16))
    # MLP: int(2 * 12288 / 3) = 8192, times 1.0, already a multiple of 256.
    assert (cfg.intermediate_size, cfg.head_dim, cfg.tie_word_embeddings) == (8192, 64, True)
    assert cfg.short_conv is not None and cfg.short_conv.state_shapes == ((2048, 2),)
    assert cfg.rope[FULL].theta == 1e6 and cfg.qk_norm


def test_mlp_width_rounds_up_to_the_multiple() -> None:
    # int(2 * 1000 / 3) = 666; * 1.5 = 999; rounded up to a multiple of 256: 1024.
    raw = {**LFM2_1B2, "block_ff_dim": 1000, "block_ffn_dim_multiplier": 1.5}
    assert parse_model_config(raw).intermediate_size == 1024
    assert parse_model_config({**raw, "block_auto_adjust_ff_dim": False}).intermediate_size == 1000


@pytest.mark.parametrize("change,needle", [
    ({"conv_L_cache": 1}, "conv_L_cache"),
    ({"conv_L_cache": "3"}, "conv_L_cache"),
    ({"full_attn_idxs": [2, 16]}, "full_attn_idxs"),
    ({"layer_types": ["conv"] * 15}, "15 entries"),
    ({"layer_types": ["conv"] * 15 + ["mamba"]}, "unsupported layer type"),
    ({"num_key_value_heads": 5}, "num_key_value_heads"),
    ({"block_ff_dim": 0}, "intermediate_size"),
])
def test_bad_lfm2_configs_raise(change: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        parse_model_config({**LFM2_1B2, **change})


@pytest.mark.parametrize("length", [8192, 131072])
@pytest.mark.parametrize("steps", [1, 2], ids=["sync", "async"])
def test_conv_state_bytes_per_token_by_hand(length: int, steps: int) -> None:
    """LFM2-1.2B in bf16, blocks of 16, prefix caching on (the engine's layout).

    Per layer: an attention page is 2 (K, V) * 16 tokens * 8 KV heads * 64 * 2 bytes =
    32768 bytes; a conv state [2048, 2] * 2 bytes = 8192 bytes, one page. 6 attention and
    10 conv layers: groups of 6 layers (the smaller count), so 1 attention group and 2 conv
    groups (6 + 4 layers); a block is 6 pages of 32768 = 196608 bytes. A request holds
    cdiv(L, 16) attention blocks and, its state kept in place, 1 block per conv group
    whatever the steps in flight (checkpoints are best-effort, outside the cap)::

        L = 8192:    (512 + 2) * 196608 = 101,056,512 bytes = 12336 B / token
        L = 131072: (8192 + 2) * 196608 = 1,611,005,952 bytes = 12291 B / token

    against the need, 6 layers * 2048 bytes of K/V per token plus 10 states of 8192 bytes:
    100,745,216 bytes (12298 B / token) at 8k, 1,610,694,656 (12288.6 B / token) at 128k.
    """
    specs = model_kv_layer_specs(parse_model_config(LFM2_1B2), block_size=16, dtype="bfloat16")
    assert specs["layers.0"] == MambaSpec(16, ((2048, 2),), "bfloat16")
    assert specs["layers.2"] == FullAttentionSpec(16, 8, 64, "bfloat16")
    groups = with_mamba_checkpoints(group_layers(specs), WindowTail(max_in_flight_steps=steps))
    assert sorted(len(g.layer_names) for g in groups) == [4, 6, 6]
    in_flight_tokens = steps * 8192
    held = bytes_per_block(groups) * blocks_per_request(groups, in_flight_tokens, length)
    expected = {8192: 101_056_512, 131072: 1_611_005_952}[length]
    assert held == expected
    need = 6 * 2048 * length + 10 * 8192
    assert need == {8192: 100_745_216, 131072: 1_610_694_656}[length]
    assert held // length == {8192: 12336, 131072: 12291}[length]
