"""The scheduler's fast paths agree with its general paths: the steady-decode one
(plan_running + allocate_slots) at every use, checked against hand-derived limits and
step by step; the plain-decode one of output processing step by step, on requests that
stop by stop ids, EOS, max_tokens and max_model_len."""

from __future__ import annotations

import random

import pytest

from hybridserve.core.kv.cache_manager import KVCacheManager
from hybridserve.core.kv.spec import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec
from hybridserve.core.request import Request, SamplingParams
from hybridserve.core.sched import scheduler as scheduler_module
from hybridserve.core.sched.scheduler import Scheduler
from tests.helpers.sim_helpers import make_request, reference_output, run_sim

SPECS = {
    "full": [FullAttentionSpec(16, 1, 8)],
    "sliding": [FullAttentionSpec(16, 1, 8), SlidingWindowSpec(16, 1, 8, sliding_window=32)],
    "chunked": [FullAttentionSpec(16, 1, 8), ChunkedLocalAttentionSpec(16, 1, 8, attention_chunk_size=32)],
}


def decode_needs_nothing(kv: KVCacheManager, request) -> bool:  # type: ignore[no-untyped-def]
    """By hand, from the tables: a decode writing position c = num_computed_tokens needs no
    new block (slot c is covered in every group), frees none (the processed count's skip
    boundary stays within the null prefix) and fills none (min(known, c + 1) tokens stay
    below the next uncached block's end)."""
    rid, c = request.request_id, request.num_computed_tokens
    basis = max(0, c - request.num_in_flight_tokens)
    for m in kv.coordinator.managers:
        bs = m.block_size
        if c >= len(m.req_to_blocks[rid]) * bs:
            return False
        if isinstance(m.spec, SlidingWindowSpec):
            skipped = max(0, basis - m.spec.sliding_window + 1)
        elif isinstance(m.spec, ChunkedLocalAttentionSpec):
            skipped = basis // m.spec.attention_chunk_size * m.spec.attention_chunk_size
        else:
            skipped = 0
        if skipped // bs > m.num_null_blocks.get(rid, 0):
            return False
        if min(request.num_tokens, c + 1) >= (m.num_cached_blocks.get(rid, 0) + 1) * bs:
            return False
    return True


def workload() -> list:
    rng = random.Random(7)
    return [(rng.randrange(0, 30), make_request(f"r{i}", [rng.randrange(1, 500) for _ in range(rng.randrange(1, 90))],
                                                 rng.randrange(1, 70))) for i in range(24)]


@pytest.mark.parametrize("layout", sorted(SPECS))
@pytest.mark.parametrize("window_tail", [False, True])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_short_path_equals_allocate_slots(
    monkeypatch: pytest.MonkeyPatch, layout: str, window_tail: bool, async_scheduling: bool
) -> None:
    taken = {"short": 0, "slow": 0}
    short = KVCacheManager.append_decode_slot

    def checked(self: KVCacheManager, request):  # type: ignore[no-untyped-def]
        nulls = short(self, request)
        if nulls is None:
            taken["slow"] += 1
            return None
        taken["short"] += 1
        assert decode_needs_nothing(self, request)
        # The fast path of allocate_slots changes nothing when it allocates nothing.
        assert self.allocate_slots(request, 1) is self.no_new_blocks
        assert nulls == self.get_num_null_blocks(request.request_id)
        return nulls

    monkeypatch.setattr(KVCacheManager, "append_decode_slot", checked)
    reqs = workload()
    run = run_sim(SPECS[layout], reqs, num_blocks=120, max_num_batched_tokens=64, max_model_len=256,
                  window_tail_allocation=window_tail, async_scheduling=async_scheduling)
    assert run.violations == []
    for _, r in reqs:
        assert run.outputs[r.request_id] == reference_output(r.prompt_token_ids, r.sampling_params.max_tokens, 256)
    assert run.num_free_blocks == run.num_blocks - 1  # nothing leaked
    assert taken["short"] > 5 * taken["slow"] > 0  # both paths ran, the short one mostly


