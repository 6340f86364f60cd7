"""Mamba state checkpoints in the simulator: the specs, the check that a run is right (no
shadow-KV violation, reference outputs, every block back), and the multi-turn offload
workload whose next turn loads its Mamba state from host memory."""

from __future__ import annotations

from hybridserve.core.kv.spec import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from tests.helpers.sim_helpers import make_request, reference_output, run_sim

BS = 16
FULL = FullAttentionSpec(BS, 1, 8)
SW = SlidingWindowSpec(BS, 1, 8, sliding_window=32)
MAMBA = MambaSpec(BS, shapes=((4, 4),))
MML = 1024


def check(run, reqs, max_model_len: int = MML) -> None:
    assert run.violations == []
    for _, r in reqs:
        assert run.outputs[r.request_id] == reference_output(r.prompt_token_ids, r.max_tokens, max_model_len)
    assert run.num_free_blocks == run.num_blocks - 1


def offload_workload(specs, unsafe: bool = False, failure_rate: float = 0.0, *, prompt_len: int = 150,
                      max_tokens: int = 21, num_evict: int = 6, evict_max_tokens: int = 4, evict_at: int = 30,
                      turn2_at: int = 200, turn2_extra: int = 30, turn2_max_tokens: int = 15, num_blocks: int = 40,
                      budget: int = 64, num_conversations: int = 2, **sched_kw):
    """Turn 1, then unrelated requests that evict it from a small pool, then turn 2
    (turn 1's prompt + output + more): its Mamba state comes back from host memory.
    sched_kw: run_sim's scheduling options (async_scheduling, max_num_seqs, policy, ...)."""
    first = [(0, make_request(f"a{i}", [(i * 131 + j) % 30_000 + 2 for j in range(prompt_len)], max_tokens))
             for i in range(num_conversations)]
    evict = [(evict_at, make_request(f"e{i}", [(i * 17 + j) % 999 + 3 for j in range(200)], evict_max_tokens))
             for i in range(num_evict)]
    turn2 = [(turn2_at, make_request("t2-" + r.request_id, r.prompt_token_ids
                                     + reference_output(r.prompt_token_ids, max_tokens, 256) + [7] * turn2_extra,
                                     turn2_max_tokens))
             for _, r in first]
    reqs = first + evict + turn2
    run = run_sim(specs, reqs, num_blocks, max_model_len=256, max_num_batched_tokens=budget, connector=True,
                  failure_rate=failure_rate, unsafe=unsafe, strict=not unsafe, **sched_kw)
    return run, reqs
