"""AsyncLLM: incremental outputs, aborts that free blocks, and failures that never hang."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.helpers.faults import fail_execute_after  # noqa: E402
from tests.helpers.serving_models import PROMPTS, tiny_serving_dir  # noqa: E402

from hybridserve import LLM, AsyncLLM, EngineDeadError, SamplingParams  # noqa: E402
from hybridserve.core.errors import RequestError  # noqa: E402
from hybridserve.engine.async_llm import RequestFailedError  # noqa: E402

MAX_LEN = 256
TIMEOUT = 60.0
RESTART_TIMEOUT = 300.0  # the restart builds a fresh executor and loads the model again: slow on a busy machine


@pytest.fixture(scope="module")
def engine() -> AsyncLLM:
    llm = AsyncLLM(str(tiny_serving_dir()), max_model_len=MAX_LEN, dtype="float32", progress=False)
    yield llm
    llm.shutdown()


def run(coro, timeout: float = TIMEOUT):  # every test is bounded in time: a hang is a failure, not a stuck suite
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def collect(engine: AsyncLLM, prompt, params, rid=None) -> tuple[list, str]:
    outs = [out async for out in engine.generate(prompt, params, rid)]
    return outs, "".join(o.outputs[0].delta_text for o in outs)


async def wait_idle(engine: AsyncLLM) -> None:
    """Poll until nothing runs or waits and no KV block is held (run() bounds the wait)."""
    while True:
        stats = await engine.get_stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_usage == 0.0:
            return
        await asyncio.sleep(0.02)


def test_streams_match_the_blocking_api(engine: AsyncLLM) -> None:
    params = [SamplingParams(max_tokens=10), SamplingParams(max_tokens=10, temperature=0.9, seed=3, n=2)]
    ref = LLM(str(tiny_serving_dir()), max_model_len=MAX_LEN, dtype="float32", progress=False)
    try:
        want = [ref.generate(PROMPTS, p, use_tqdm=False) for p in params]
    finally:
        ref.shutdown()

    async def main() -> None:
        for p, expected in zip(params, want):
            results = await asyncio.gather(*(collect(engine, prompt, p) for prompt in PROMPTS))
            for (outs, _), exp in zip(results, expected):
                assert outs[-1].finished and all(not o.finished for o in outs[:-1])
                for c in exp.outputs:
                    deltas = [d for o in outs for d in o.outputs if d.index == c.index]
                    assert "".join(d.delta_text for d in deltas) == c.text
                    assert [t for d in deltas for t in d.delta_token_ids] == c.token_ids
                    assert deltas[-1].text == c.text and deltas[-1].finish_reason == c.finish_reason
            assert len(outs) > 1  # really incremental
        await wait_idle(engine)

    run(main())


def test_abort_ends_the_stream_and_frees_blocks(engine: AsyncLLM) -> None:
    async def main() -> None:
        seen = []
        async for out in engine.generate(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True), "ab-1"):
            seen.append(out)
            if len(seen) == 3:
                await engine.abort("ab-1")
        assert seen[-1].finished and seen[-1].finish_reason == "abort"
        assert len(seen[-1].outputs[0].token_ids) < 200
        await wait_idle(engine)

    run(main())


def test_a_consumer_that_stops_listening_aborts_its_request(engine: AsyncLLM) -> None:
    async def consume(n: int) -> None:
        async for out in engine.generate(PROMPTS[1], SamplingParams(max_tokens=200, ignore_eos=True)):
            n -= 1
            if n == 0:
                return  # leaves the async generator unfinished: it is closed, then aborts

    async def main() -> None:
        task = asyncio.ensure_future(consume(10**9))
        await asyncio.sleep(0.2)
        task.cancel()  # a cancelled consumer (client gone) aborts too
        await asyncio.gather(task, return_exceptions=True)
        await consume(2)
        await wait_idle(engine)
        stats = await engine.get_stats()
        assert stats.num_generated_tokens > 0

    run(main())


def test_duplicate_ids_and_bad_prompts_are_request_errors(engine: AsyncLLM) -> None:
    async def main() -> None:
        gen = engine.generate(PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True), "dup")
        first = await gen.__anext__()
        assert not first.finished
        with pytest.raises(RequestError, match="duplicate request id 'dup'"):
            await collect(engine, PROMPTS[1], SamplingParams(max_tokens=2), "dup")
        await gen.aclose()
        with pytest.raises(RequestError, match="max_model_len=256"):
            await collect(engine, [10] * MAX_LEN, SamplingParams())
        outs, _ = await collect(engine, PROMPTS[1], SamplingParams(max_tokens=2), "dup")  # free again
        assert outs[-1].finished
        await wait_idle(engine)

    run(main())


def test_an_engine_failure_fails_open_requests_then_the_engine_restarts() -> None:
    llm = AsyncLLM(str(tiny_serving_dir()), max_model_len=MAX_LEN, progress=False, dtype="float32")
    ref = LLM(str(tiny_serving_dir()), max_model_len=MAX_LEN, progress=False, dtype="float32")
    want = ref.generate(PROMPTS[1], SamplingParams(max_tokens=12), use_tqdm=False)[0].text
    ref.shutdown()
    fail_execute_after(llm, 3)

    async def main() -> None:
        results = await asyncio.gather(
            *(collect(llm, p, SamplingParams(max_tokens=50, ignore_eos=True)) for p in PROMPTS[:4]),
            return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        # Clients learn that the engine failed, never its internal error text.
        assert "restarting" in str(results[0]) and "secret" not in str(results[0])
        while llm.restarting:  # the rebuilt engine (fresh executor, no fault) takes over; run() bounds the wait
            await asyncio.sleep(0.05)
        assert llm.dead_error is None
        _, text = await collect(llm, PROMPTS[1], SamplingParams(max_tokens=12))
        assert text == want
        await wait_idle(llm)

    try:
        run(main(), RESTART_TIMEOUT)
        assert llm.restart_reasons == ["RuntimeError: device lost at /secret/path"]
    finally:
        llm.shutdown()


def test_an_engine_out_of_restarts_is_dead_and_says_so() -> None:
    llm = AsyncLLM(str(tiny_serving_dir()), max_model_len=MAX_LEN, progress=False, max_restarts=0)
    reasons: list[str] = []
    llm.on_dead = reasons.append
    fail_execute_after(llm, 0)

    async def main() -> None:
        with pytest.raises(EngineDeadError):
            await collect(llm, PROMPTS[0], SamplingParams(max_tokens=5))
        with pytest.raises(EngineDeadError, match="out of restarts"):
            await collect(llm, PROMPTS[0], SamplingParams(max_tokens=2))
        assert await llm.get_stats() is None

    try:
        run(main())
    finally:
        llm.shutdown()  # joins the engine thread, which calls on_dead as it dies
    assert llm.dead_error is not None and len(reasons) == 1 and "device lost" in reasons[0]


def test_a_request_whose_sampling_fails_fails_alone(engine: AsyncLLM, monkeypatch) -> None:
    """A sampler fault confined to one request's rows (seed 666 here) fails that request;
    the others in the same steps finish with the tokens they would have had. The fault
    hits the plain batches' fast path too, which leaves the batch to the general path."""
    from hybridserve.executor.torch import model_runner, sampler

    real, real_plain = sampler.sample, model_runner.sample_plain

    def picky(logits, rows):
        if any(r.params.seed == 666 for r in rows):
            raise IndexError("boom")
        return real(logits, rows)

    def picky_plain(logits, draw_params, positions):
        if 666 in draw_params.seeds.tolist():
            raise IndexError("boom")
        return real_plain(logits, draw_params, positions)

    monkeypatch.setattr(sampler, "sample", picky)
    monkeypatch.setattr(model_runner, "sample_plain", picky_plain)
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=5)
    ref = LLM(str(tiny_serving_dir()), max_model_len=MAX_LEN, progress=False, dtype="float32")
    want = [o.text for o in ref.generate(PROMPTS[:3], params, use_tqdm=False)]
    ref.shutdown()

    async def main() -> None:
        bad = SamplingParams(max_tokens=12, temperature=0.8, seed=666, ignore_eos=True)
        results = await asyncio.gather(collect(engine, PROMPTS[0], params), collect(engine, PROMPTS[5], bad),
                                       collect(engine, PROMPTS[1], params), collect(engine, PROMPTS[2], params),
                                       return_exceptions=True)
        assert isinstance(results[1], RequestFailedError), results[1]
        assert [r[1] for r in results[:1] + results[2:]] == want
        assert engine.dead_error is None and not engine.restarting
        await wait_idle(engine)

    run(main())


