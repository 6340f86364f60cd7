"""Jamba's config parsing, derived by hand from its config.json fields.

The model itself runs in the recurrent matrices (tests/helpers/hf_tiny_mamba.py KINDS:
greedy, chunked prefill, checkpoints, prefix hits, preemption, drafts, offload, PP / TP).
"""

from __future__ import annotations

import pytest

from hybridserve.core.errors import ConfigError
from hybridserve.core.kv.spec import FullAttentionSpec, MambaSpec
from hybridserve.models.arch.jamba_config import MAMBA1
from hybridserve.models.config import FULL, parse_model_config
from hybridserve.models.kv_specs import model_kv_layer_specs
from hybridserve.models.parallel import tp_sizes_that_work

# Jamba-v0.1's config.json numbers (the fields that shape the layers).
JAMBA_V01 = {
    "architectures": ["JambaForCausalLM"], "vocab_size": 65536, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "attn_layer_period": 8,
    "attn_layer_offset": 4, "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 16,
    "num_experts_per_tok": 2, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 256,
    "mamba_conv_bias": True, "mamba_proj_bias": False, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}


def test_jamba_v01_layers_and_state_shapes() -> None:
    cfg = parse_model_config(JAMBA_V01)
    # Attention at i % 8 == 4: layers 4, 12, 20, 28; experts at odd layers.
    assert [i for i, t in enumerate(cfg.layer_types) if t == FULL] == [4, 12, 20, 28]
    assert cfg.layer_types.count(MAMBA1) == 28 and cfg.rope == {}
    assert cfg.jamba is not None and cfg.jamba.expert_layers == frozenset(range(1, 32, 2))
    mc = cfg.jamba.mixer
    assert (mc.intermediate_size, mc.state_size, mc.conv_kernel, mc.dt_rank) == (8192, 16, 4, 256)
    specs = model_kv_layer_specs(cfg, block_size=16, dtype="bfloat16")
    # conv [8192, 3] + SSM [8192, 16], 2 bytes each: 311296 bytes per layer and request.
    assert specs["layers.0"] == MambaSpec(16, ((8192, 3), (8192, 16)), "bfloat16")
    assert specs["layers.0"].state_size_bytes == 8192 * 19 * 2 == 311296
    assert specs["layers.4"] == FullAttentionSpec(16, 8, 128, "bfloat16")
    # 32 heads, MLP 14336 = 2^11 * 7 and 8192 channels divide by 1..16 ranks in powers of 2
    # (not 3: 8192); 8 KV heads are split up to 8 ranks, shared by 2 at 16.
    assert tp_sizes_that_work(cfg, 16) == [1, 2, 4, 8, 16]


def test_dt_rank_auto_is_hidden_over_16_rounded_up() -> None:
    cfg = parse_model_config({**JAMBA_V01, "hidden_size": 4000, "mamba_dt_rank": "auto",
                              "num_attention_heads": 40, "num_key_value_heads": 8})
    assert cfg.jamba is not None and cfg.jamba.mixer.dt_rank == 250  # ceil(4000 / 16)


def test_one_expert_means_dense_mlps() -> None:
    cfg = parse_model_config({**JAMBA_V01, "num_experts": 1, "num_experts_per_tok": 1})
    assert cfg.jamba is not None and cfg.jamba.expert_layers == frozenset()


@pytest.mark.parametrize("change,needle", [
    ({"attn_layer_offset": 8}, "attn_layer_offset"),
    ({"expert_layer_period": 0}, "expert_layer_period"),
    ({"num_experts_per_tok": 17}, "num_experts_per_tok"),
    ({"mamba_d_conv": 1}, "mamba_d_conv"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mamba_dt_rank": "big"}, "mamba_dt_rank"),
    ({"num_key_value_heads": 5}, "num_key_value_heads"),
])
def test_bad_jamba_configs_raise(change: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        parse_model_config({**JAMBA_V01, **change})
