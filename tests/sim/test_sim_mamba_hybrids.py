"""The Mamba2 hybrids' presets, from their published config.json numbers: Granite 4.0-H
(Mamba-2 with 4 attention layers of 40) and Nemotron-H (Mamba-2, attention and MLP-only
layers by its pattern). The race detector on each: the rule (free on processed tokens)
gives 0 violations, the unsafe optimistic free > 0 on the same workload."""

from __future__ import annotations

import pytest

from hybridserve.core.kv.spec import FullAttentionSpec, MambaSpec
from hybridserve.sim.presets import get_layout
from hybridserve.sim.workload import WorkloadItem
from tests.helpers.sim_helpers import check_preset_detector


def test_granite_4_h_layout() -> None:
    layout = get_layout("granite-4.0-h-like")
    assert layout.num_layers == 40 and layout.layer_counts() == {"mamba": 36, "full": 4}
    assert [i for i, k in enumerate(layout.layer_kinds) if k == "full"] == [5, 15, 25, 35]
    specs = layout.layer_specs(16, "bfloat16")
    # Conv state over x, B and C: 48 heads * 64 + 2 * 1 group * 128 = 3328 channels, 3 inputs;
    # SSM state 48 heads x 64 x 128. Attention: 4 KV heads of 128.
    assert specs["layers.0.mamba"] == MambaSpec(16, ((3328, 3), (48, 64, 128)), "bfloat16")
    assert specs["layers.5.attn"] == FullAttentionSpec(16, 4, 128, "bfloat16")
    # One request's state in one layer: (3328 * 3 + 48 * 64 * 128) * 2 bytes.
    assert specs["layers.0.mamba"].page_size_bytes == 806_400


def test_nemotron_h_layout() -> None:
    layout = get_layout("nemotron-h-like")
    pattern = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
    assert "".join({"mamba": "M", "full": "*", "mlp": "-"}[k] for k in layout.layer_kinds) == pattern
    assert layout.layer_counts() == {"mamba": 24, "mlp": 24, "full": 4}
    specs = layout.layer_specs(16, "bfloat16")
    assert len(specs) == 28 and "layers.1.attn" not in specs  # MLP layers hold nothing
    # Conv state over 128 heads * 64 + 2 * 8 groups * 128 = 10240 channels; SSM 128 x 64 x 128.
    assert specs["layers.0.mamba"] == MambaSpec(16, ((10240, 3), (128, 64, 128)), "bfloat16")
    assert specs["layers.7.attn"] == FullAttentionSpec(16, 8, 128, "bfloat16")


@pytest.mark.parametrize("unsafe", [False, True], ids=["rule", "unsafe"])
@pytest.mark.parametrize("layout", ["granite-4.0-h-like", "nemotron-h-like"])
def test_detector_on_mamba2_hybrids(layout: str, unsafe: bool) -> None:
    # Prompts prefilled in 512-token chunks, two steps in flight: each chunk's step reads
    # the state the step before it writes, and the attention blocks of finished requests
    # are freed while a step that read them may still run.
    items = [WorkloadItem(index=i, prompt_len=3000 + 300 * i, output_len=4, arrival_time=0.0) for i in range(4)]
    check_preset_detector(unsafe, items, model_layout=layout, gpu="H100", max_num_batched_tokens=512)
