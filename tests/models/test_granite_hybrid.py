"""Granite 4.0-H (GraniteMoeHybridForCausalLM): its config fields as parsed, and the ones we
refuse. Its tokens against HF run in every test parametrized over hf_tiny_mamba.KINDS
("granite"), and in test_model_parallel's pipeline and tensor-parallel checks (with a
dense, rotated variant, "granite_rope_dense")."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybridserve.core.errors import ConfigError  # noqa: E402
from hybridserve.models.arch.mamba_config import MAMBA  # noqa: E402
from hybridserve.models.arch.mamba_hybrid_config import HybridOptions  # noqa: E402
from hybridserve.models.config import FULL, load_model_config, parse_model_config  # noqa: E402
from hybridserve.models.parallel import tp_sizes_that_work  # noqa: E402
from tests.helpers import hf_tiny_mamba as tiny  # noqa: E402
from tests.helpers.tiny_models import model_dir  # noqa: E402


def _raw() -> dict:
    return json.loads((tiny.tiny_model_dir("granite") / "config.json").read_text())


def test_the_tiny_config_as_parsed() -> None:
    cfg = load_model_config(tiny.tiny_model_dir("granite"))
    assert cfg.family == "granite_hybrid" and cfg.layer_types == (MAMBA, FULL, MAMBA, MAMBA)
    # The helper's numbers: shared MLP 64, experts of 32, multipliers 4, 0.5, 0.2 and 2.
    assert cfg.hybrid == HybridOptions(residual_multiplier=0.5, logits_divisor=2.0, num_experts=4,
                                       experts_per_tok=2, expert_intermediate_size=32)
    assert (cfg.intermediate_size, cfg.embed_scale, cfg.attn_scale) == (64, 4.0, 0.2)
    assert cfg.rope == {}  # "nope": no rotation
    mc = cfg.mamba
    assert mc is not None and (mc.num_heads, mc.head_dim, mc.n_groups, mc.chunk_size) == (8, 16, 2, 16)
    # 4 heads and 2 KV heads, Mamba heads 8 in 2 groups, shared MLP 64, experts 32: 1, 2, 4.
    assert tp_sizes_that_work(cfg) == [1, 2, 4]


def test_rope_and_dense_variant() -> None:
    cfg = load_model_config(model_dir("granite_rope_dense"))
    assert cfg.rope[FULL].theta == 10000.0 and cfg.rotary_dim is None  # all of each head, unlike Bamba
    assert cfg.hybrid is not None and (cfg.hybrid.num_experts, cfg.hybrid.expert_intermediate_size) == (0, 0)


def test_granite_checkpoint_layer_names_are_read() -> None:
    # Granite's own config.json files spell the kinds "mamba" / "attention"; HF 5 writes the others.
    raw = _raw()
    raw["layer_types"] = ["attention", "linear_attention", "full_attention", "mamba"]
    assert parse_model_config(raw).layer_types == (FULL, MAMBA, FULL, MAMBA)


@pytest.mark.parametrize("change,needle", [
    ({"attention_bias": True}, "attention_bias"),
    ({"position_embedding_type": "alibi"}, "position_embedding_type"),
    ({"layer_types": ["mamba", "moe", "mamba", "mamba"]}, "unsupported layer type"),
    ({"layer_types": ["mamba"] * 3}, "3 entries for 4 layers"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok 5"),
    ({"residual_multiplier": 0}, "residual_multiplier"),
    ({"logits_scaling": -2.0}, "logits_scaling"),
    ({"shared_intermediate_size": None}, "shared_intermediate_size"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_bad_granite_configs_raise(change: dict, needle: str) -> None:
    raw = _raw()
    raw.update(change)
    with pytest.raises(ConfigError, match=needle):
        parse_model_config(raw)
