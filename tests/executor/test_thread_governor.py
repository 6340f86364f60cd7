"""executor/torch/threads.py: the thread count each step runs with, from measured step times.

The schedules below are derived by hand from the rules: a bucket measures 2 threads for 3
steps (the first not counted), then 1 thread for 3 steps, then runs the cheaper, and
re-measures the other once the bucket has taken 64 steps since that count's last counted
step (1024 when the other is 1 thread and 2 run), or once the running count's median has
passed the other's (5 steps or more after the other's last counted step). A re-measurement that beats the running count is
followed by one of the running count, and the two fresh medians decide. A step of 256
tokens or more, or one holding a prompt chunk, runs 2 threads and measures 1 thread first
only once a smaller bucket runs 1 thread, or after 1024 steps of its bucket.
"""

from __future__ import annotations

from typing import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.executor.torch.threads import (EXPLORE_EVERY, EXPLORE_SMALLER_EVERY, EXPLORE_STEPS,
                                                LARGE_STEP_TOKENS, WINDOW, ThreadGovernor)


def run(governor: ThreadGovernor, steps: int, seconds: Callable[[int, int], float], tokens: int = 16,
        holds_prompt: bool = False) -> list[int]:
    """The thread count of each of `steps` steps of `tokens` tokens; step i (from 1) with t
    threads takes seconds(i, t)."""
    chosen = []
    for i in range(1, steps + 1):
        t = governor.choose(tokens, holds_prompt=holds_prompt)
        governor.observe(tokens, t, seconds(i, t))
        chosen.append(t)
    return chosen


def test_the_schedule_constants_the_hand_derivations_assume() -> None:
    assert (EXPLORE_EVERY, EXPLORE_SMALLER_EVERY, EXPLORE_STEPS, WINDOW, LARGE_STEP_TOKENS) == (64, 1024, 3, 5, 256)


def test_one_core_never_switches() -> None:
    g = ThreadGovernor(1)
    assert run(g, 100, lambda i, t: 1.0) == [1] * 100


def test_a_busy_machine_settles_on_one_thread_and_rechecks_two_every_64_steps() -> None:
    chosen = run(ThreadGovernor(2), 200, lambda i, t: 1.0 if t == 2 else 0.5)
    # Steps 1-3 measure 2 threads (2 and 3 counted: last at bucket step 3), 4-6 measure 1;
    # 2 threads are re-measured when the bucket has taken 64 steps since step 3 (steps
    # 68-70, counted up to 70), then since 70 (steps 135-137); 202 is past the end.
    two = [i for i, t in enumerate(chosen, start=1) if t == 2]
    assert two == [1, 2, 3, 68, 69, 70, 135, 136, 137]


def test_a_quiet_machine_settles_on_all_threads_and_rechecks_one_every_1024_steps() -> None:
    chosen = run(ThreadGovernor(2), 2100, lambda i, t: 0.4 if t == 2 else 0.5)
    one = [i for i, t in enumerate(chosen, start=1) if t == 1]
    # 1 thread measured at steps 4-6 (counted up to 6); no suspicion (2 threads' 0.4 never
    # passes 0.5), so it is re-measured when the bucket has taken 1024 steps since step 6
    # (choose at step 1031 sees 1030 observed), and again 1024 after 1033 (steps 2058-2060).
    assert one == [4, 5, 6, 1031, 1032, 1033, 2058, 2059, 2060]


def test_the_choice_follows_a_load_that_goes_away() -> None:
    # Busy until step 100 (1 thread faster), quiet after (2 threads faster).
    chosen = run(ThreadGovernor(2), 200, lambda i, t: (1.0 if t == 2 else 0.5) if i <= 100 else
                 (0.25 if t == 2 else 0.5))
    # 2 threads re-measured at 135-137 under the new load (its old times are replaced): 0.25
    # beats 1 thread's 0.5, so 1 thread is measured afresh at 138-140 (139 and 140 counted,
    # still 0.5) and 2 threads run from 141; 1 thread, last counted at 140, would be
    # re-measured from bucket step 140 + 1024 + 1 = 1165, past the end.
    assert chosen[134:137] == [2, 2, 2]
    assert chosen[137:140] == [1, 1, 1]
    assert chosen[140:200] == [2] * 60


