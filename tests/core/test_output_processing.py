"""Output processing: the plain-decode fast path settles a row exactly as the general
path does (or leaves it untouched for the general path), and the stop rules hold on
hand-picked cases."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.core.kv.hashing import make_block_hasher
from hybridserve.core.request import Request, RequestStatus, SamplingParams
from hybridserve.core.sched.output import ScheduledRequest
from hybridserve.core.sched.output_processing import append_tokens, settle_plain_decodes

EOS = 2


def request(prompt_len: int, outputs: list[int], max_tokens: int, min_tokens: int, stop: tuple[int, ...],
            ignore_eos: bool) -> Request:
    r = Request("r", list(range(10, 10 + prompt_len)),
                SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, stop_token_ids=stop, ignore_eos=ignore_eos),
                eos_token_id=EOS)
    r.output_token_ids.extend(outputs)
    r.set_block_hasher(make_block_hasher(4))  # hashes the blocks the tokens so far fill
    return r


def state(r: Request) -> tuple:
    return (list(r.output_token_ids), list(r.block_hashes), r.num_in_flight_tokens, r.num_output_placeholders,
            r.stop_reason, r.status)


@settings(max_examples=400, deadline=None)
@given(
    prompt_len=st.integers(1, 12),
    outputs=st.lists(st.integers(0, 6), max_size=8),
    max_tokens=st.integers(1, 10),
    min_tokens=st.integers(0, 4),
    stop=st.lists(st.integers(0, 6), max_size=2).map(tuple),
    ignore_eos=st.booleans(),
    token=st.integers(0, 6),
    max_model_len=st.integers(2, 24),
)
def test_plain_decode_fast_path_settles_as_the_general_path_or_not_at_all(
        prompt_len, outputs, max_tokens, min_tokens, stop, ignore_eos, token, max_model_len):
    fast = request(prompt_len, outputs, max_tokens, min(min_tokens, max_tokens), stop, ignore_eos)
    fast.num_in_flight_tokens, fast.num_output_placeholders = 1, 1  # one decode step in flight
    general = copy.deepcopy(fast)
    before = state(fast)
    row = ScheduledRequest("r", 0, 1, 0, (), (), True)
    got: list = []
    end = settle_plain_decodes([row], [fast], [0], [[token]], 0, max_model_len, 4, None, got)
    new_tokens, status = append_tokens(general, [token], max_model_len, 4)
    if end == 0:
        # Declined: untouched, for the general path. It declines only where a stop is possible.
        assert state(fast) == before and got == []
        assert stop or token == EOS or len(outputs) + 1 >= max_tokens or prompt_len + len(outputs) + 1 >= max_model_len
        return
    assert end == 1 and status is None  # settled only where the general path goes on
    general.num_in_flight_tokens -= 1
    general.num_output_placeholders -= 1
    assert state(fast) == state(general)
    assert [(o.request_id, o.new_token_ids, o.finished, o.finish_reason) for o in got] == [("r", new_tokens, False, None)]
    # Every block the tokens fill is hashed: (prompt + outputs) // 4 of them.
    assert len(fast.block_hashes) == (prompt_len + len(outputs) + 1) // 4


def test_fast_path_stops_at_the_first_row_it_cannot_settle():
    plain, stopping, last = (request(4, [], 9, 0, (), True) for _ in range(3))
    stopping.sampling_params = SamplingParams(max_tokens=9, stop_token_ids=(5,))
    for r in (plain, stopping, last):
        r.num_in_flight_tokens = r.num_output_placeholders = 1
    row = ScheduledRequest("r", 0, 1, 0, (), (), True)
    got: list = []
    assert settle_plain_decodes([row] * 3, [plain, stopping, last], [0] * 3, [[7], [5], [7]], 0, 100, 4, None, got) == 1
    assert plain.output_token_ids == [7] and stopping.output_token_ids == [] and last.output_token_ids == []
    assert settle_plain_decodes([row] * 3, [plain, stopping, last], [0] * 3, [[7], [5], [7]], 2, 100, 4, None, got) == 3
    assert len(got) == 2 and last.output_token_ids == [7]


def test_general_path_stops_at_the_first_stopping_token():
    r = request(4, [], max_tokens=10, min_tokens=0, stop=(5,), ignore_eos=False)
    assert append_tokens(r, [7, 5, 8], 100, 4) == ([7, 5], RequestStatus.FINISHED_STOPPED)
    assert r.output_token_ids == [7, 5] and r.stop_reason == 5


def test_eos_before_min_tokens_goes_on_and_length_caps():
    r = request(4, [], max_tokens=3, min_tokens=2, stop=(), ignore_eos=False)
    assert append_tokens(r, [EOS], 100, 4) == ([EOS], None)  # 1 output < min_tokens 2
    assert append_tokens(r, [EOS], 100, 4) == ([EOS], RequestStatus.FINISHED_STOPPED)
    r = request(4, [], max_tokens=3, min_tokens=0, stop=(), ignore_eos=True)
    assert append_tokens(r, [EOS, EOS, EOS, EOS], 100, 4) == ([EOS] * 3, RequestStatus.FINISHED_LENGTH_CAPPED)
    r = request(4, [], max_tokens=9, min_tokens=0, stop=(), ignore_eos=True)
    assert append_tokens(r, [7], 5, 4) == ([7], RequestStatus.FINISHED_LENGTH_CAPPED)  # 4 + 1 = max_model_len
