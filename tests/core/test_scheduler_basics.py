"""Scheduler policies, budgets and bad input."""

from __future__ import annotations

import pytest

from hybridserve.core.errors import ConfigError, RequestError
from hybridserve.core.kv.spec import FullAttentionSpec, SlidingWindowSpec
from hybridserve.core.request import Request, RequestStatus, SamplingParams
from hybridserve.core.sched.output import ModelRunnerOutput
from hybridserve.testing import fake_runner_output, make_requests, make_scheduler


def drain(sched, sampled=None):
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update_from_output(out, fake_runner_output(out, sampled))


def test_token_budget_and_chunked_prefill():
    sched = make_scheduler(max_num_batched_tokens=64, num_blocks=200, max_model_len=512)
    for r in make_requests(2, 100, max_tokens=2):
        sched.add_request(r)
    out = sched.schedule()
    assert [(r.request_id, r.num_scheduled_tokens, r.samples) for r in out.requests] == [("0", 64, False)]
    sched.update_from_output(out, fake_runner_output(out))
    out = sched.schedule()
    assert [(r.request_id, r.num_scheduled_tokens, r.samples) for r in out.requests] == [("0", 36, True), ("1", 28, False)]


def test_long_prefill_threshold_caps_chunks():
    sched = make_scheduler(num_blocks=200, max_model_len=512, long_prefill_token_threshold=40)
    for r in make_requests(2, 100):
        sched.add_request(r)
    out = sched.schedule()
    assert [r.num_scheduled_tokens for r in out.requests] == [40, 40]


def test_max_num_seqs_limits_admission():
    sched = make_scheduler(num_blocks=200, max_model_len=512, max_num_seqs=2)
    for r in make_requests(3, 10):
        sched.add_request(r)
    out = sched.schedule()
    assert [r.request_id for r in out.requests] == ["0", "1"]


def test_prefix_hit_at_admission_skips_cached_tokens():
    sched = make_scheduler(num_blocks=200, max_model_len=512)
    shared = list(range(3, 67))  # 4 full blocks
    a, b = make_requests(2, 80, prefix=shared)
    sched.add_request(a)
    drain(sched)
    sched.add_request(b)
    out = sched.schedule()
    assert out.requests[0].num_computed_tokens == 64
    assert out.requests[0].num_scheduled_tokens == 16
    assert b.num_cached_tokens == 64


def test_hybrid_prefix_hit_agrees_across_groups():
    specs = [FullAttentionSpec(16, 1, 8), SlidingWindowSpec(16, 1, 8, sliding_window=32)]
    sched = make_scheduler(kv_specs=specs, num_blocks=300, max_model_len=512)
    shared = list(range(3, 99))  # 6 blocks
    a, b = make_requests(2, 120, prefix=shared)
    sched.add_request(a)
    drain(sched)
    sched.add_request(b)
    out = sched.schedule()
    assert out.requests[0].num_computed_tokens == 96
    sliding_table = sched.kv.coordinator.managers[1].req_to_blocks["1"]
    # Only the window before the hit (cdiv(31, 16) = 2 blocks) is real; the rest null.
    assert [blk.is_null for blk in sliding_table[:6]] == [True] * 4 + [False] * 2


def test_fcfs_preempts_last_running_and_recomputes():
    sched = make_scheduler(num_blocks=12, max_model_len=64, max_num_batched_tokens=64)
    reqs = make_requests(3, 40, max_tokens=20)
    for r in reqs:
        sched.add_request(r)
    drain(sched)
    assert sched.stats.num_preemptions > 0
    assert all(len(r.output_token_ids) == 20 for r in reqs)
    assert sched.kv.pool.num_free_blocks == 11


def test_priority_policy_preempts_lowest_priority():
    sched = make_scheduler(num_blocks=10, max_model_len=64, max_num_batched_tokens=256, policy="priority")
    reqs = make_requests(3, 40, max_tokens=24)
    for r, prio in zip(reqs, [1, 0, 2]):
        r.priority = prio
        sched.add_request(r)
    seen_preempted = set()
    while sched.has_unfinished_requests():
        out = sched.schedule()
        seen_preempted |= out.preempted_req_ids
        sched.update_from_output(out, fake_runner_output(out))
    assert "2" in seen_preempted and "1" not in seen_preempted


def test_full_sequence_must_fit_defers_admission():
    sched = make_scheduler(num_blocks=20, max_model_len=256, max_num_batched_tokens=256, full_sequence_must_fit=True)
    big = make_requests(2, 100, max_tokens=150)  # 250 tokens -> 16 blocks each
    for r in big:
        sched.add_request(r)
    out = sched.schedule()
    assert [r.request_id for r in out.requests] == ["0"]


def test_duplicate_request_id_is_a_named_error_and_scheduler_stays_usable():
    sched = make_scheduler(num_blocks=100, max_model_len=256)
    (r,) = make_requests(1, 10)
    sched.add_request(r)
    with pytest.raises(RequestError, match="duplicate"):
        sched.add_request(make_requests(1, 12)[0])
    drain(sched)
    assert len(r.output_token_ids) == 16


def test_empty_prompt_and_bad_sampling_are_named_errors():
    with pytest.raises(RequestError, match="empty"):
        Request("x", [])
    with pytest.raises(RequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=-1)


