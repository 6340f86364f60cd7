"""Three waves through an engine with CPU KV offload on a tiny decoder model: wave 1, a
filler that pushes it out of the small device pool, and wave 2, which loads its prefixes
back from host memory; every checked token is HF's. And the check that nothing leaked."""

from __future__ import annotations

from tests.helpers import hf_tiny
from tests.helpers.torch_engine import NEW_TOKENS, check_tokens, run

from hybridserve.core.connector.offload import HostOffloadConnector
from hybridserve.engine.loop import EngineCore

PREFIX = 96  # wave 2's second prompt shares six full blocks with wave 1's second
WAVE1 = hf_tiny.random_prompts(2, 100, 120, seed=11)
FILLER = hf_tiny.random_prompts(2, 110, 120, seed=12)  # only evicts; its tokens are not checked


def wave2(kind: str) -> list[list[int]]:
    """A conversation turn (wave-1 prompt + its output + more) and a shared 96-token prefix.

    A sliding-window group keeps only its last window at finish, so for Gemma 3 only the
    continuation can come back from host memory; full attention serves both."""
    a0, a1 = WAVE1
    return [a0 + hf_tiny.oracle(kind, a0, NEW_TOKENS)[0] + [5, 6, 7], a1[:PREFIX] + [7, 8, 9, 10, 11]]


def run_waves(kind: str, eng: EngineCore) -> list[int]:
    """Wave 1, the filler (pushes wave 1 out of the small device pool), wave 2; checks tokens."""
    first = run(eng, WAVE1, tag="a")
    run(eng, FILLER, tag="f")
    second = run(eng, wave2(kind), tag="b")
    check_tokens(kind, WAVE1, first, tag="a")
    check_tokens(kind, wave2(kind), second, tag="b")
    return [second[f"b{i}"][2] for i in range(2)]  # device prefix-cache hits of wave 2


def assert_nothing_leaks(eng: EngineCore, conn: HostOffloadConnector) -> None:
    sched = eng.scheduler
    assert not sched.has_unfinished_requests()
    assert sched.kv.pool.num_free_blocks == sched.kv.config.num_blocks - 1  # all but the null block
    assert not conn.pins and not conn.pending_loads and not conn.pending_stores and not conn.pending_keys
    assert eng.executor.offload is not None and not eng.executor.offload._running
