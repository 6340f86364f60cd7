"""The Command R7B-like preset: Cohere2's layout (3 sliding layers of window 4096 : 1 full)
from the published config, and the race detector on it: the free-on-processed-tokens rule
gives 0 violations, the unsafe optimistic free > 0 on the same workload."""

from __future__ import annotations

import pytest

from hybridserve.sim.presets import get_layout
from hybridserve.sim.workload import WorkloadItem
from tests.helpers.sim_helpers import check_preset_detector


def test_layout_is_command_r7b() -> None:
    layout = get_layout("command-r7b-like")
    assert layout.num_layers == 32 and layout.sliding_window == 4096
    assert layout.layer_kinds[:4] == ("sliding", "sliding", "sliding", "full")
    assert layout.layer_kinds.count("full") == 8
    assert (layout.num_q_heads, layout.num_kv_heads, layout.head_dim, layout.hidden_size) == (32, 8, 128, 4096)


@pytest.mark.parametrize("unsafe", [False, True], ids=["rule", "unsafe"])
def test_detector_on_command_r7b(unsafe: bool) -> None:
    # Prompts past the 4096-token window, prefilled in 512-token chunks with two steps in flight:
    # out-of-window blocks become free while a step that read them may still be running.
    items = [WorkloadItem(index=i, prompt_len=5000 + 300 * i, output_len=4, arrival_time=0.0) for i in range(3)]
    check_preset_detector(unsafe, items, model_layout="command-r7b-like", gpu="H100", max_num_batched_tokens=512)
