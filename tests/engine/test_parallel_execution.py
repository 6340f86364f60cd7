"""Pipeline and tensor parallelism on real worker processes (torch.distributed, gloo).

Every test starts P x T worker processes with the multiprocessing backend and checks:
- greedy output equals Hugging Face greedy token for token (sliding window: Mistral,
  Gemma 3; chunked local: Llama 4; Mamba: Bamba), with chunked prefill, prefix hits,
  preemption, sync and async scheduling, and speculative decoding;
- steps really overlap across stages, and the scheduler's in-flight counts equal the
  tokens of the steps the workers still hold, after every step;
- the unsafe optimistic free corrupts real output under PP=2 with rejected drafts,
  while the processed-token rule (the default) keeps it equal to HF;
- a killed worker ends the executor with a named error and no process left behind.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.helpers import hf_tiny  # noqa: E402
from tests.helpers.oracle_drafter import OracleDrafter  # noqa: E402
from tests.helpers.parallel_engine import NEW_TOKENS, make_engine, model_dir  # noqa: E402
from tests.helpers.tiny_models import greedy_tokens  # noqa: E402

from hybridserve.core.errors import ConfigError  # noqa: E402
from hybridserve.core.request import Request, SamplingParams  # noqa: E402
from hybridserve.core.sched.config import SchedulerConfig  # noqa: E402
from hybridserve.engine.loop import EngineCore, build_engine  # noqa: E402
from hybridserve.executor.distributed.backends import make_distributed_executor  # noqa: E402
from hybridserve.executor.distributed.driver import ExecutorFailedError  # noqa: E402
from hybridserve.executor.distributed.layout import ParallelLayout  # noqa: E402

class TolerantOracleDrafter(OracleDrafter):
    """The oracle drafter, proposing nothing once a request has left HF's continuation
    (which only a corrupted run does)."""

    def propose(self, token_ids: list[int], num_drafts: int) -> list[int]:
        n = len(token_ids)
        if not any(f[:n] == token_ids for f in self.sequences):
            return []
        return super().propose(token_ids, num_drafts)


def oracle(kind: str, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    return greedy_tokens(kind, prompt, n)


def prompts_with_shared_prefix(seed: int = 0) -> list[list[int]]:
    """Five prompts; the last two share a 40-token prefix with the first (prefix hits)."""
    rng = random.Random(seed)
    shared = [rng.randint(3, 255) for _ in range(40)]
    out = [shared + [rng.randint(3, 255) for _ in range(9)]]
    out += [[rng.randint(3, 255) for _ in range(rng.randint(20, 70))] for _ in range(2)]
    out += [shared + [rng.randint(3, 255) for _ in range(k)] for k in (3, 17)]
    return out


def run(engine: EngineCore, prompts: list[list[int]], check_in_flight: bool = False) -> dict[str, list[int]]:
    """Output tokens per request. The last two prompts are added after the first finishes
    (so their prefix is cached). check_in_flight: after every step, each request's
    in-flight count equals its tokens in the steps the executor still holds."""
    got: dict[str, list[int]] = {}
    first, later = prompts[:-2], prompts[-2:]
    for i, p in enumerate(first):
        engine.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=NEW_TOKENS)))
    added = False
    try:
        while engine.has_unfinished_requests() or not added:
            if not added and "r0" in got and len(got["r0"]) == NEW_TOKENS:
                for j, p in enumerate(later):
                    engine.add_request(Request(f"r{len(first) + j}", p, SamplingParams(max_tokens=NEW_TOKENS)))
                added = True
            _, outs = engine.step()
            for o in outs:
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
            if check_in_flight:
                assert_in_flight_matches_workers(engine)
    finally:
        pool = engine.scheduler.kv.pool
        engine.shutdown()
    assert pool.num_free_blocks == pool.num_blocks - 1  # nothing leaked
    return got


def assert_in_flight_matches_workers(engine: EngineCore) -> None:
    """Each request's in-flight count equals its tokens in the steps the workers hold."""
    held: dict[str, int] = {}
    for so in engine.executor.in_flight_steps():  # type: ignore[attr-defined]
        for sr in so.requests:
            held[sr.request_id] = held.get(sr.request_id, 0) + sr.num_scheduled_tokens
    for rid, req in engine.scheduler.requests.items():
        assert req.num_in_flight_tokens == held.get(rid, 0), (rid, req.num_in_flight_tokens, held)


