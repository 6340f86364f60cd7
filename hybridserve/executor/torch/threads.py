"""How many threads a step runs with: the count measured fastest on the CPU this process gets.

On a quiet machine every core helps. On a machine shared with other busy processes, each
parallel region waits for whichever of its threads the OS has descheduled, and one thread
is faster (`benchmarks/cpu_peers.py --busy N`; benchmarks/results/cpu_threads.md). Which
case holds is not known in advance and changes while serving, so it is measured.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

# Steps of a size bucket between re-measurements of a larger thread count than the one
# running: rare enough that measuring it under load costs little (1 step in 64 at up to
# ~2x its time: ~1.5%), often enough to find within seconds that a load has gone (which
# makes no suspicion: the running count only gets faster).
EXPLORE_EVERY = 64
# The same for a smaller count than the one running. A load arriving shows first as
# suspicion (the running count's median passing the smaller count's), so the schedule is
# only a backstop; on a quiet machine each such measurement is 3 slower steps, and at 1 in
# 64 they were the served p99 of time to first token under Poisson arrivals (a measured
# step holding a prefill: benchmarks/results/serving_peers.md).
EXPLORE_SMALLER_EVERY = 1024
# Steps measured per visit to another count; the first after a switch is not counted
# (threads that slept and caches that hold the other count's layout make it an outlier).
EXPLORE_STEPS = 3
# Counted steps per count whose median is its cost. A median, not a running average: one
# step the OS delays moves an average past the other count's and keeps a quiet machine on
# the slower count for many steps, while a load that stays moves the median within 3
# steps (benchmarks/results/thread_count.md, cpu_threads.md).
WINDOW = 5
# Steps of at least this many tokens are prefill chunks (decode steps have one token per
# running request), and so is any step that holds a prompt chunk (a 64-token prompt among
# decodes): a slower count measured on one delays every first token in it (a server's
# TTFT p99 under Poisson arrivals was such steps' first 1-thread measurements). Such a
# step measures a smaller count for the first time only once a smaller bucket runs it (the
# load favours it there first), or once its bucket has taken EXPLORE_SMALLER_EVERY steps;
# until then it runs every core, and the bucket's decode-only steps measure.
LARGE_STEP_TOKENS = 256


@dataclass
class _Bucket:
    """The measurements of one step size (token count rounded down to a power of 2)."""

    steps: int = 0
    times: dict[int, deque[float]] = field(default_factory=dict)  # threads -> the last WINDOW seconds per token
    measured_at: dict[int, int] = field(default_factory=dict)  # threads -> `steps` when last measured
    best: int | None = None  # the count the bucket runs, decided when a measurement ends
    exploring: int | None = None  # the count being measured, if any
    challenger: int | None = None  # measured faster than `best`, which is being measured again
    explore_left: int = 0
    stale: bool = False  # the explored count's times are old: its next measurement replaces them


class ThreadGovernor:
    """Picks each step's thread count among `candidates` from measured step times.

    Per bucket of step sizes it keeps the seconds per scheduled token of each candidate's
    last WINDOW counted steps and runs the count with the lowest median. Another count is
    measured afresh for EXPLORE_STEPS steps (its old times dropped: the load they were
    measured under may be gone) when EXPLORE_EVERY steps of the bucket have passed since it
    was last measured (EXPLORE_SMALLER_EVERY for a count smaller than the running one), or
    sooner when the running count's median has grown past the other's (a load arrived, or
    the machine as a whole slowed down). Only measurements change the
    choice: when the fresh times beat the running count's, the running count is measured
    afresh too, right after, and the two fresh medians decide. Switching on the running
    count's times against a median measured long before let this VM's machine-wide slow
    spells (every count slower for a few seconds) move a quiet machine to 1 thread for up
    to 17 steps of a 128-token stream, and a trial version that compared the fresh times
    with a window still holding such a spell kept it there for 57. A candidate never
    measured in a bucket is measured first (the largest first), except that a step of
    LARGE_STEP_TOKENS or more, or one holding a prompt chunk, runs every core and measures
    a smaller count first only when a smaller bucket runs that count, or after
    EXPLORE_SMALLER_EVERY steps of its bucket.

    Invariants: `choose` returns a member of `candidates`; with one candidate it always
    returns it; `observe` counts only steps run with the count `choose` returned and skips
    the first step after the count changed; the running count changes only when a
    measurement ends.
    """

    def __init__(self, max_threads: int) -> None:
        self.candidates = sorted({1, max_threads}, reverse=True)
        self._buckets: dict[int, _Bucket] = {}
        self._last: int | None = None  # the count the previous step ran with
        self._switched = False

    @staticmethod
    def _bucket(num_tokens: int) -> int:
        return max(1, num_tokens).bit_length()

    def choose(self, num_tokens: int, holds_prompt: bool = False) -> int:
        """The thread count to run a step of `num_tokens` tokens with; `holds_prompt`: some
        request in it computes more than one token (a prompt chunk)."""
        key = self._bucket(num_tokens)
        b = self._buckets.setdefault(key, _Bucket())
        threads = self._pick(b, key, holds_prompt)
        self._switched = threads != self._last
        self._last = threads
        return threads

    def _pick(self, b: _Bucket, key: int, holds_prompt: bool) -> int:
        if len(self.candidates) == 1:
            return self.candidates[0]
        if b.exploring is not None:
            return b.exploring
        unmeasured = [c for c in self.candidates if c not in b.times]
        for c in unmeasured:
            if not self._defer_first_measurement(b, key, c, holds_prompt):
                return self._explore(b, c)
        if unmeasured:  # a large bucket waiting to measure a smaller count: every core
            return self.candidates[0]
        if b.best is None:  # every count measured once, back to back
            b.best = min(self.candidates, key=lambda c: self._cost(b, c))
        running = self._cost(b, b.best)
        for c in self.candidates:
            if c == b.best:
                continue
            since = b.steps - b.measured_at[c]
            every = EXPLORE_EVERY if c > b.best else EXPLORE_SMALLER_EVERY
            # Suspicion waits until the running count's window holds only steps run after
            # c's last measurement, so one slow spell triggers one re-measurement.
            if since >= every or (since >= WINDOW and running > self._cost(b, c)):
                return self._explore(b, c)
        return b.best

    def _defer_first_measurement(self, b: _Bucket, key: int, threads: int, holds_prompt: bool) -> bool:
        """Whether a large step (or one holding a prompt chunk) waits before measuring
        `threads` for the first time."""
        large = holds_prompt or key >= self._bucket(LARGE_STEP_TOKENS)
        if not large or threads == self.candidates[0] or b.steps >= EXPLORE_SMALLER_EVERY:
            return False
        small = self._bucket(LARGE_STEP_TOKENS)
        return not any(other.best == threads for k, other in self._buckets.items() if k < small)

    @staticmethod
    def _explore(b: _Bucket, threads: int) -> int:
        b.exploring, b.explore_left, b.stale = threads, EXPLORE_STEPS, True
        return threads

    def observe(self, num_tokens: int, threads: int, seconds: float) -> None:
        """Record that a step of `num_tokens` tokens took `seconds` with `threads` threads."""
        b = self._buckets.setdefault(self._bucket(num_tokens), _Bucket())
        b.steps += 1
        if not self._switched and threads in self.candidates:
            if threads not in b.times or (b.stale and b.exploring == threads):
                b.times[threads], b.stale = deque(maxlen=WINDOW), False  # a re-measured count starts afresh
            b.times[threads].append(seconds / max(1, num_tokens))
            b.measured_at[threads] = b.steps
        if b.exploring == threads:
            b.explore_left -= 1
            if b.explore_left <= 0:
                b.exploring = None
                self._decide(b, threads)

    def _decide(self, b: _Bucket, measured: int) -> None:
        """After `measured`'s measurement: whether the bucket runs another count from now on."""
        challenger, b.challenger = b.challenger, None
        if b.stale:
            return  # no step of the measurement counted (each followed a change of count)
        if b.best is None:
            # The first measurements: once every count has times, the cheapest runs.
            if all(c in b.times for c in self.candidates):
                b.best = min(self.candidates, key=lambda c: self._cost(b, c))
            return
        if measured != b.best and self._cost(b, measured) < self._cost(b, b.best):
            # Before switching, measure the running count again: its window may hold a slow
            # spell that has just ended; fresh times on both sides, back to back, decide.
            b.challenger = measured
            self._explore(b, b.best)
        elif measured == b.best and challenger is not None:
            b.best = min((b.best, challenger), key=lambda c: self._cost(b, c))

    @staticmethod
    def _cost(b: _Bucket, threads: int) -> float:
        return statistics.median(b.times[threads])
