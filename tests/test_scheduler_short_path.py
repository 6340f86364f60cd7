"""The scheduler's steady-decode short path agrees with allocate_slots at every use."""

from __future__ import annotations

import random

import pytest

from hybridserve.core.kv.manager import KVCacheManager
from hybridserve.core.kv.spec import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec
from tests.sim_helpers import make_request, reference_output, run_sim

SPECS = {
    "full": [FullAttentionSpec(16, 1, 8)],
    "sliding": [FullAttentionSpec(16, 1, 8), SlidingWindowSpec(16, 1, 8, sliding_window=32)],
    "chunked": [FullAttentionSpec(16, 1, 8), ChunkedLocalAttentionSpec(16, 1, 8, attention_chunk_size=32)],
}


@pytest.mark.parametrize("layout", sorted(SPECS))
@pytest.mark.parametrize("window_tail", [False, True])
def test_short_path_equals_allocate_slots(monkeypatch: pytest.MonkeyPatch, layout: str, window_tail: bool) -> None:
    taken = {"short": 0, "slow": 0}
    short = KVCacheManager.append_decode_slot

    def checked(self: KVCacheManager, request):  # type: ignore[no-untyped-def]
        nulls = short(self, request)
        if nulls is None:
            taken["slow"] += 1
            return None
        taken["short"] += 1
        # The fast path of allocate_slots changes nothing when it allocates nothing.
        assert self.allocate_slots(request, 1) is self.no_new_blocks
        assert nulls == self.get_num_null_blocks(request.request_id)
        return nulls

    monkeypatch.setattr(KVCacheManager, "append_decode_slot", checked)
    rng = random.Random(7)
    reqs = [(rng.randrange(0, 30), make_request(f"r{i}", [rng.randrange(1, 500) for _ in range(rng.randrange(1, 90))],
                                                 rng.randrange(1, 70))) for i in range(24)]
    run = run_sim(SPECS[layout], reqs, num_blocks=120, max_num_batched_tokens=64, max_model_len=256,
                  window_tail_allocation=window_tail)
    assert run.violations == []
    for _, r in reqs:
        assert run.outputs[r.request_id] == reference_output(r.prompt_token_ids, r.sampling_params.max_tokens, 256)
    assert run.num_free_blocks == run.num_blocks - 1  # nothing leaked
    assert taken["short"] > 5 * taken["slow"] > 0  # both paths ran, the short one mostly
