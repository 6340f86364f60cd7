"""CPU KV offload for Mamba2, Bamba and Qwen3-Next, against HF transformers greedy.

With prefix caching a Mamba group keeps a state checkpoint per block, and a finished
request still holds its last whole-block checkpoint, so the offload connector stores it
with the attention blocks. Wave 1 runs two conversations, a filler wave evicts them from
a small device pool, and wave 2 continues them: their Mamba states (and Bamba's
attention blocks) come back from host memory, and every token must be HF's. An injected
load failure must fall back to recomputing. Nothing may leak.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.helpers import hf_tiny_mamba as tiny  # noqa: E402
from tests.helpers.mamba_engine import BS, NEW_TOKENS  # noqa: E402
from tests.helpers.mamba_offload_waves import WAVE1, bamba_waves, make_engine, run_waves  # noqa: E402
from tests.helpers.offload_waves import assert_nothing_leaks  # noqa: E402

from hybridserve.core.errors import ConfigError  # noqa: E402

# Pools small enough that the filler evicts wave 1 from the device; Bamba's and LFM2's with room for
# the best-effort checkpoints (a column costs 9 blocks: 3 layers of 3 pages; LFM2: 3 layers of 1), so wave 1's
# last whole checkpoint is kept and stored.
# Bamba: a state is 3 pages; Granite 4.0-H and Jamba have Bamba's layout. Qwen3-Next's (2
# pages a state, 2 layers a group) evicts wave 1 at 28 with checkpoints to spare.
POOL = {"mamba2": {False: 8, True: 10}, "bamba": {False: 64, True: 64}, "granite": {False: 64, True: 64},
        "nemotron_h": {False: 48, True: 48}, "falcon_h1": {False: 32, True: 32}, "qwen3_next": {False: 28, True: 28},
        "lfm2": {False: 40, True: 40}, "jamba": {False: 64, True: 64}}


@pytest.mark.parametrize("kind", tiny.KINDS)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_next_turn_loads_the_mamba_state_from_host(kind: str, async_scheduling: bool) -> None:
    eng, conn = make_engine(kind, async_scheduling=async_scheduling, num_blocks=POOL[kind][async_scheduling])
    try:
        device_hits = run_waves(kind, eng)
        stats = eng.scheduler.make_stats()
        assert_nothing_leaks(eng, conn)
    finally:
        eng.shutdown()
    # Wave 1 processed its prompt and all outputs but the last: the turn resumes from the
    # checkpoint at the last whole block of that, loaded from host memory.
    ends = [(len(p) + NEW_TOKENS - 1) // BS * BS for p in WAVE1]
    assert all(h < e for h, e in zip(device_hits, ends))
    assert stats.num_offload_hit_tokens == sum(e - h for h, e in zip(device_hits, ends))
    assert stats.num_offloaded_blocks > 0 and stats.num_failed_loads == 0


def test_a_failed_state_load_recomputes() -> None:
    stats = bamba_waves(async_scheduling=True, num_blocks=POOL["bamba"][True], fail_loads=1)
    assert stats.num_failed_loads >= 1


def test_offload_of_a_mamba_model_needs_prefix_caching() -> None:
    with pytest.raises(ConfigError, match="needs prefix caching"):
        make_engine("mamba2", async_scheduling=False, num_blocks=20, prefix_caching=False)
