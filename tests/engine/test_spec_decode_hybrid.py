"""Speculative decoding on chunked-local (Llama 4) and recurrent (Mamba2, Bamba, Granite 4.0-H,
Nemotron-H, Falcon-H1, Qwen3-Next, LFM2, Jamba) models.

A rejected draft must leave no trace: chunked-local layers overwrite its K/V later, and
Mamba layers roll their conv and SSM states (LFM2's short convolutions their conv
state) back to the last accepted token
(StepMambaStates.commit). Greedy output must equal HF greedy, sync and async.

Tiny random models never repeat themselves, so n-gram lookups would only ever be
rejected. To get both outcomes at every draft position, the main test drafts with an
oracle that knows HF's greedy continuation and corrupts one draft of most proposals
(all accepted / first rejected / a later one rejected, in turn); a second test runs the
real n-gram drafter on repetitive prompts.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.helpers.hf_tiny_mamba import KINDS  # noqa: E402
from tests.helpers.oracle_drafter import OracleDrafter  # noqa: E402
from tests.helpers.tiny_models import greedy_tokens as oracle, model_dir  # noqa: E402

from hybridserve.core.request import Request, SamplingParams  # noqa: E402
from hybridserve.core.sched.config import SchedulerConfig  # noqa: E402
from hybridserve.engine.loop import EngineCore, build_engine  # noqa: E402
from hybridserve.executor.torch.executor import TorchExecutor  # noqa: E402
from hybridserve.models.loaders.loader import load_model  # noqa: E402

NEW_TOKENS = 24
_MODELS: dict[str, object] = {}


def prompts_for(kind: str) -> list[list[int]]:
    """A prompt that quotes the model's own continuation G of a random S (S + G + junk +
    S + G[:4]: lookups into G tend to be accepted, the junk after it rejected), and
    prompts repeating a short pattern."""
    rng = random.Random(3)
    s = [rng.randint(3, 255) for _ in range(40)]
    g = oracle(kind, s, 12)
    junk = [rng.randint(3, 255) for _ in range(5)]
    out = [s + g + junk + s + g[:4]]
    for _ in range(2):
        pattern = [rng.randint(3, 255) for _ in range(rng.randint(5, 8))]
        out.append([rng.randint(3, 255) for _ in range(7)] + pattern * 4 + pattern[:2])
    return out


def make_engine(kind: str, async_scheduling: bool, spec: int, drafter: object = None,
                num_blocks: int = 200) -> EngineCore:
    if kind not in _MODELS:
        _MODELS[kind] = load_model(model_dir(kind))
    ex = TorchExecutor(_MODELS[kind], use_worker_thread=async_scheduling, drafter=drafter)  # type: ignore[arg-type]
    sc = SchedulerConfig(max_model_len=256, async_scheduling=async_scheduling, max_num_batched_tokens=40,
                         num_speculative_tokens=spec)
    return build_engine(sc, ex.kv_cache_config(16, num_blocks=num_blocks), ex)


def run(engine: EngineCore, prompts: list[list[int]], tag: str = "r", shutdown: bool = True,
        cached: dict[str, int] | None = None) -> dict[str, list[int]]:
    """Output tokens per request; `cached` collects each request's prefix-cache hit."""
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"{tag}{i}", p, SamplingParams(max_tokens=NEW_TOKENS)))
    got: dict[str, list[int]] = {}
    try:
        while engine.has_unfinished_requests():
            _, outs = engine.step()
            for o in outs:
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
                if cached is not None:
                    cached[o.request_id] = max(cached.get(o.request_id, 0), o.num_cached_tokens)
    finally:
        if shutdown:
            engine.shutdown()
    return got


@pytest.mark.parametrize("kind", ["llama4", *KINDS])
@pytest.mark.parametrize("async_scheduling,spec", [(False, 3), (True, 4)], ids=["sync3", "async4"])
def test_accepted_and_rejected_drafts_leave_hf_greedy_output(kind: str, async_scheduling: bool, spec: int) -> None:
    prompts = prompts_for(kind)
    sequences = [p + oracle(kind, p, NEW_TOKENS) for p in prompts]
    eng = make_engine(kind, async_scheduling, spec, OracleDrafter(sequences))
    got = run(eng, prompts)
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == oracle(kind, p, NEW_TOKENS), f"{kind} prompt {i}"
    st = eng.scheduler.stats
    # Both outcomes, and steps that accepted more than one draft.
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens, (st.num_accepted_tokens, st.num_draft_tokens)
    assert st.mean_accepted_length > 1.5
    assert eng.scheduler.kv.pool.num_free_blocks == eng.scheduler.kv.pool.num_blocks - 1


