"""End to end through EngineCore + Scheduler + TorchExecutor, against HF transformers.

Every prompt of a batch of mixed lengths (40-120 tokens, windows of 16, blocks of 16)
must get exactly HF's greedy tokens, in sync and async mode, with prefills chunked
across window and block boundaries, with prefix-cache hits and with preemption.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.helpers import hf_tiny  # noqa: E402
from tests.helpers.torch_engine import NEW_TOKENS, PROMPTS, check_tokens, make_engine, model, run  # noqa: E402

from hybridserve.executor.torch.executor import TorchExecutor  # noqa: E402

@pytest.mark.parametrize("kind", hf_tiny.KINDS)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_matches_hf(kind: str, async_scheduling: bool) -> None:
    eng = make_engine(kind, async_scheduling=async_scheduling)
    try:
        got = run(eng, PROMPTS, logprobs=0)
    finally:
        eng.shutdown()
    check_tokens(kind, PROMPTS, got)
    for i, p in enumerate(PROMPTS):
        _, want_lp = hf_tiny.oracle(kind, p, NEW_TOKENS)
        assert len(got[f"r{i}"][1]) == NEW_TOKENS
        assert max(abs(a - b) for a, b in zip(got[f"r{i}"][1], want_lp)) < 1e-3


@pytest.mark.parametrize("kind", ["gemma3", "gemma3_mm", "olmo3", "cohere2", "exaone4"])
def test_three_steps_in_flight_match_hf(kind: str) -> None:
    """Async with 3 steps in flight (2 is the async default above), prefills chunked so
    chunks and decodes overlap across the three."""
    eng = make_engine(kind, async_scheduling=True, max_num_batched_tokens=29, max_concurrent_batches=3)
    try:
        got = run(eng, PROMPTS)
        assert eng.max_concurrent_batches == 3
    finally:
        eng.shutdown()
    check_tokens(kind, PROMPTS, got)


@pytest.mark.parametrize("kind", hf_tiny.KINDS)
@pytest.mark.parametrize("window_tail", [False, True], ids=["plain", "window_tail"])
def test_chunked_prefill_across_window_and_block_boundaries(kind: str, window_tail: bool) -> None:
    # Budgets of 23 and 41: chunk ends fall at every offset inside blocks and windows of 16;
    # 41-token chunks leave whole blocks before their 15-token tail (null under window-tail).
    budget = 41 if window_tail else 23
    eng = make_engine(kind, async_scheduling=True, max_num_batched_tokens=budget, window_tail_allocation=window_tail)
    try:
        got = run(eng, PROMPTS)
        steps = eng.scheduler.stats.num_steps
        nulls = eng.executor.null_block_ids
        # Null blocks are gathered beside real ones and masked (attention.py), which needs
        # block 0 finite: it must still be the zeros it started as.
        null_rows = [buf[0] for buf in eng.executor.runner.kv.buffers]
        assert all(int(torch.count_nonzero(row)) == 0 for row in null_rows)
    finally:
        eng.shutdown()
    assert steps > sum(len(p) for p in PROMPTS) // budget  # the prompts really were chunked
    # Window-tail allocation hands null blocks to sliding slots before each chunk's tail.
    assert (nulls > 0) == (window_tail and kind != "llama")
    check_tokens(kind, PROMPTS, got)


@pytest.mark.parametrize("kind", ["mistral", "gemma3", "gemma3_mm", "olmo3", "cohere2", "exaone4", "gpt_oss"])
@pytest.mark.parametrize("async_scheduling,window_tail", [(False, False), (True, True)], ids=["sync", "async_tail"])
def test_prefix_cache_hits(kind: str, async_scheduling: bool, window_tail: bool) -> None:
    base = PROMPTS[3]
    assert len(base) > 100
    eng = make_engine(kind, async_scheduling=async_scheduling, window_tail_allocation=window_tail)
    try:
        first = run(eng, [base], tag="a")
        # The same prompt, the prompt extended, and its first 80 tokens with another tail.
        second = [list(base), base + [5, 6, 7, 8, 9], base[:80] + [5, 6, 7, 8, 9, 10, 11]]
        got = run(eng, second, tag="b")
    finally:
        eng.shutdown()
    check_tokens(kind, [base], first, tag="a")
    check_tokens(kind, second, got, tag="b")
    full_blocks = len(base) // 16 * 16
    assert got["b0"][2] >= full_blocks - 16 and got["b1"][2] == full_blocks, (got["b0"][2], got["b1"][2])
    # A hit inside the first request's only prefill chunk needs the window before it in
    # real blocks: true under plain allocation; under window-tail allocation the sliding
    # groups kept only that chunk's tail, so hits land on chunk ends only.
    if not window_tail:
        assert got["b2"][2] == 80


@pytest.mark.parametrize("kind,num_blocks", [("gemma3", 30), ("qwen2", 22), ("mistral", 8), ("gemma3_mm", 30),
                                             ("olmo3", 30), ("cohere2", 30), ("exaone4", 30),
                                             ("gpt_oss", 24)])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preemption_recomputes_exactly(kind: str, num_blocks: int, async_scheduling: bool) -> None:
    eng = make_engine(kind, async_scheduling=async_scheduling, num_blocks=num_blocks, max_num_batched_tokens=32)
    try:
        got = run(eng, PROMPTS)
        preemptions = eng.scheduler.stats.num_preemptions
    finally:
        eng.shutdown()
    check_tokens(kind, PROMPTS, got)
    assert preemptions > 0


def test_seeded_sampling_is_reproducible_and_differs_from_greedy() -> None:
    params = dict(temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    outs = []
    for mode in (False, True):
        eng = make_engine("mistral", async_scheduling=mode)
        try:
            outs.append(run(eng, PROMPTS[:2], **params))
        finally:
            eng.shutdown()
    assert outs[0]["r0"][0] == outs[1]["r0"][0] and outs[0]["r1"][0] == outs[1]["r1"][0]
    greedy, _ = hf_tiny.oracle("mistral", PROMPTS[0], NEW_TOKENS)
    assert outs[0]["r0"][0] != greedy


def test_a_seeded_stream_does_not_depend_on_its_batch_scheduling_or_preemption() -> None:
    """A seeded request's draws are keyed by its seed and each token's position: alone,
    beside three other requests with async scheduling, and preempted and recomputed in a
    pool of 8 blocks, its tokens are the same."""
    params = dict(temperature=1.0, top_p=0.9, min_p=0.02, seed=4321)
    runs = []
    for prompts, cfg in [(PROMPTS[:1], dict(async_scheduling=False)),
                         (PROMPTS, dict(async_scheduling=True)),
                         (PROMPTS, dict(async_scheduling=False, num_blocks=8, max_num_batched_tokens=32))]:
        eng = make_engine("mistral", **cfg)  # type: ignore[arg-type]
        try:
            runs.append(run(eng, prompts, **params)["r0"][0])
            if cfg.get("num_blocks"):
                assert eng.scheduler.stats.num_preemptions > 0
        finally:
            eng.shutdown()
    assert runs[0] == runs[1] == runs[2]
    assert runs[0] != hf_tiny.oracle("mistral", PROMPTS[0], NEW_TOKENS)[0]


def test_executor_errors_surface_in_wait_and_setup_is_checked() -> None:
    from hybridserve.core.errors import ConfigError, RequestError
    from hybridserve.core.sched.output import ScheduledRequest, SchedulerOutput

    ex = TorchExecutor(model("mistral"), use_worker_thread=True)
    with pytest.raises(ConfigError, match="before initialize"):
        ex.execute(SchedulerOutput(0, [], 0))
    kvc = ex.kv_cache_config(16, kv_cache_memory="256KiB")
    assert kvc.num_blocks == (256 << 10) // kvc.bytes_per_block
    ex.initialize(kvc)
    with pytest.raises(ConfigError, match="twice"):
        ex.initialize(kvc)
    bogus = SchedulerOutput(0, [ScheduledRequest("ghost", 0, 1, 0, ([1],), (0,), True)], 1)
    handle = ex.execute(bogus)  # runs in the worker thread; the error comes back in wait()
    with pytest.raises(RequestError, match="ghost"):
        ex.wait(handle)
    ex.shutdown()


def test_prepare_large_steps_covers_every_count_the_governor_may_pick(monkeypatch) -> None:
    """A server's engine core prepares the compiled graphs under each thread count a step
    may get and under inference mode, as steps run (a graph guards on both), and leaves
    the thread count as it was."""
    from hybridserve.executor.torch import executor as executor_module
    from hybridserve.models.loaders.loader import load_model

    model = load_model(hf_tiny.tiny_model_dir("gemma3"), "cpu", torch.bfloat16, "none")
    seen: list[tuple[str, int, bool]] = []
    monkeypatch.setattr(model, "prepare_large_steps",
                        lambda: seen.append(("chains", torch.get_num_threads(), torch.is_inference_mode_enabled())))
    monkeypatch.setattr(executor_module.KERNEL, "prepare",
                        lambda: seen.append(("kernel", torch.get_num_threads(), torch.is_inference_mode_enabled())))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        ex = executor_module.TorchExecutor(model)
        assert ex._threads is not None and ex._threads.candidates == [2, 1]
        ex.prepare_large_steps()
        assert seen == [("chains", 2, True), ("kernel", 2, True), ("chains", 1, True), ("kernel", 1, True)]
        assert torch.get_num_threads() == 2
        ex.shutdown()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("worker_thread", [False, True], ids=["inline", "worker"])
def test_an_inline_executor_delivers_each_step_before_planning_the_next(worker_thread: bool) -> None:
    """Async scheduling keeps two steps in flight only where a step runs beside the loop
    (a worker thread). With steps run inline (a CPU) nothing would overlap: the first
    step() returns the prompt's first token having run that one step alone, not the next
    one too, and every later call runs one step; the tokens are HF's either way."""
    from hybridserve.core.request import Request, SamplingParams
    from hybridserve.core.sched.config import SchedulerConfig
    from hybridserve.engine.loop import build_engine

    class Counting(TorchExecutor):
        steps = 0

        def execute(self, scheduler_output):  # type: ignore[no-untyped-def]
            self.steps += 1
            return super().execute(scheduler_output)

    ex = Counting(model("mistral"), use_worker_thread=worker_thread)
    assert ex.runs_steps_inline is not worker_thread
    config = SchedulerConfig(max_model_len=160, async_scheduling=True)
    engine = build_engine(config, ex.kv_cache_config(16, num_blocks=64), ex)
    prompt = PROMPTS[0]
    engine.add_request(Request("r0", prompt, SamplingParams(max_tokens=NEW_TOKENS)))
    _, outs = engine.step()
    assert [o.new_token_ids for o in outs] == [hf_tiny.oracle("mistral", prompt, NEW_TOKENS)[0][:1]]
    assert ex.steps == (2 if worker_thread else 1)
    tokens = list(outs[0].new_token_ids)
    while engine.has_unfinished_requests():
        before = ex.steps
        _, outs = engine.step()
        assert worker_thread or ex.steps - before == 1
        tokens += [t for o in outs for t in o.new_token_ids]
    assert tokens == hf_tiny.oracle("mistral", prompt, NEW_TOKENS)[0]
    engine.shutdown()