def test_step_sizes_are_measured_apart() -> None:
    g = ThreadGovernor(2)
    # Decodes of 16 tokens: 1 thread is faster; a 1024-token prefill: 2 threads are.
    run(g, 10, lambda i, t: 1.0 if t == 2 else 0.5, tokens=16)
    prefill = run(g, 10, lambda i, t: 1.0 if t == 2 else 4.0, tokens=1024)
    assert prefill == [2, 2, 2, 1, 1, 1, 2, 2, 2, 2]
    assert g.choose(16) == 1 and g.choose(1024) == 2


def test_one_delayed_step_does_not_switch_the_count() -> None:
    # Quiet: 2 threads 0.4 s, 1 thread 0.5 s; step 20 (2 threads) is delayed to 2.0 s. The
    # 2-thread median of its last 5 counted steps (0.4 x 4 and 2.0) stays 0.4, so 1 thread
    # is run only when first measured (steps 4-6), as without the delay.
    chosen = run(ThreadGovernor(2), 100, lambda i, t: (2.0 if i == 20 else 0.4) if t == 2 else 0.5)
    assert [i for i, t in enumerate(chosen, start=1) if t == 1] == [4, 5, 6]


def test_a_load_that_stays_moves_the_choice_within_nine_steps() -> None:
    # Quiet until step 30, then 2 threads take 1.0 s (1 thread stays 0.5 s): the 2-thread
    # window holds 0.4 x 5 at step 30; after 3 slow steps (31-33) its median is 1.0 > 0.5,
    # so 1 thread is measured afresh at 34-36 (0.5), beats 1.0, 2 threads are measured
    # afresh at 37-39 (1.0), and 1 thread runs from step 40.
    chosen = run(ThreadGovernor(2), 50, lambda i, t: (0.4 if i <= 30 else 1.0) if t == 2 else 0.5)
    assert chosen[30:33] == [2, 2, 2]
    assert chosen[33:36] == [1, 1, 1]
    assert chosen[36:39] == [2, 2, 2]
    assert chosen[39:50] == [1] * 11


def test_a_machine_wide_slow_spell_is_remeasured_once_not_followed() -> None:
    # Quiet (2 threads 0.4 s, 1 thread 0.5 s) but steps 20-29 run at half speed whatever the
    # count (0.8 and 1.0 s). After 3 slow steps the 2-thread median (0.8 at step 23) passes
    # 1 thread's old 0.5: 1 thread is measured afresh at steps 23-25 (24 and 25 counted, at
    # 1.0), which loses to 2 threads' 0.8, so 2 threads run again from step 26. The next
    # suspicion could come 5 steps after 25, when the spell is over; the scheduled
    # re-measurement comes 1024 steps after 25, past the end.
    chosen = run(ThreadGovernor(2), 100, lambda i, t: (0.4 if t == 2 else 0.5) * (2 if 20 <= i <= 29 else 1))
    assert [i for i, t in enumerate(chosen, start=1) if t == 1] == [4, 5, 6, 23, 24, 25]


def test_a_slow_spell_that_ends_during_the_measurement_does_not_move_the_choice() -> None:
    # Quiet (2 threads 0.4 s, 1 thread 0.5 s), everything 3x slower at steps 20-24. At step
    # 23 the 2-thread window holds 0.4, 0.4, 1.2, 1.2, 1.2 (median 1.2 > 0.5): 1 thread is
    # measured at 23-25, counted at 24 (1.5) and 25 (0.5, the spell is over), median 1.0,
    # which beats the window's 1.2. 2 threads are then measured afresh at 26-28 (0.4) and
    # win, so 1 thread runs again only when re-measured 1024 steps after 25, past the end.
    chosen = run(ThreadGovernor(2), 100, lambda i, t: (0.4 if t == 2 else 0.5) * (3 if 20 <= i <= 24 else 1))
    assert [i for i, t in enumerate(chosen, start=1) if t == 1] == [4, 5, 6, 23, 24, 25]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0.01, max_value=10.0), min_size=1, max_size=400),
       st.lists(st.sampled_from([1, 16, 1024]), min_size=1, max_size=400))