@pytest.mark.parametrize("kind", ["llama4", "bamba", "qwen3_next", "lfm2", "jamba"])
def test_ngram_drafts_on_repetitive_prompts_keep_hf_output(kind: str) -> None:
    prompts = prompts_for(kind)
    eng = make_engine(kind, True, 3)
    got = run(eng, prompts)
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == oracle(kind, p, NEW_TOKENS), f"{kind} prompt {i}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("async_scheduling,spec", [(False, 3), (True, 4)], ids=["sync3", "async4"])
def test_next_turn_starts_from_states_checkpointed_during_verification(kind: str, async_scheduling: bool,
                                                                       spec: int) -> None:
    """The block boundaries a decode crosses are inside verify chunks, so their Mamba
    checkpoints are the states StepMambaStates.commit keeps; the next turn (prompt +
    output + more) starts from the last one and must still produce HF's tokens."""
    prompts = prompts_for(kind)
    turn2 = [p + oracle(kind, p, NEW_TOKENS) + [7, 8, 9] for p in prompts]
    sequences = [p + oracle(kind, p, NEW_TOKENS) for p in prompts + turn2]
    eng = make_engine(kind, async_scheduling, spec, OracleDrafter(sequences))
    first = run(eng, prompts, tag="a", shutdown=False)
    cached: dict[str, int] = {}
    second = run(eng, turn2, tag="b", cached=cached)
    for i, p in enumerate(prompts):
        assert first[f"a{i}"] == oracle(kind, p, NEW_TOKENS)
        assert second[f"b{i}"] == oracle(kind, turn2[i], NEW_TOKENS), f"{kind} turn 2 of prompt {i}"
        # The first turn computed all but its last output token: whole blocks of that.
        assert cached[f"b{i}"] == (len(p) + NEW_TOKENS - 1) // 16 * 16 > len(p) // 16 * 16


SHORT_POOL = {"mamba2": 4, "bamba": 30, "qwen3_next": 22, "lfm2": 23, "jamba": 30}


@pytest.mark.parametrize("kind", list(SHORT_POOL))
@pytest.mark.parametrize("async_scheduling,spec", [(False, 3), (True, 4)], ids=["sync3", "async4"])
def test_a_short_pool_skips_checkpoints_under_verification_and_every_token_is_hf(kind: str, async_scheduling: bool,
                                                                                  spec: int) -> None:
    """Pools a few blocks above the admission minimum (256 tokens: Bamba 16 attention
    blocks + 9 running-state pages + the null block = 26, Jamba alike; Mamba2 1 + 1; Qwen3-Next
    16 + 2 + 1 = 19; LFM2 16 + 3 one-page conv states + 1 = 20): verify steps find no blocks
    to spare for some boundaries (null entries, no checkpoint there), the rollback still
    lands in the running block, and both turns are HF's tokens."""
    from tests.helpers.mamba_engine import count_skipped_checkpoints

    prompts = prompts_for(kind)
    turn2 = [p + oracle(kind, p, NEW_TOKENS) + [7, 8, 9] for p in prompts]
    sequences = [p + oracle(kind, p, NEW_TOKENS) for p in prompts + turn2]
    eng = make_engine(kind, async_scheduling, spec, OracleDrafter(sequences), num_blocks=SHORT_POOL[kind])
    skipped = count_skipped_checkpoints(eng)
    first = run(eng, prompts, tag="a", shutdown=False)
    second = run(eng, turn2, tag="b")
    for i, p in enumerate(prompts):
        assert first[f"a{i}"] == oracle(kind, p, NEW_TOKENS)
        assert second[f"b{i}"] == oracle(kind, turn2[i], NEW_TOKENS), f"{kind} turn 2 of prompt {i}"
    assert sum(skipped) > 0
