from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.ngram_reference import propose_ngram_drafts


def test_proposes_what_followed_the_most_recent_match():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    # The suffix (1, 2, 3) last appeared at 5..7, followed by 7, 8, 5.
    assert propose_ngram_drafts(tokens, 3) == [7, 8, 5]
    assert propose_ngram_drafts(tokens, 10) == [7, 8, 5, 1, 2, 3]


def test_longest_ngram_wins_and_no_match_gives_nothing():
    tokens = [4, 2, 5, 6, 3, 2, 7, 3, 2]
    # (3, 2) recurs at 4..5 followed by 7; the 1-gram (2) alone would also match.
    assert propose_ngram_drafts(tokens, 2) == [7, 3]
    assert propose_ngram_drafts([1, 2, 3, 4], 3) == []
    assert propose_ngram_drafts([5], 3) == []
    assert propose_ngram_drafts([1, 1], 0) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 5), st.integers(1, 4))
def test_drafts_continue_an_earlier_occurrence_of_a_suffix(tokens, k, max_n):
    drafts = propose_ngram_drafts(tokens, k, max_n=max_n)
    assert len(drafts) <= k
    if drafts:
        # Some n-gram suffix occurs earlier, and the drafts are exactly what followed it.
        assert any(
            tokens[i - n : i] == tokens[-n:] and tokens[i : i + len(drafts)] == drafts
            for n in range(1, max_n + 1)
            for i in range(n, len(tokens))
        )
