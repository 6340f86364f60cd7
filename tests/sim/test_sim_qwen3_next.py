"""The Qwen3-Next-80B-like preset: 36 Gated DeltaNet layers (their conv and recurrent states
paged as Mamba states) and 12 gated full-attention layers, from the published config, and
the race detector on it: the free-on-processed-tokens rule gives 0 violations, the unsafe
optimistic free > 0 on the same workload."""

from __future__ import annotations

import pytest

from hybridserve.core.kv.spec import FullAttentionSpec, MambaSpec
from hybridserve.sim.presets import get_layout
from hybridserve.sim.workload import WorkloadItem
from tests.helpers.sim_helpers import check_preset_detector


def test_layout_is_qwen3_next_80b() -> None:
    layout = get_layout("qwen3-next-80b-like")
    assert layout.num_layers == 48 and layout.layer_kinds[:4] == ("mamba", "mamba", "mamba", "full")
    assert [i for i, k in enumerate(layout.layer_kinds) if k == "full"] == list(range(3, 48, 4))
    specs = layout.layer_specs(16, "bfloat16")
    # Conv state over q|k|v: 2 * 16 key heads * 128 + 32 value heads * 128 = 8192 channels,
    # kernel 4 -> 3 kept inputs; recurrent state 32 value heads x 128 key dims x 128 value dims.
    assert specs["layers.0.mamba"] == MambaSpec(16, ((8192, 3), (32, 128, 128)), "bfloat16")
    assert specs["layers.0.mamba"].state_size_bytes == (8192 * 3 + 32 * 128 * 128) * 2
    assert specs["layers.3.attn"] == FullAttentionSpec(16, 2, 256, "bfloat16")


@pytest.mark.parametrize("unsafe", [False, True], ids=["rule", "unsafe"])
def test_detector_on_qwen3_next_80b(unsafe: bool) -> None:
    # Its bf16 weights need two H200s: 2 pipeline stages, 2 steps in flight; 256-token
    # chunks of 600-950-token prompts, so blocks of finished chunks are freed while a
    # step that reads them may still be running.
    items = [WorkloadItem(index=i, prompt_len=600 + 70 * i, output_len=40, arrival_time=0.0) for i in range(6)]
    check_preset_detector(unsafe, items, model_layout="qwen3-next-80b-like", gpu="H200", pipeline_parallel_size=2,
                          max_num_batched_tokens=256)
