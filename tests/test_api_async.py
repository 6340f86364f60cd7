"""AsyncLLM: incremental outputs, aborts that free blocks, and failures that never hang."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.serving_models import PROMPTS, tiny_serving_dir  # noqa: E402

from hybridserve import LLM, AsyncLLM, EngineDeadError, SamplingParams  # noqa: E402
from hybridserve.core.errors import RequestError  # noqa: E402

MAX_LEN = 256
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def engine() -> AsyncLLM:
    llm = AsyncLLM(str(tiny_serving_dir()), max_model_len=MAX_LEN, dtype="float32", progress=False)
    yield llm
    llm.shutdown()


def run(coro):  # every test is bounded in time: a hang is a failure, not a stuck suite
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


async def collect(engine: AsyncLLM, prompt, params, rid=None) -> tuple[list, str]:
    outs = [out async for out in engine.generate(prompt, params, rid)]
    return outs, "".join(o.outputs[0].delta_text for o in outs)


async def wait_idle(engine: AsyncLLM) -> None:
    for _ in range(200):
        stats = await engine.get_stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_usage == 0.0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine not idle: {stats}")


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


def test_an_engine_failure_fails_requests_instead_of_hanging() -> None:
    llm = AsyncLLM(str(tiny_serving_dir()), max_model_len=MAX_LEN, progress=False)
    executor = llm.parts.engine.executor
    real_execute = executor.execute
    calls = {"n": 0}

    def flaky(scheduler_output):
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("device lost")
        return real_execute(scheduler_output)

    executor.execute = flaky  # type: ignore[method-assign]

    async def main() -> None:
        results = await asyncio.gather(
            *(collect(llm, p, SamplingParams(max_tokens=50, ignore_eos=True)) for p in PROMPTS[:4]),
            return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "device lost" in str(results[0])
        with pytest.raises(EngineDeadError, match="device lost"):
            await collect(llm, PROMPTS[0], SamplingParams(max_tokens=2))
        assert await llm.get_stats() is None

    try:
        run(main())
        assert llm.dead_error is not None
    finally:
        llm.shutdown()
