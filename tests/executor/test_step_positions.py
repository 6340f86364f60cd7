"""step_positions: a decode step's fast path gives the general path's ends, positions and
largest position; both against positions written out by hand."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

np = pytest.importorskip("numpy")
pytest.importorskip("torch")

from hybridserve.executor.torch.model_runner import step_positions, step_positions_general  # noqa: E402


def test_positions_by_hand() -> None:
    # a 3-token chunk from position 5, a decode at 9, a 2-token verify from 0
    ends, positions, top = step_positions([5, 9, 0], [3, 1, 2])
    assert ends.tolist() == [3, 4, 6] and positions.tolist() == [5, 6, 7, 9, 0, 1] and top == 9
    ends, positions, top = step_positions([7, 2, 40], [1, 1, 1])  # a decode step
    assert ends.tolist() == [1, 2, 3] and positions.tolist() == [7, 2, 40] and top == 40
    assert ends.dtype == positions.dtype == np.int64


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 4)), min_size=1, max_size=40))
def test_the_decode_fast_path_gives_the_general_paths_arrays(requests: list[tuple[int, int]]) -> None:
    # counts of 1 take the fast path; 0 and more than 1 (a chunk, drafts) the general one
    starts = [s for s, _ in requests]
    counts = [max(c, 1) if i == 0 else c for i, (_, c) in enumerate(requests)]  # some token in the step
    ends, positions, top = step_positions(starts, counts)
    want = step_positions_general(np.array(starts, dtype=np.int64), np.array(counts, dtype=np.int64))
    assert ends.tolist() == want[0].tolist() and positions.tolist() == want[1].tolist() and top == want[2]
    assert ends.dtype == positions.dtype == np.int64
    ones = [1] * len(starts)
    ends, positions, top = step_positions(starts, ones)
    want = step_positions_general(np.array(starts, dtype=np.int64), np.array(ones, dtype=np.int64))
    assert ends.tolist() == want[0].tolist() and positions.tolist() == want[1].tolist() == starts and top == want[2]
