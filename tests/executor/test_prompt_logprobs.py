"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's logprob given the
tokens before it, and the top alternatives there, against one HF forward of the prompt.

They must come out whole and once per token however the prompt is computed: in chunks
that cross windows and blocks, when the same prompt is in the prefix cache (such a request
hits nothing), and when a preempted request computes its prompt again.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.helpers import hf_tiny, hf_tiny_mamba  # noqa: E402
from tests.helpers.torch_engine import PROMPTS, make_engine  # noqa: E402

from hybridserve.core.errors import RequestError  # noqa: E402
from hybridserve.core.request import Request, SamplingParams  # noqa: E402
from hybridserve.core.sched.output import LogprobInfo, PromptLogprobChunk  # noqa: E402
from hybridserve.core.sched.output_processing import receive_prompt_logprobs, take_prompt_logprobs  # noqa: E402

TOP = 3


def run_prompt_logprobs(engine, prompts: list[list[int]], tag: str, prompt_logprobs: int | None = TOP,
                        max_tokens: int = 4) -> dict[str, dict]:
    """{request id: {"values", "tops", "tokens", "cached", "reports"}} once all finish."""
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"{tag}{i}", p, SamplingParams(max_tokens=max_tokens,
                                                                  prompt_logprobs=prompt_logprobs)))
    got: dict[str, dict] = {}
    while engine.has_unfinished_requests():
        _, outs = engine.step()
        for o in outs:
            g = got.setdefault(o.request_id, {"values": [], "tops": [], "tokens": [], "cached": 0, "reports": 0})
            g["tokens"] += o.new_token_ids
            g["cached"] = max(g["cached"], o.num_cached_tokens)
            if o.prompt_logprobs is not None:
                g["reports"] += 1
                g["values"] += o.prompt_logprobs.token_logprobs
                g["tops"] += o.prompt_logprobs.top_logprobs or []
    return got


def check_against_hf(kind: str, prompt: list[int], got: dict) -> None:
    want, want_top = hf_tiny.hf_prompt_logprobs(hf_tiny.hf_model(kind), prompt, TOP)
    assert len(got["values"]) == len(prompt) - 1  # every token but the first, once
    assert max(abs(a - b) for a, b in zip(got["values"], want)) < 1e-3
    assert [[t for t, _ in row] for row in got["tops"]] == want_top
    # The top list is the distribution's own head: the target is among it exactly when
    # its logprob reaches the third best.
    for value, row in zip(got["values"], got["tops"]):
        assert [lp for _, lp in row] == sorted((lp for _, lp in row), reverse=True)
        assert value <= row[0][1] + 1e-6


@pytest.mark.parametrize("kind", hf_tiny.KINDS)
def test_prompt_logprobs_match_hf_in_chunks(kind: str) -> None:
    # Chunks of 23 tokens end at every offset inside windows and blocks of 16.
    eng = make_engine(kind, async_scheduling=kind in ("gemma3", "qwen2"), max_num_batched_tokens=23)
    try:
        got = run_prompt_logprobs(eng, PROMPTS, "r")
    finally:
        eng.shutdown()
    for i, p in enumerate(PROMPTS):
        check_against_hf(kind, p, got[f"r{i}"])
        assert got[f"r{i}"]["reports"] == 1  # all of them with the first token
        assert got[f"r{i}"]["tokens"] == hf_tiny.oracle(kind, p, 4)[0]


def test_prompt_logprobs_request_hits_no_prefix_cache() -> None:
    eng = make_engine("gemma3", async_scheduling=True)
    try:
        plain = run_prompt_logprobs(eng, PROMPTS[:1], "a", prompt_logprobs=None)
        again = run_prompt_logprobs(eng, PROMPTS[:1], "b", prompt_logprobs=0)
        cached = run_prompt_logprobs(eng, PROMPTS[:1], "c", prompt_logprobs=None)
    finally:
        eng.shutdown()
    assert plain["a0"]["values"] == [] and plain["a0"]["cached"] == 0
    assert again["b0"]["cached"] == 0
    assert again["b0"]["tops"] == []  # 0 alternatives: the prompt tokens' own logprobs alone
    want, _ = hf_tiny.hf_prompt_logprobs(hf_tiny.hf_model("gemma3"), PROMPTS[0], 0)
    assert len(again["b0"]["values"]) == len(PROMPTS[0]) - 1
    assert max(abs(a - b) for a, b in zip(again["b0"]["values"], want)) < 1e-3
    # A request without prompt logprobs still hits: 81 prompt tokens are 5 whole blocks of 16.
    assert cached["c0"]["cached"] == 80


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prompt_logprobs_once_per_token_across_preemption(async_scheduling: bool) -> None:
    eng = make_engine("mistral", async_scheduling=async_scheduling, num_blocks=8, max_num_batched_tokens=32)
    try:
        got = run_prompt_logprobs(eng, PROMPTS, "r", max_tokens=16)
        preemptions = eng.scheduler.stats.num_preemptions
    finally:
        eng.shutdown()
    assert preemptions > 0
    for i, p in enumerate(PROMPTS):
        check_against_hf("mistral", p, got[f"r{i}"])
        assert got[f"r{i}"]["tokens"] == hf_tiny.oracle("mistral", p, 16)[0]


