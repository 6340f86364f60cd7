"""Nemotron-H (NemotronHForCausalLM): its layer pattern and fields as parsed, the ones we
refuse, and its MLP-only layers holding no KV cache. Its tokens against HF run in every
test parametrized over hf_tiny_mamba.KINDS ("nemotron_h") and in test_model_parallel's
pipeline and tensor-parallel checks."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybridserve.core.errors import ConfigError  # noqa: E402
from hybridserve.core.kv.spec import FullAttentionSpec, MambaSpec  # noqa: E402
from hybridserve.models.arch.mamba_config import MAMBA  # noqa: E402
from hybridserve.models.arch.mamba_hybrid_config import MLP_ONLY, RELU2  # noqa: E402
from hybridserve.models.config import FULL, load_model_config, parse_model_config  # noqa: E402
from hybridserve.models.kv_specs import model_kv_layer_specs  # noqa: E402
from hybridserve.models.parallel import tp_sizes_that_work  # noqa: E402
from tests.helpers import hf_tiny_mamba as tiny  # noqa: E402


def _raw() -> dict:
    return json.loads((tiny.tiny_model_dir("nemotron_h") / "config.json").read_text())


def test_the_tiny_config_as_parsed() -> None:
    cfg = load_model_config(tiny.tiny_model_dir("nemotron_h"))
    assert cfg.layer_types == (MAMBA, MLP_ONLY, FULL, MAMBA, MLP_ONLY) and cfg.num_layers == 5
    assert cfg.rope == {} and cfg.attn_scale == pytest.approx(16**-0.5)  # attention without RoPE
    assert cfg.hybrid is not None and (cfg.hybrid.mlp, cfg.hybrid.mlp_layers) == (RELU2, True)
    mc = cfg.mamba
    assert mc is not None and (mc.num_heads, mc.head_dim, mc.n_groups, mc.state_size) == (8, 16, 2, 16)
    # 4 heads / 2 KV heads, MLP 128, Mamba heads 8 in 2 groups: 1, 2, 4.
    assert tp_sizes_that_work(cfg) == [1, 2, 4]


def test_mlp_layers_hold_no_cache() -> None:
    specs = model_kv_layer_specs(load_model_config(tiny.tiny_model_dir("nemotron_h")), 16)
    assert sorted(specs) == ["layers.0", "layers.2", "layers.3"]
    assert specs["layers.0"] == MambaSpec(16, ((192, 3), (8, 16, 16)), "float32")  # conv 128 + 2 * 2 * 16
    assert specs["layers.2"] == FullAttentionSpec(16, 2, 16, "float32")


def test_the_pattern_and_older_spellings() -> None:
    # Nemotron-H-8B's config.json: hybrid_override_pattern, attention_head_dim, hidden_act relu2,
    # and 128 Mamba heads of 64 (H * P need not be hidden_size * expand).
    raw = _raw()
    del raw["layers_block_type"]
    raw.update(hybrid_override_pattern="M*-M", attention_head_dim=32, hidden_act="relu2", mamba_head_dim=32)
    del raw["head_dim"]
    cfg = parse_model_config(raw)
    assert cfg.layer_types == (MAMBA, FULL, MLP_ONLY, MAMBA) and cfg.head_dim == 32
    assert cfg.mamba is not None and cfg.mamba.intermediate_size == 256 != 2 * cfg.hidden_size


@pytest.mark.parametrize("change,needle", [
    ({"layers_block_type": ["linear_attention", "moe"]}, "mixture-of-experts"),
    ({"layers_block_type": "M-X"}, r"unsupported NemotronH layer kind\(s\) \['X'\]"),
    ({"layers_block_type": None}, "needs layers_block_type"),
    ({"mlp_hidden_act": "silu"}, "mlp_hidden_act"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act"),
    ({"n_groups": 3}, "n_groups"),
])
def test_bad_nemotron_h_configs_raise(change: dict, needle: str) -> None:
    raw = _raw()
    raw.update(change)
    with pytest.raises(ConfigError, match=needle):
        parse_model_config(raw)
