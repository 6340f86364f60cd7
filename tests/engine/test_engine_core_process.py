"""AsyncLLM with its engines in core processes: two data-parallel replicas give the
in-process tokens, route by cached prefix, abort across the pipe, and a killed core fails
only its own requests and leaves no process behind."""

from __future__ import annotations

import asyncio
import os
import random
import signal

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.helpers import faults  # noqa: E402
from tests.helpers.server_proc import process_alive  # noqa: E402
from tests.helpers.serving_models import PROMPTS, tiny_serving_dir  # noqa: E402

from hybridserve import LLM, AsyncLLM, EngineDeadError, SamplingParams  # noqa: E402
from hybridserve.core.errors import ConfigError  # noqa: E402
from hybridserve.core.kv.spec import DEFAULT_BLOCK_SIZE  # noqa: E402

MAX_LEN = 256
TIMEOUT = 120.0
RESTART_TIMEOUT = 300.0  # a restart spawns a fresh core (interpreter, torch, model): slow on a busy machine
BLOCK = DEFAULT_BLOCK_SIZE


def run(coro, timeout: float = TIMEOUT):  # a hang is a failure, not a stuck suite
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until(condition) -> None:
    """Poll until `condition()` holds (the caller's run() bounds the wait)."""
    while not condition():
        await asyncio.sleep(0.05)


def new_engine(**kw) -> AsyncLLM:
    return AsyncLLM(str(tiny_serving_dir()), max_model_len=MAX_LEN, dtype="float32", progress=False,
                    core_process=True, data_parallel_size=2, num_threads=1, **kw)


@pytest.fixture(scope="module")
def engine() -> AsyncLLM:
    llm = new_engine()
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def ref() -> LLM:
    llm = LLM(str(tiny_serving_dir()), max_model_len=MAX_LEN, dtype="float32", progress=False)
    yield llm
    llm.shutdown()


async def collect(engine: AsyncLLM, prompt, params, rid=None) -> list:
    return [out async for out in engine.generate(prompt, params, rid)]


async def wait_idle(engine: AsyncLLM) -> list:
    """Poll until no replica runs, queues or holds KV blocks (the caller's run() bounds the wait)."""
    while True:
        stats = await engine.get_replica_stats()
        if all(s is not None and s.num_running == 0 and s.num_waiting == 0 and s.kv_usage == 0.0 for s in stats):
            return stats
        await asyncio.sleep(0.02)


def test_two_replicas_serve_the_in_process_greedy_tokens(engine: AsyncLLM, ref: LLM) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0)
    want = [o.token_ids for o in ref.generate(PROMPTS, params, use_tqdm=False)]
    routed_before = [r.num_routed for r in engine.replicas]

    async def main() -> None:
        results = await asyncio.gather(*(collect(engine, p, params) for p in PROMPTS))
        assert [r[-1].outputs[0].token_ids for r in results] == want
        assert [r[-1].outputs[0].text for r in results] == [o.text for o in ref.generate(PROMPTS, params,
                                                                                          use_tqdm=False)]
        stats = await wait_idle(engine)
        assert all(s.num_generated_tokens > 0 for s in stats)  # both replicas really served

    run(main())
    routed = [r.num_routed - b for r, b in zip(engine.replicas, routed_before)]
    assert sum(routed) == len(PROMPTS) and min(routed) > 0, routed


def test_abort_and_a_closed_consumer_free_the_cores_blocks(engine: AsyncLLM) -> None:
    long = SamplingParams(max_tokens=200, ignore_eos=True)

    async def main() -> None:
        # One abort call for requests on both replicas (the second goes to the less loaded one).
        gens = [engine.generate(PROMPTS[i], long, f"ab-{i}") for i in range(2)]
        assert not any([(await g.__anext__()).finished for g in gens])
        assert [r.num_unfinished for r in engine.replicas] == [1, 1]
        await engine.abort(["ab-0", "ab-1"])
        for g in gens:
            last = [out async for out in g][-1]
            assert last.finish_reason == "abort" and len(last.outputs[0].token_ids) < 200

        async def consume() -> None:
            async for _ in engine.generate(PROMPTS[1], SamplingParams(max_tokens=200, ignore_eos=True)):
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.3)
        task.cancel()  # a client gone: its generator closes and aborts
        await asyncio.gather(task, return_exceptions=True)
        await wait_idle(engine)

    run(main())


