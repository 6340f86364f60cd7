"""Output processing: the one-token fast path appends and stops exactly as the general
path does, and the stop rules hold on hand-picked cases."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.core.kv.hashing import make_block_hasher
from hybridserve.core.request import Request, RequestStatus, SamplingParams
from hybridserve.core.sched.output_processing import append_one_token, append_tokens

EOS = 2


def request(prompt_len: int, outputs: list[int], max_tokens: int, min_tokens: int, stop: tuple[int, ...],
            ignore_eos: bool) -> Request:
    r = Request("r", list(range(10, 10 + prompt_len)),
                SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, stop_token_ids=stop, ignore_eos=ignore_eos),
                eos_token_id=EOS)
    r.output_token_ids.extend(outputs)
    r.set_block_hasher(make_block_hasher(4))  # hashes the blocks the tokens so far fill
    return r


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
def test_one_token_fast_path_agrees_with_the_general_path(prompt_len, outputs, max_tokens, min_tokens, stop,
                                                          ignore_eos, token, max_model_len):
    fast = request(prompt_len, outputs, max_tokens, min_tokens, stop, ignore_eos)
    general = request(prompt_len, outputs, max_tokens, min_tokens, stop, ignore_eos)
    assert ([token], append_one_token(fast, token, max_model_len, 4)) == append_tokens(general, [token], max_model_len, 4)
    assert (fast.output_token_ids, fast.stop_reason) == (general.output_token_ids, general.stop_reason)
    # Every block the tokens fill is hashed: (prompt + outputs) // 4 of them.
    assert fast.block_hashes == general.block_hashes
    assert len(fast.block_hashes) == (prompt_len + len(outputs) + 1) // 4


def test_general_path_stops_at_the_first_stopping_token():
    r = request(4, [], max_tokens=10, min_tokens=0, stop=(5,), ignore_eos=False)
    assert append_tokens(r, [7, 5, 8], 100, 4) == ([7, 5], RequestStatus.FINISHED_STOPPED)
    assert r.output_token_ids == [7, 5] and r.stop_reason == 5


def test_eos_before_min_tokens_goes_on_and_length_caps():
    r = request(4, [], max_tokens=3, min_tokens=2, stop=(), ignore_eos=False)
    assert append_one_token(r, EOS, 100, 4) is None  # 1 output < min_tokens 2
    assert append_one_token(r, EOS, 100, 4) == RequestStatus.FINISHED_STOPPED
    r = request(4, [], max_tokens=3, min_tokens=0, stop=(), ignore_eos=True)
    assert append_tokens(r, [EOS, EOS, EOS, EOS], 100, 4) == ([EOS] * 3, RequestStatus.FINISHED_LENGTH_CAPPED)
    r = request(4, [], max_tokens=9, min_tokens=0, stop=(), ignore_eos=True)
    assert append_one_token(r, 7, 5, 4) == RequestStatus.FINISHED_LENGTH_CAPPED  # 4 + 1 = max_model_len
