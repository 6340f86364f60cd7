"""Falcon-H1 (FalconH1ForCausalLM): its config as parsed (each decoder layer two cache layers,
its multipliers), the fields we refuse, and pipeline stages of whole layers. Its tokens
against HF run in every test parametrized over hf_tiny_mamba.KINDS ("falcon_h1") and in
test_model_parallel's pipeline and tensor-parallel checks (with "falcon_h1_gate_only", the
mixer without its RMSNorm)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybridserve.core.errors import ConfigError  # noqa: E402
from hybridserve.models.arch.mamba_config import GATE_ONLY, GATE_THEN_NORM, MAMBA, NORM_THEN_GATE  # noqa: E402
from hybridserve.models.arch.mamba_hybrid_config import FalconH1Scales  # noqa: E402
from hybridserve.models.config import FULL, load_model_config, parse_model_config  # noqa: E402
from hybridserve.models.loaders.loader import load_model  # noqa: E402
from hybridserve.models.parallel import PipelineStage  # noqa: E402
from tests.helpers import hf_tiny_mamba as tiny  # noqa: E402
from tests.helpers.tiny_models import model_dir  # noqa: E402


def _raw() -> dict:
    return json.loads((tiny.tiny_model_dir("falcon_h1") / "config.json").read_text())


def test_the_tiny_config_as_parsed() -> None:
    cfg = load_model_config(tiny.tiny_model_dir("falcon_h1"))
    assert cfg.num_layers == 4 and cfg.layer_types == (FULL, MAMBA, FULL, MAMBA)  # 2 layers, 2 halves each
    assert cfg.hybrid is not None and cfg.hybrid.falcon == FalconH1Scales(
        key=0.7, attention_in=1.3, attention_out=0.9, ssm_in=0.75, ssm_out=1.25, ssm=(1.1, 0.9, 1.2, 0.8, 1.3),
        mlp_gate=0.8, mlp_down=1.2)
    assert (cfg.embed_scale, cfg.logit_scale, cfg.rotary_dim) == (2.0, 0.5, None)
    mc = cfg.mamba
    assert mc is not None and (mc.intermediate_size, mc.head_dim, mc.gate) == (128, 16, NORM_THEN_GATE)
    assert load_model_config(model_dir("falcon_h1_gate_only")).mamba.gate == GATE_ONLY  # type: ignore[union-attr]
    raw = _raw()
    raw["mamba_norm_before_gate"] = False
    assert parse_model_config(raw).mamba.gate == GATE_THEN_NORM  # type: ignore[union-attr]


def test_mixer_width_from_d_ssm() -> None:
    # Falcon-H1-7B: hidden 3072, mamba_d_ssm 3072 (not hidden * expand), 24 heads of 128.
    raw = _raw()
    raw.update(mamba_d_ssm=64, mamba_d_head="auto")
    mc = parse_model_config(raw).mamba
    assert mc is not None and (mc.intermediate_size, mc.head_dim, mc.conv_dim) == (64, 8, 64 + 2 * 2 * 16)


def test_a_pipeline_stage_holds_whole_layers() -> None:
    # 4 cache layers over 3 stages: 2, 1, 1; the second stage would hold half a layer.
    with pytest.raises(ConfigError, match="must hold whole layers; this one holds cache layers 2..2 of 4"):
        load_model(tiny.tiny_model_dir("falcon_h1"), stage=PipelineStage(1, 3))


@pytest.mark.parametrize("change,needle", [
    ({"attention_bias": True}, "attention_bias"),
    ({"projectors_bias": True}, "projectors_bias"),
    ({"mamba_proj_bias": True}, "mamba_proj_bias"),
    ({"ssm_multipliers": [1.0, 2.0]}, "ssm_multipliers must be a list of 5"),
    ({"mamba_d_head": 10}, "differs from the mixer width 128"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_bad_falcon_h1_configs_raise(change: dict, needle: str) -> None:
    raw = _raw()
    raw.update(change)
    with pytest.raises(ConfigError, match=needle):
        parse_model_config(raw)