def assert_matches_hf(kind: str, prompts: list[list[int]], got: dict[str, list[int]]) -> None:
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == oracle(kind, p), f"{kind} prompt {i}"


@pytest.mark.parametrize("kind,async_scheduling", [("mistral", True), ("gemma3", False), ("llama4", True),
                                                    ("bamba", False), ("lfm2", True), ("jamba", False)])
def test_pipeline_parallel_2_matches_hf(kind: str, async_scheduling: bool) -> None:
    prompts = prompts_with_shared_prefix()
    eng = make_engine(kind, 2, async_scheduling=async_scheduling)
    hits = eng.scheduler.kv.prefix_cache_stats
    got = run(eng, prompts, check_in_flight=True)
    assert_matches_hf(kind, prompts, got)
    if kind not in ("bamba", "lfm2", "jamba"):  # state groups checkpoint chunk tails and every K blocks: no sure hit
        assert hits.hits > 0  # the late prompts hit the cached shared prefix


@pytest.mark.parametrize("kind", ["mistral", "bamba", "lfm2", "jamba"])
def test_tensor_parallel_2_matches_hf(kind: str) -> None:
    prompts = prompts_with_shared_prefix(1)
    got = run(make_engine(kind, 1, 2, async_scheduling=True), prompts)
    assert_matches_hf(kind, prompts, got)


def test_pipeline_2_by_tensor_2_with_preemption_matches_hf() -> None:
    prompts = prompts_with_shared_prefix(2)
    eng = make_engine("gemma3", 2, 2, num_blocks=20, max_model_len=96)  # too few blocks for all: preemption
    got = run(eng, prompts)
    assert_matches_hf("gemma3", prompts, got)
    assert eng.scheduler.stats.num_preemptions > 0


def _spec_prompts(kind: str) -> list[list[int]]:
    rng = random.Random(3)
    s = [rng.randint(3, 255) for _ in range(40)]
    g = oracle(kind, s, 12)
    return [s + g + [rng.randint(3, 255) for _ in range(5)] + s + g[:4],
            [rng.randint(3, 255) for _ in range(30)], [rng.randint(3, 255) for _ in range(25)]]


@pytest.mark.parametrize("unsafe", [False, True], ids=["processed-basis", "unsafe-optimistic"])
def test_optimistic_free_corrupts_real_pipeline_output_and_the_rule_does_not(unsafe: bool) -> None:
    """PP=2, async, 4 drafts per step with rejections (an oracle drafter corrupting two
    proposals of three), a sliding window of 16 tokens. Freeing on the optimistic count
    frees blocks a rolled-back request still needs inside its window: its next steps read
    the null block and the output leaves HF's. The default frees on the processed count."""
    kind = "mistral"
    prompts = _spec_prompts(kind)
    sequences = [p + oracle(kind, p, 40) for p in prompts]
    eng = make_engine(kind, 2, async_scheduling=True, spec=4, drafter=TolerantOracleDrafter(sequences),
                      unsafe=unsafe)
    for i, p in enumerate(prompts):
        eng.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=40)))
    got = eng.run()
    stats = eng.scheduler.stats
    eng.shutdown()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # drafts were rejected
    same = [got[f"r{i}"] == oracle(kind, p, 40) for i, p in enumerate(prompts)]
    if unsafe:
        assert not all(same), "the unsafe free left every output intact"
    else:
        assert all(same)