def test_the_running_count_changes_only_when_a_measurement_starts_or_ends(times: list[float],
                                                                         sizes: list[int]) -> None:
    # Whatever the step times and sizes: between two steps of one bucket the count changes
    # only if the earlier step ended a measurement or the later one starts one.
    g = ThreadGovernor(2)
    last: dict[int, tuple[int, bool]] = {}  # bucket -> (count of its last step, that step ended a measurement)
    for k, seconds in enumerate(times):
        tokens = sizes[k % len(sizes)]
        t = g.choose(tokens)
        assert t in g.candidates
        bucket = g._buckets[g._bucket(tokens)]
        starts = bucket.exploring == t and bucket.explore_left == EXPLORE_STEPS
        was_exploring = bucket.exploring is not None
        g.observe(tokens, t, seconds)
        key = g._bucket(tokens)
        if key in last and last[key][0] != t:
            assert last[key][1] or starts
        last[key] = (t, was_exploring and bucket.exploring is None)


def test_prefill_on_a_quiet_machine_never_measures_one_thread_in_its_first_1024_steps() -> None:
    # 2048-token steps (prefill chunks), no decode measured yet, 1 thread would be slower:
    # every core for bucket steps 1-1024, then the scheduled first measurement of 1 thread
    # at steps 1025-1027 (choose sees 1024 observed steps at step 1025).
    chosen = run(ThreadGovernor(2), 1100, lambda i, t: 1.0 if t == 2 else 2.0, tokens=2048)
    assert [i for i, t in enumerate(chosen, start=1) if t == 1] == [1025, 1026, 1027]


def test_a_step_holding_a_prompt_chunk_waits_for_decode_to_measure_one_thread() -> None:
    # Steps of 80 tokens on a quiet machine (2 threads 0.4 s, 1 thread 0.5 s). Holding a
    # prompt chunk, they run 2 threads throughout (steps 1-3 measure 2, then 1 thread is
    # deferred: no smaller bucket runs it). Decode-only steps of the same bucket then
    # measure 1 thread (3 steps) and keep 2; prompt steps after them follow the bucket.
    g = ThreadGovernor(2)
    quiet = lambda i, t: 0.4 if t == 2 else 0.5  # noqa: E731
    assert run(g, 50, quiet, tokens=80, holds_prompt=True) == [2] * 50
    assert run(g, 6, quiet, tokens=80) == [1, 1, 1, 2, 2, 2]
    assert run(g, 20, quiet, tokens=80, holds_prompt=True) == [2] * 20


def test_a_step_holding_a_prompt_chunk_measures_one_thread_once_decode_runs_it() -> None:
    # Busy (1 thread faster): 16-token decode steps settle on 1 thread at step 6, so an
    # 80-token step holding a prompt chunk measures 1 thread at once (after 2 threads: its
    # bucket has no times yet) and runs it.
    g = ThreadGovernor(2)
    busy = lambda i, t: 1.0 if t == 2 else 0.5  # noqa: E731
    run(g, 7, busy, tokens=16)
    assert run(g, 8, busy, tokens=80, holds_prompt=True) == [2, 2, 2, 1, 1, 1, 1, 1]


def test_prefill_measures_one_thread_once_decode_runs_it() -> None:
    g = ThreadGovernor(2)
    first = run(g, 4, lambda i, t: 1.0, tokens=2048)
    # Decodes of 16 tokens find 1 thread faster after 6 steps (2 measured at 1-3, 1 at 4-6).
    run(g, 6, lambda i, t: 1.0 if t == 2 else 0.5, tokens=16)
    # The prefill bucket then measures 1 thread at once (3 steps, the first not counted),
    # and with 1 thread faster there too it runs 1 thread.
    later = run(g, 5, lambda i, t: 1.0 if t == 2 else 0.5, tokens=2048)
    assert first == [2, 2, 2, 2]
    assert later == [1, 1, 1, 1, 1]
