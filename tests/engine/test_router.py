"""The data-parallel router: longest sent prefix, full batches, least loaded, bounded record."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridserve.core.errors import ConfigError
from hybridserve.engine.router import Router

BLOCK = 4


@dataclass
class Replica:
    index: int
    num_unfinished: int = 0
    num_routed: int = 0


def prompt(first: int, num_blocks: int, tail: int = 1) -> list[int]:
    return [first + i for i in range(num_blocks * BLOCK + tail)]


def router(max_num_seqs: int = 4, record_blocks: int = 100, policy: str = "prefix") -> Router:
    r = Router(2, BLOCK, max_num_seqs, policy)
    r.record_blocks = record_blocks
    return r


def send(r: Router, replicas: list[Replica], ids: list[int]) -> int:
    chosen = r.choose(ids, replicas)
    chosen.num_routed += 1
    return chosen.index


def test_a_prompt_goes_where_its_longest_prefix_was_sent() -> None:
    r, reps = router(), [Replica(0), Replica(1)]
    assert send(r, reps, prompt(100, 1)) == 0  # nothing sent yet: the least loaded, lowest index
    assert send(r, reps, prompt(200, 3)) == 1  # fewer routed
    reps[1].num_unfinished = 3  # busier, but it holds 3 blocks of the next prompt's prefix
    assert send(r, reps, prompt(200, 3) + [7, 7, 7, 7]) == 1
    assert send(r, reps, prompt(100, 1)) == 0
    assert send(r, reps, prompt(300, 2)) == 0  # no match: the least loaded


def test_a_full_batch_sends_a_matching_prompt_to_a_replica_with_room() -> None:
    r, reps = router(max_num_seqs=2), [Replica(0), Replica(1)]
    assert send(r, reps, prompt(100, 2)) == 0
    reps[0].num_unfinished = 2
    assert send(r, reps, prompt(100, 2)) == 1
    reps[1].num_unfinished = 2  # no room anywhere: a prefix holder (both hold it now; equal loads: the first)
    assert send(r, reps, prompt(100, 2)) == 0


def test_the_record_keeps_the_leading_blocks_within_its_bound() -> None:
    r, reps = router(record_blocks=2), [Replica(0), Replica(1)]
    assert send(r, reps, prompt(100, 3)) == 0
    reps[0].num_unfinished = 1
    # Only blocks 0 and 1 are remembered: a prompt sharing them still goes to replica 0.
    assert send(r, reps, prompt(100, 2, tail=3)) == 0
    r.forget(0)  # a restarted replica's cache is empty
    assert send(r, reps, prompt(100, 2, tail=3)) == 1


@given(st.lists(st.integers(0, 2), min_size=1, max_size=30))
def test_round_robin_cycles_over_the_serving_replicas(down: list[int]) -> None:
    """Replica `d` is not serving at step k when down[k] == d (2: all serve); each pick
    is the next serving replica after the previous pick."""
    r = Router(2, BLOCK, 4, "round_robin")
    reps = [Replica(0), Replica(1)]
    last = None
    for d in down:
        serving = [x for x in reps if x.index != d]
        chosen = r.choose([1, 2, 3], serving).index
        want = serving[0].index if len(serving) == 1 else (0 if last is None else 1 - last)
        assert chosen == want
        last = chosen


def test_an_unknown_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="routing must be one of prefix, round_robin, got 'random'"):
        Router(2, BLOCK, 4, "random")