@pytest.mark.parametrize("pp", [2, 3])
def test_steps_overlap_across_stages_and_in_flight_counts_match(pp: int) -> None:
    rng = random.Random(4)
    prompts = [[rng.randint(3, 255) for _ in range(rng.randint(10, 60))] for _ in range(6)]
    eng = make_engine("gemma3", pp, trace=True)
    got: dict[str, list[int]] = {}
    ex = eng.executor
    try:
        for i, p in enumerate(prompts):
            eng.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=NEW_TOKENS)))
        most_in_flight = 0
        while eng.has_unfinished_requests():
            _, outs = eng.step()
            most_in_flight = max(most_in_flight, len(ex.in_flight_steps()))  # type: ignore[attr-defined]
            for o in outs:
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
            assert_in_flight_matches_workers(eng)
        traces = ex.traces()  # type: ignore[attr-defined]
    finally:
        eng.shutdown()
    assert_matches_hf("gemma3", prompts, got)
    assert most_in_flight == pp - 1  # after each wait, P - 1 steps stay in the pipeline
    first, last = 0, (pp - 1)  # ranks of the first and last stage (tp = 1)
    spans = {(t.rank, t.step_id): (t.start, t.end) for t in traces}
    steps = sorted({s for r, s in spans if r == last})
    overlapped = [s for s in steps if (first, s + 1) in spans and spans[(first, s + 1)][0] < spans[(last, s)][1]]
    # The first stage starts step N+1 while the last still computes step N, for most steps.
    assert len(overlapped) >= len(steps) // 2, (len(overlapped), len(steps))


def test_killed_worker_fails_the_executor_and_leaves_no_process() -> None:
    eng = make_engine("mistral", 2)
    ex = eng.executor
    procs = list(ex.procs)  # type: ignore[attr-defined]
    eng.add_request(Request("r0", list(range(3, 40)), SamplingParams(max_tokens=200)))
    eng.step()
    os.kill(procs[1].pid, signal.SIGKILL)
    with pytest.raises(ExecutorFailedError, match="worker rank 1 was killed by signal 9"):
        for _ in range(400):
            eng.step()
    ex.shutdown()
    deadline = time.monotonic() + 10
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(p.is_alive() for p in procs)


@pytest.mark.parametrize("pp,tp,needle", [(5, 1, "sizes that work: 1..4"), (1, 3, "sizes that work: 1, 2")])
def test_layouts_the_model_does_not_divide_are_refused_before_any_process_starts(pp: int, tp: int,
                                                                                  needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        make_distributed_executor("mp", layout=ParallelLayout(pp, tp), model_path=str(model_dir("mistral")))


def test_ray_backend_matches_hf() -> None:
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'hybridserve[ray]')")
    prompts = prompts_with_shared_prefix(5)
    got = run(make_engine("mistral", 2, backend="ray"), prompts)
    assert_matches_hf("mistral", prompts, got)


def test_llm_api_with_pipeline_and_tensor_parallel_matches_hf_and_keeps_grammars() -> None:
    """The Python API builds the worker executor from its config: text prompts through
    PP=2 x TP=2 give HF's greedy tokens, and a constrained request (its grammar lives on
    the last stage) stays inside its choices."""
    import json

    from tests.helpers.serving_models import PROMPTS
    from tests.helpers.structured_models import byte_model_dir

    from hybridserve import LLM, SamplingParams as UserParams, StructuredOutput

    path = byte_model_dir()
    llm = LLM(str(path), max_model_len=256, dtype="float32", progress=False, pipeline_parallel_size=2,
              tensor_parallel_size=2)
    try:
        outs = llm.generate(PROMPTS, UserParams(max_tokens=12), use_tqdm=False)
        choice = llm.generate(PROMPTS[0], UserParams(max_tokens=20, structured_output=StructuredOutput(
            "choice", json.dumps(["apple", "banana", "cherry"]))), use_tqdm=False)
    finally:
        llm.shutdown()
    hf = hf_tiny.load_hf(path)
    for o in outs:
        want, _ = hf_tiny.hf_greedy(hf, o.prompt_token_ids, 12)
        # A stop at EOS ends early; HF (no eos set) goes on past it.
        assert o.token_ids == (want[: len(o.token_ids)] if o.finish_reason == "stop" else want)
    assert choice[0].finish_reason == "stop" and choice[0].text in ("apple", "banana", "cherry"), choice[0].text