def test_too_long_prompt_finishes_instead_of_raising():
    sched = make_scheduler(num_blocks=100, max_model_len=64)
    out = sched.add_request(Request("long", list(range(2, 80))))
    assert out is not None and out.finished and out.finish_reason == "error"
    out = sched.add_request(Request("exact", list(range(2, 66))))
    assert out is not None and out.finish_reason == "length"
    assert not sched.has_unfinished_requests()
    assert sched.schedule().is_empty()


def test_max_model_len_caps_generation():
    sched = make_scheduler(num_blocks=100, max_model_len=64)
    (r,) = make_requests(1, 60, max_tokens=100)
    sched.add_request(r)
    drain(sched)
    assert r.num_tokens == 64 and r.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_eos_and_stop_tokens():
    sched = make_scheduler(num_blocks=100, max_model_len=256)
    a, b, c = make_requests(3, 10, max_tokens=10, eos_token_id=5)
    b.sampling_params.stop_token_ids = (1000,)
    c.sampling_params.ignore_eos = True
    for r in (a, b, c):
        sched.add_request(r)
    drain(sched, sampled=5)
    assert a.output_token_ids == [5] and a.status == RequestStatus.FINISHED_STOPPED
    assert len(c.output_token_ids) == 10
    sched.add_request(Request("s", list(range(2, 12)), SamplingParams(stop_token_ids=(1000,))))
    drain(sched)
    assert sched.stats.num_generated_tokens == 1 + 1 + 10 + 1


def test_abort_unknown_id_is_ignored_and_abort_waiting_works():
    sched = make_scheduler(num_blocks=100, max_model_len=256, max_num_seqs=1)
    a, b = make_requests(2, 10)
    sched.add_request(a)
    sched.add_request(b)
    sched.abort_requests(["nope", "1"])
    assert b.status == RequestStatus.FINISHED_ABORTED
    drain(sched)
    assert sched.kv.pool.num_free_blocks == 99


def test_output_naming_unknown_request_is_rejected_without_side_effects():
    sched = make_scheduler(num_blocks=100, max_model_len=256)
    (r,) = make_requests(1, 10)
    sched.add_request(r)
    out = sched.schedule()
    with pytest.raises(RequestError, match="did not schedule"):
        sched.update_from_output(out, ModelRunnerOutput(["0", "ghost"], [[1], [2]]))
    assert r.num_in_flight_tokens == 10
    sched.update_from_output(out, fake_runner_output(out))
    assert r.num_in_flight_tokens == 0 and r.output_token_ids == [1000]
    with pytest.raises(RequestError, match="not in flight"):
        sched.update_from_output(out, fake_runner_output(out))


def test_pool_too_small_for_one_request_is_a_config_error():
    with pytest.raises(ConfigError, match="need at least 17"):
        make_scheduler(num_blocks=10, max_model_len=256)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_full_sequence_must_fit_reserves_growth_so_nothing_is_preempted(async_scheduling):
    def run(must_fit):
        sched = make_scheduler(
            kv_specs=[FullAttentionSpec(16, 1, 8), SlidingWindowSpec(16, 1, 8, sliding_window=32)],
            num_blocks=60, max_model_len=256, max_num_batched_tokens=64, async_scheduling=async_scheduling,
            full_sequence_must_fit=must_fit,
        )
        reqs = make_requests(8, 60, max_tokens=100)
        for r in reqs:
            sched.add_request(r)
        drain(sched)
        assert all(len(r.output_token_ids) == 100 for r in reqs)
        return sched.stats.num_preemptions
    assert run(False) > 0
    assert run(True) == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_priority_victim_scheduled_earlier_in_the_step_gives_its_tokens_back(async_scheduling: bool) -> None:
    # "0" runs first (one block, never needs another) but has the lowest priority. When
    # "1" needs a block and none is free, "0" is preempted after this step already
    # scheduled it, and must leave the step with its tokens.
    sched = make_scheduler(num_blocks=5, max_model_len=64, policy="priority", async_scheduling=async_scheduling)
    reqs = [
        Request("0", [7], SamplingParams(max_tokens=15), priority=5, arrival_time=0.0),
        Request("1", list(range(2, 42)), SamplingParams(max_tokens=20), priority=0, arrival_time=1.0),
    ]
    sched.add_request(reqs[0])  # admitted alone first, so it runs ahead of "1"
    in_flight: list = []  # (scheduler output, {request id: tokens}), not yet processed
    victim_left_its_step = False
    while sched.has_unfinished_requests() or in_flight:
        if sched.next_step_id == 1:
            sched.add_request(reqs[1])
        if sched.has_unfinished_requests():
            out = sched.schedule()
            counts = {r.request_id: r.num_scheduled_tokens for r in out.requests}
            in_flight.append((out, counts))
            victim_left_its_step |= "0" in out.preempted_req_ids and "0" not in counts
            for r in reqs:  # each request's in-flight count is exactly its steps still out
                assert r.num_in_flight_tokens == sum(c.get(r.request_id, 0) for _, c in in_flight)
        if len(in_flight) > int(async_scheduling) or not sched.has_unfinished_requests():
            out, _ = in_flight.pop(0)
            sched.update_from_output(out, fake_runner_output(out))
    assert victim_left_its_step
    assert [len(r.output_token_ids) for r in reqs] == [15, 20]
    assert sched.kv.pool.num_free_blocks == 4
