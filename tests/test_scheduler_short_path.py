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


def exact_decode_slot(kv: KVCacheManager, request) -> tuple[int, ...] | None:  # type: ignore[no-untyped-def]
    """append_decode_slot without its decode-end shortcut: the three limits, checked exactly."""
    steady = kv._steady.get(request.request_id)
    if steady is None:
        return None
    _, slot_end, free_basis, cache_end, nulls = steady
    computed = request.num_computed_tokens
    basis = max(0, computed - request.num_in_flight_tokens)
    cacheable = min(request.num_tokens, computed + 1)
    return nulls if computed + 1 <= slot_end and basis < free_basis and cacheable < cache_end else None


@pytest.mark.parametrize("layout", sorted(SPECS))
@pytest.mark.parametrize("window_tail", [False, True])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_short_path_equals_allocate_slots(
    monkeypatch: pytest.MonkeyPatch, layout: str, window_tail: bool, async_scheduling: bool
) -> None:
    taken = {"short": 0, "slow": 0, "near_limit": 0}
    short = KVCacheManager.append_decode_slot

    def checked(self: KVCacheManager, request):  # type: ignore[no-untyped-def]
        nulls = short(self, request)
        assert nulls == exact_decode_slot(self, request)  # the decode-end shortcut changes nothing
        steady = self._steady.get(request.request_id)
        if steady is not None and request.num_computed_tokens >= steady[0]:
            taken["near_limit"] += 1
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
                  window_tail_allocation=window_tail, async_scheduling=async_scheduling)
    assert run.violations == []
    for _, r in reqs:
        assert run.outputs[r.request_id] == reference_output(r.prompt_token_ids, r.sampling_params.max_tokens, 256)
    assert run.num_free_blocks == run.num_blocks - 1  # nothing leaked
    assert taken["short"] > 5 * taken["slow"] > 0  # both paths ran, the short one mostly
    assert taken["near_limit"] > 0  # the exact checks ran too