@pytest.mark.parametrize("layout", sorted(SPECS))
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_steady_decode_fast_path_schedules_what_the_general_path_schedules(
    monkeypatch: pytest.MonkeyPatch, layout: str, async_scheduling: bool
) -> None:
    """Every step, with and without the fast path: the same requests, token counts, new
    block ids and null-block counts, and so the same outputs."""
    schedule = Scheduler.schedule

    def steps_of(fast: bool) -> list:
        steps: list = []

        def recorded(self: Scheduler):  # type: ignore[no-untyped-def]
            out = schedule(self)
            steps.append([(sr.request_id, sr.num_computed_tokens, sr.num_scheduled_tokens, sr.samples,
                           tuple(map(tuple, sr.new_block_ids)), tuple(sr.num_null_blocks)) for sr in out.requests])
            return out

        monkeypatch.setattr(Scheduler, "schedule", recorded)
        monkeypatch.setattr(Scheduler, "steady_decode_fast_path", fast)
        run = run_sim(SPECS[layout], workload(), num_blocks=120, max_num_batched_tokens=64, max_model_len=256,
                      async_scheduling=async_scheduling)
        assert run.violations == []
        return steps

    fast, general = steps_of(True), steps_of(False)
    assert len(fast) > 50 and fast == general


def stopping_workload() -> list:
    """Requests that end by a stop id, by EOS (some only after min_tokens), by max_tokens
    (EOS ignored) and by max_model_len; stop ids and EOS are tokens each request really
    produces (the simulated executor's tokens are the reference's)."""
    rng = random.Random(11)
    work = []
    for i in range(24):
        prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 90))]
        ref = reference_output(prompt, 60, 256)
        hit = ref[rng.randrange(len(ref))]
        params, eos = [
            (SamplingParams(max_tokens=60, stop_token_ids=(hit,)), None),
            (SamplingParams(max_tokens=60, min_tokens=rng.randrange(0, 20)), hit),
            (SamplingParams(max_tokens=rng.randrange(1, 70), ignore_eos=True), hit),
            (SamplingParams(max_tokens=400, ignore_eos=True), None),  # up to max_model_len
        ][i % 4]
        work.append((rng.randrange(0, 30), Request(f"r{i}", prompt, params, eos_token_id=eos)))
    return work


@pytest.mark.parametrize("num_speculative_tokens", [0, 2])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_plain_decode_fast_path_settles_what_the_general_path_settles(
    monkeypatch: pytest.MonkeyPatch, async_scheduling: bool, num_speculative_tokens: int
) -> None:
    """Every processed step, with and without the fast path: the same outputs (tokens,
    finish, reasons, cached counts), and the same requests' counters after it."""
    update = Scheduler.update_from_output
    settle = scheduler_module.settle_plain_decodes

    def steps_of(fast: bool) -> tuple[list, dict, int]:
        steps: list = []
        settled = [0]

        def recorded(self: Scheduler, so, ro):  # type: ignore[no-untyped-def]
            outs = update(self, so, ro)
            reqs = sorted(self.requests.values(), key=lambda r: r.request_id)
            steps.append(([(o.request_id, tuple(o.new_token_ids), o.finished, o.finish_reason, o.stop_reason,
                            o.num_cached_tokens) for o in outs],
                          [(r.request_id, r.num_computed_tokens, r.num_in_flight_tokens, r.num_output_placeholders,
                            len(r.output_token_ids), len(r.block_hashes)) for r in reqs]))
            return outs

        def counted(*args):  # type: ignore[no-untyped-def]
            end = settle(*args)
            settled[0] += end - args[4]
            return end

        monkeypatch.setattr(Scheduler, "update_from_output", recorded)
        monkeypatch.setattr(Scheduler, "plain_decode_fast_path", fast)
        monkeypatch.setattr(scheduler_module, "settle_plain_decodes", counted)
        run = run_sim(SPECS["sliding"], stopping_workload(), num_blocks=160, max_num_batched_tokens=64,
                      max_model_len=256, async_scheduling=async_scheduling,
                      num_speculative_tokens=num_speculative_tokens, enable_prefix_caching=True)
        assert run.violations == [] and run.num_free_blocks == run.num_blocks - 1
        return steps, run.finish_reasons, settled[0]

    fast, fast_reasons, settled = steps_of(True)
    general, general_reasons, none = steps_of(False)
    assert len(fast) > 50 and fast == general and fast_reasons == general_reasons
    assert sorted(set(fast_reasons.values())) == ["length", "stop"]
    assert none == 0
    if not num_speculative_tokens:  # (rows with drafts are the general path's)
        assert settled > sum(len(outs) for outs, _ in fast) // 2  # the fast path settled most rows