def test_an_id_reused_right_after_its_abort_gets_only_its_own_tokens(engine: AsyncLLM, ref: LLM) -> None:
    """The core may still send outputs of the aborted request after the new one is
    submitted under the same id; they must not reach the new stream. (A prompt of two
    blocks: prefix routing sends both requests to the same replica.)"""
    prompt = [7 + (i * 37) % 249 for i in range(2 * BLOCK)]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    want = ref.generate(prompt, params, use_tqdm=False)[0].token_ids

    async def main() -> None:
        for _ in range(5):
            gen = engine.generate(prompt, SamplingParams(max_tokens=200, ignore_eos=True), "again")
            await gen.__anext__()
            await gen.aclose()  # aborts
            outs = await collect(engine, prompt, params, "again")
            assert outs[-1].outputs[0].token_ids == want
        await wait_idle(engine)

    run(main())


def test_prefix_routing_gets_more_cache_hits_than_round_robin(engine: AsyncLLM) -> None:
    """4 prompt prefixes of 3 blocks, each sent twice in a row, one request at a time.
    Round robin sends the two to different replicas: no hit. Prefix routing sends the second
    where the first went: a hit of the 3 prefix blocks each, 4 x 48 = 192 tokens."""

    def workload(seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        prompts = []
        for _ in range(4):
            prefix = [rng.randrange(7, 256) for _ in range(3 * BLOCK)]
            prompts += [prefix + [rng.randrange(7, 256) for _ in range(5)] for _ in range(2)]
        return prompts

    async def hits() -> int:
        return sum(s.prefix_cache_hits for s in await wait_idle(engine))

    async def serve(prompts: list[list[int]]) -> int:
        before = await hits()
        for p in prompts:
            await collect(engine, p, SamplingParams(max_tokens=1))
        return await hits() - before

    async def main() -> tuple[int, int]:
        engine.router.policy = "round_robin"
        try:
            round_robin = await serve(workload(1))
        finally:
            engine.router.policy = "prefix"
        return round_robin, await serve(workload(2))

    round_robin, prefix = run(main())
    assert (round_robin, prefix) == (0, 4 * 3 * BLOCK)


def test_a_killed_core_fails_its_requests_only_then_restarts_then_is_dropped() -> None:
    llm = new_engine(max_restarts=1)
    pids = [r.info.pid for r in llm.replicas]
    long = SamplingParams(max_tokens=MAX_LEN - 16, ignore_eos=True)

    async def kill_replica_0_under_load() -> None:
        # A fresh engine routes the first request to replica 0, the next to the less loaded 1.
        gens = [llm.generate(PROMPTS[i], long) for i in range(2)]
        firsts = [await g.__anext__() for g in gens]
        assert [r.num_routed for r in llm.replicas] == [1, 1] and not any(f.finished for f in firsts)
        os.kill(llm.replicas[0].info.pid, signal.SIGKILL)
        results = await asyncio.gather(*(collect_rest(g) for g in gens), return_exceptions=True)
        assert isinstance(results[0], EngineDeadError), results[0]
        assert results[1][-1].finished and results[1][-1].outputs[0].finish_reason == "length"

    async def collect_rest(gen) -> list:
        return [out async for out in gen]

    async def main() -> None:
        await kill_replica_0_under_load()
        await until(lambda: llm.replicas[0].serving)  # replica 0 comes back in a fresh process
        assert llm.replicas[0].serving and llm.replicas[0].info.pid != pids[0]
        pids.append(llm.replicas[0].info.pid)
        assert llm.replicas[0].restart_reasons == ["EngineCoreLost: the engine core process was killed by signal 9"]
        # Out of restarts the second time: dropped from routing, replica 1 serves on.
        llm.replicas[0].num_routed = llm.replicas[1].num_routed = 0
        await kill_replica_0_under_load()
        await until(lambda: llm.replicas[0].dead is not None)
        assert llm.replicas[0].dead is not None and llm.dead_error is None and not llm.restarting
        outs = await asyncio.gather(*(collect(llm, p, SamplingParams(max_tokens=4)) for p in PROMPTS[:3]))
        assert all(o[-1].finished for o in outs)
        assert llm.replicas[0].num_routed == 1  # only the killed request
        assert await llm.get_stats(0) is None

    try:
        run(main(), RESTART_TIMEOUT)
    finally:
        llm.shutdown()
    assert not any(process_alive(pid) for pid in pids)


def test_a_failed_step_in_the_core_fails_open_requests_then_a_fresh_core_serves(ref: LLM, monkeypatch,
                                                                               tmp_path) -> None:
    from hybridserve.engine import core_client

    monkeypatch.setenv(faults.FAULT_FLAG_ENV, str(tmp_path / "failed"))
    monkeypatch.setattr(core_client, "core_main", faults.core_main_failing_once)
    want = ref.generate(PROMPTS[1], SamplingParams(max_tokens=12), use_tqdm=False)[0].text
    llm = AsyncLLM(str(tiny_serving_dir()), max_model_len=MAX_LEN, dtype="float32", progress=False,
                   core_process=True, max_restarts=1)

    async def main() -> None:
        results = await asyncio.gather(
            *(collect(llm, p, SamplingParams(max_tokens=50, ignore_eos=True)) for p in PROMPTS[:4]),
            return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "restarting" in str(results[0]) and "secret" not in str(results[0])
        await until(lambda: not llm.restarting)
        assert not llm.restarting and llm.dead_error is None
        outs = await collect(llm, PROMPTS[1], SamplingParams(max_tokens=12))
        assert outs[-1].outputs[0].text == want

    try:
        run(main(), RESTART_TIMEOUT)
        assert llm.restart_reasons == ["RuntimeError: device lost at /secret/path"]
    finally:
        llm.shutdown()


def test_replicas_need_core_processes() -> None:
    with pytest.raises(ConfigError, match="data_parallel_size=2 runs each replica in an engine core process"):
        AsyncLLM(str(tiny_serving_dir()), data_parallel_size=2)
    with pytest.raises(ConfigError, match="LLM runs one engine in this process"):
        LLM(str(tiny_serving_dir()), data_parallel_size=2)
    with pytest.raises(ConfigError, match="data_parallel_size must be >= 1"):
        AsyncLLM(str(tiny_serving_dir()), data_parallel_size=0, core_process=True)


def test_a_config_error_in_the_core_is_raised_by_the_constructor() -> None:
    with pytest.raises(ConfigError, match="max_model_len=100000 exceeds the model's context"):
        AsyncLLM(str(tiny_serving_dir()), max_model_len=100_000, core_process=True)


def test_replicas_split_the_cpu_cores_unless_told_their_threads(monkeypatch) -> None:
    from hybridserve import EngineConfig
    from hybridserve.engine.async_llm import replica_config

    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    threads = [replica_config(EngineConfig(data_parallel_size=d)).num_threads for d in (1, 2, 3, 16)]
    assert threads == [None, 4, 2, 1]  # one replica: torch's own choice; 8 // d, at least 1
    assert replica_config(EngineConfig(data_parallel_size=2, num_threads=3)).num_threads == 3
    assert replica_config(EngineConfig(data_parallel_size=2, device="cuda")).num_threads is None


def test_the_server_process_starts_its_cores_and_no_other_process(tmp_path) -> None:
    """Each replica's core is the server process's only child: no resource tracker beside
    them (multiprocessing's spawn started one, 12 MB for the server's life). Run in a fresh
    interpreter, so no earlier test's processes count."""
    import subprocess
    import sys

    script = f"""
import os
from pathlib import Path
from hybridserve import AsyncLLM
llm = AsyncLLM({str(tiny_serving_dir())!r}, max_model_len={MAX_LEN}, dtype="float32", progress=False,
               core_process=True, data_parallel_size=2, num_threads=1)
me = str(os.getpid())
children = sorted(int(p.name) for p in Path("/proc").iterdir()
                  if p.name.isdigit() and (p / "stat").read_text().rsplit(")", 1)[1].split()[1] == me)
print(sorted(children) == sorted(r.info.pid for r in llm.replicas), len(children))
llm.shutdown()
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=TIMEOUT,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "2"]