def test_a_request_whose_detokenizing_fails_fails_alone(engine: AsyncLLM, monkeypatch) -> None:
    from hybridserve.engine import outputs

    real = outputs.SequenceState.update

    def fragile(self, out, now):
        if out.request_id == "doomed":
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")
        return real(self, out, now)

    monkeypatch.setattr(outputs.SequenceState, "update", fragile)

    async def main() -> None:
        results = await asyncio.gather(collect(engine, PROMPTS[0], SamplingParams(max_tokens=30, ignore_eos=True),
                                               "doomed"),
                                       collect(engine, PROMPTS[1], SamplingParams(max_tokens=8)),
                                       return_exceptions=True)
        assert isinstance(results[0], RequestFailedError) and "UnicodeDecodeError" in str(results[0])
        assert len(results[1][0][-1].outputs[0].token_ids) == 8
        await wait_idle(engine)

    run(main())


def test_prepare_large_steps_prepares_in_process_replicas(engine: AsyncLLM, monkeypatch) -> None:
    # `hybridserve serve --no-engine-core-process` calls it at start-up: without it the first
    # burst of prompts compiled the chains inside a step (benchmarks/results/serving_peers.md).
    executor = engine.replicas[0].parts.engine.executor
    calls = []
    monkeypatch.setattr(executor, "prepare_large_steps", lambda: calls.append(executor))
    engine.prepare_large_steps()
    assert calls == [executor]