def test_repeated_chunks_are_dropped_and_the_rest_kept_in_order() -> None:
    req = Request("r", [7] * 10, SamplingParams(prompt_logprobs=1))
    # Tokens 1-3, then (a recomputation after a preemption) tokens 1-5, then 6-9.
    receive_prompt_logprobs(req, PromptLogprobChunk(1, LogprobInfo([-1.0, -2.0, -3.0], [[(4, -0.5)]] * 3)))
    receive_prompt_logprobs(req, PromptLogprobChunk(1, LogprobInfo([-9.0, -9.0, -9.0, -4.0, -5.0],
                                                                   [[(9, -0.1)]] * 3 + [[(5, -0.2)]] * 2)))
    first = take_prompt_logprobs(req)
    assert first is not None and first.token_logprobs == [-1.0, -2.0, -3.0, -4.0, -5.0]
    assert first.top_logprobs == [[(4, -0.5)]] * 3 + [[(5, -0.2)]] * 2
    assert take_prompt_logprobs(req) is None
    receive_prompt_logprobs(req, PromptLogprobChunk(6, LogprobInfo([-6.0, -7.0, -8.0, -9.0], [[(1, -1.0)]] * 4)))
    receive_prompt_logprobs(req, PromptLogprobChunk(3, LogprobInfo([-3.0], [[(1, -1.0)]])))  # all repeats
    rest = take_prompt_logprobs(req)
    assert rest is not None and rest.token_logprobs == [-6.0, -7.0, -8.0, -9.0]
    assert req.num_prompt_logprobs == 9


@pytest.mark.parametrize("value", [-1, 1.5, "3", True])
def test_bad_prompt_logprobs_are_request_errors(value: object) -> None:
    with pytest.raises(RequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", hf_tiny_mamba.KINDS)
def test_prompt_logprobs_of_recurrent_models_match_hf(kind: str) -> None:
    from tests.helpers.mamba_engine import PROMPTS as MAMBA_PROMPTS
    from tests.helpers.mamba_engine import make_engine as make_mamba_engine

    # Chunks of 24 tokens: the recurrent state carries the prompt across chunk boundaries.
    eng = make_mamba_engine(kind, async_scheduling=True, max_num_batched_tokens=24)
    try:
        got = run_prompt_logprobs(eng, MAMBA_PROMPTS[:2], "m")
    finally:
        eng.shutdown()
    for i, p in enumerate(MAMBA_PROMPTS[:2]):
        with hf_tiny_mamba.one_thread():
            want, want_top = hf_tiny.hf_prompt_logprobs(hf_tiny_mamba.load_hf(kind), p, TOP)
        g = got[f"m{i}"]
        assert len(g["values"]) == len(p) - 1
        assert max(abs(a - b) for a, b in zip(g["values"], want)) < 1e-3
        assert [[t for t, _ in row] for row in g["tops"]] == want_top


def test_prompt_logprobs_from_pipeline_and_tensor_parallel_workers_match_hf() -> None:
    from tests.helpers.parallel_engine import make_engine as make_parallel_engine

    # The last pipeline stage computes them, each of its 2 tensor-parallel ranks with the
    # (replicated) head on hidden states its ranks reduced together.
    eng = make_parallel_engine("gemma3", 2, 2, async_scheduling=True)
    try:
        got = run_prompt_logprobs(eng, PROMPTS[:2], "p")
    finally:
        eng.shutdown()
    for i, p in enumerate(PROMPTS[:2]):
        check_against_hf("gemma3", p, got[f"p{i}"])