def test_parallel_flags_reach_the_engine_config() -> None:
    import argparse

    from hybridserve.entrypoints.engine_flags import add_engine_arguments, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    cfg = engine_config_from_args(p.parse_args(["-pp", "3", "--tensor-parallel-size", "2",
                                                "--distributed-executor-backend", "ray"]))
    assert (cfg.pipeline_parallel_size, cfg.tensor_parallel_size, cfg.distributed_executor_backend) == (3, 2, "ray")
    assert cfg.scheduler_config(64).num_concurrent_batches == 3  # P steps in flight


@pytest.mark.parametrize("kind,pp,tp,fail_loads", [("llama", 2, 1, 0), ("gemma3", 1, 2, 1)])
def test_kv_offload_across_workers_loads_from_host_and_matches_hf(kind: str, pp: int, tp: int,
                                                                   fail_loads: int) -> None:
    """Each worker keeps its share of every offloaded block (its layers, its heads); a
    load counts as done once every worker has loaded its share, and a block any worker
    failed to load is recomputed. Waves as in test_offload.py: wave 2 comes back from host."""
    from tests.helpers.offload_waves import PREFIX, WAVE1, run_waves
    from tests.helpers.torch_engine import NEW_TOKENS as OFFLOAD_TOKENS

    from hybridserve.executor.torch.offload import attach_host_offload

    ex = make_distributed_executor("mp", layout=ParallelLayout(pp, tp), model_path=str(hf_tiny.tiny_model_dir(kind)),
                                   num_threads=1)
    kvc = ex.kv_cache_config(16, num_blocks=24)
    conn = attach_host_offload(ex, kvc, 400, fail_loads=fail_loads)
    sc = SchedulerConfig(max_model_len=160, async_scheduling=True, pipeline_parallel_size=pp,
                         max_num_batched_tokens=64, max_num_seqs=2)
    eng = build_engine(sc, kvc, ex, conn)
    try:
        device_hits = run_waves(kind, eng)  # checks every token against HF
        stats = eng.scheduler.make_stats()
        assert not conn.pins and not conn.pending_loads and not conn.pending_stores
        assert eng.scheduler.kv.pool.num_free_blocks == kvc.num_blocks - 1
    finally:
        eng.shutdown()
    assert stats.num_offloaded_blocks > 0
    if fail_loads:
        assert stats.num_failed_loads >= 1
        return
    # As in the single-process test: the continuation's prefix up to wave 1's last processed
    # full block, and (full attention) the shared 96-token prefix, came from host memory.
    processed_end = (len(WAVE1[0]) + OFFLOAD_TOKENS - 1) // 16 * 16
    assert stats.num_offload_hit_tokens == processed_end - device_hits[0] + (PREFIX - device_hits[1])
    assert stats.num_failed_loads == 0


_DRIVER = """
import sys, time
sys.path[:0] = {path!r}
from hybridserve.executor.distributed.backends import make_distributed_executor
from hybridserve.executor.distributed.layout import ParallelLayout
if __name__ == "__main__":
    ex = make_distributed_executor("mp", layout=ParallelLayout(2, 1), model_path={model!r}, num_threads=1)
    print(" ".join(str(p.pid) for p in ex.procs), flush=True)
    time.sleep(600)
"""


def test_workers_of_a_killed_driver_exit() -> None:
    """A driver killed without a chance to stop its workers (SIGKILL): they notice within
    seconds and exit, so no worker outlives the engine that started it."""
    import subprocess
    import sys

    code = _DRIVER.format(path=sys.path, model=str(model_dir("mistral")))
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]  # type: ignore[union-attr]
        assert len(pids) == 2
        driver.kill()
        driver.wait(10)

        def alive(pid: int) -> bool:
            try:
                os.kill(pid, 0)
                with open(f"/proc/{pid}/stat") as stat:  # reaped between the two looks: ESRCH or ENOENT
                    status = stat.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                return False
            return status != "Z"

        deadline = time.monotonic() + 20
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in pids)
    finally:
        if driver.poll() is None:
            driver.kill()
