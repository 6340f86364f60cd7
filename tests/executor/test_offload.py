"""CPU KV offload on the PyTorch runner, against HF transformers greedy.

Wave 1 runs prompts of 100-120 tokens; a filler wave of unrelated prompts then pushes
their blocks out of a small device pool; wave 2 continues wave 1's first conversation
and shares a 96-token prefix with its second, so those prefixes come back from host
memory (asserted through the load counters) and every token must still be HF's. Injected load failures must fall back to recomputing;
nothing may leak (all device blocks free, no host slot pinned at the end).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.helpers import hf_tiny  # noqa: E402
from tests.helpers.offload_waves import FILLER, PREFIX, WAVE1, assert_nothing_leaks, run_waves, wave2  # noqa: E402
from tests.helpers.torch_engine import NEW_TOKENS, check_tokens, model, run  # noqa: E402

from hybridserve.config import EngineConfig  # noqa: E402
from hybridserve.core.connector.offload import HostOffloadConnector  # noqa: E402
from hybridserve.core.errors import ConfigError  # noqa: E402
from hybridserve.core.kv.spec import FullAttentionSpec  # noqa: E402
from hybridserve.core.request import Request, RequestStatus, SamplingParams  # noqa: E402
from hybridserve.core.sched.config import SchedulerConfig  # noqa: E402
from hybridserve.core.sched.output import KVConnectorOutput  # noqa: E402
from hybridserve.engine.loop import EngineCore, build_engine  # noqa: E402
from hybridserve.executor.torch.executor import TorchExecutor  # noqa: E402
from hybridserve.executor.torch.offload import attach_host_offload, num_host_blocks_for_memory  # noqa: E402
from hybridserve.testing import make_kv_cache_config  # noqa: E402

def make_engine(kind: str, *, async_scheduling: bool, num_blocks: int = 24, host_blocks: int = 400,
                fail_loads: int = 0, **cfg: object) -> tuple[EngineCore, HostOffloadConnector]:
    ex = TorchExecutor(model(kind), use_worker_thread=async_scheduling)
    kvc = ex.kv_cache_config(16, num_blocks=num_blocks)
    conn = attach_host_offload(ex, kvc, host_blocks, fail_loads=fail_loads)
    sc = SchedulerConfig(max_model_len=160, async_scheduling=async_scheduling, max_num_batched_tokens=64,
                         max_num_seqs=2, **cfg)  # type: ignore[arg-type]
    return build_engine(sc, kvc, ex, conn), conn


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_second_wave_loads_prefixes_from_host(kind: str, async_scheduling: bool) -> None:
    eng, conn = make_engine(kind, async_scheduling=async_scheduling)
    try:
        device_hits = run_waves(kind, eng)
        stats = eng.scheduler.make_stats()
        worker = eng.executor.offload
        assert worker is not None
        assert_nothing_leaks(eng, conn)
        stored, loaded = worker.num_stored_blocks, worker.num_loaded_blocks
    finally:
        eng.shutdown()
    # Finished requests' full blocks went to host memory ...
    assert stored == stats.num_offloaded_blocks > 0
    # ... and the continuation's prefix came back from there, up to the last full block of
    # what wave 1 had processed at finish (its prompt and all outputs but the last), since
    # the device pool no longer held it; with full attention the shared 96 tokens too.
    processed_end = (len(WAVE1[0]) + NEW_TOKENS - 1) // 16 * 16
    assert device_hits[0] < processed_end
    want = processed_end - device_hits[0] + (PREFIX - device_hits[1] if kind == "llama" else 0)
    assert stats.num_offload_hit_tokens == want
    # One block per hit block of every full-attention group, plus each windowed group's window.
    assert loaded == stats.num_offload_loaded_blocks >= want // 16
    assert stats.num_failed_loads == 0


def test_unloaded_window_blocks_are_never_cached() -> None:
    # Without window-tail allocation a sliding group gets real blocks for the whole loaded
    # span but only the last window is loaded; were the rest published in the prefix cache,
    # a later prompt sharing a shorter prefix would read them as a device hit.
    eng, conn = make_engine("gemma3", async_scheduling=True, num_blocks=32, window_tail_allocation=False)
    shorter = [WAVE1[0][:64] + [9, 8, 7]]
    try:
        run(eng, WAVE1[:1], tag="a")
        run(eng, FILLER, tag="f")
        continuation = run(eng, wave2("gemma3")[:1], tag="b")  # loads a0's prefix from host
        loaded = conn.stats.num_loaded_blocks
        got = run(eng, shorter, tag="c")
        assert_nothing_leaks(eng, conn)
    finally:
        eng.shutdown()
    assert loaded > 0
    check_tokens("gemma3", wave2("gemma3")[:1], continuation, tag="b")
    check_tokens("gemma3", shorter, got, tag="c")
    assert got["c0"][2] == 0  # the loaded prefix's full-attention blocks are cached, but no sliding block below its window


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_failed_loads_recompute_exactly(kind: str) -> None:
    eng, conn = make_engine(kind, async_scheduling=True, fail_loads=1)
    try:
        run_waves(kind, eng)
        stats = eng.scheduler.make_stats()
        worker = eng.executor.offload
        assert worker is not None
        assert_nothing_leaks(eng, conn)
        failed, loaded = worker.num_failed_blocks, worker.num_loaded_blocks
    finally:
        eng.shutdown()
    assert failed > 0 and stats.num_failed_loads == 1
    if kind == "llama":
        # Full attention resumes at the first failed block: the loaded half is kept, and the
        # second request's load went through.
        assert loaded > 0


def test_abort_while_loading_leaks_nothing() -> None:
    eng, conn = make_engine("llama", async_scheduling=True)
    try:
        run(eng, WAVE1[:1], tag="a")
        run(eng, FILLER, tag="f")
        eng.add_request(Request("x", WAVE1[0] + [5] * 20, SamplingParams(max_tokens=NEW_TOKENS)))
        eng.step()  # admitted straight into a load: its prefix is only in host memory
        assert eng.scheduler.requests["x"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        eng.abort_requests(["x"])
        while eng.has_unfinished_requests():
            eng.step()
        assert conn.stats.num_loaded_blocks > 0
        assert_nothing_leaks(eng, conn)
    finally:
        eng.shutdown()


def test_host_pool_lru_bound_in_the_engine() -> None:
    eng, conn = make_engine("llama", async_scheduling=True, host_blocks=10)
    try:
        run_waves("llama", eng)
        assert_nothing_leaks(eng, conn)
    finally:
        eng.shutdown()
    assert len(conn.index) <= 10 and conn.num_used_slots <= 10
    assert conn.stats.num_evicted_blocks > 0


def _fake_request(rid: str, hashes: list[int], processed: int) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, block_hashes=hashes, num_tokens=processed + 1,
                           num_processed_tokens=processed)


def test_lru_evicts_oldest_unpinned_and_never_a_pinned_slot() -> None:
    kvc = make_kv_cache_config(64, [FullAttentionSpec(16, 1, 8)])
    conn = HostOffloadConnector(kvc, num_host_blocks=4)

    def store(rid: str, hashes: list[int]) -> None:
        delay, _ = conn.request_finished(_fake_request(rid, hashes, 16 * len(hashes)), (list(range(1, 1 + len(hashes))),))
        assert delay
        conn.build_connector_meta(None)
        conn.update_connector_output(KVConnectorOutput(finished_sending={rid}))

    store("a", [1, 2, 3])
    store("b", [4])
    assert [k[0] for k in conn.index] == [1, 2, 3, 4]
    # A load of [1, 2] pins their slots and refreshes them in LRU order.
    req = _fake_request("c", [1, 2, 99], 40)
    assert conn.get_num_new_matched_tokens(req, 0) == (32, True)
    conn.update_state_after_alloc(req, ([5, 6, 7],), 32)
    assert [k[0] for k in conn.index] == [3, 4, 1, 2]
    store("d", [10, 11, 12])  # evicts 3 and 4; 1 and 2 are pinned, so 12 is not stored
    assert [k[0] for k in conn.index] == [1, 2, 10, 11] and conn.stats.num_evicted_blocks == 2
    conn.update_connector_output(KVConnectorOutput(finished_recving={"c"}))
    store("e", [13])  # unpinned now: 1 is the oldest
    assert [k[0] for k in conn.index] == [2, 10, 11, 13] and len(conn.index) == conn.num_host_blocks


def test_config_and_sizes() -> None:
    assert EngineConfig(kv_offload_memory="64MiB").kv_offload_memory == "64MiB"
    with pytest.raises(ConfigError, match=r"kv_offload_memory: cannot parse size"):
        EngineConfig(kv_offload_memory="lots")
    with pytest.raises(ConfigError, match=r"kv_offload_memory needs enable_prefix_caching"):
        EngineConfig(kv_offload_memory="1GiB", enable_prefix_caching=False)
    kvc = make_kv_cache_config(8, [FullAttentionSpec(16, 1, 8)])
    assert num_host_blocks_for_memory(kvc, 10 * 1024) == 10 * 1024 // (16 * 2 * 8 * 4)
    with pytest.raises(ConfigError, match=r"holds no KV block"):
        num_host_blocks_for_memory(kvc, 100)


def test_llm_with_kv_offload_memory_matches_hf() -> None:
    from hybridserve import LLM
    from hybridserve import SamplingParams as UserParams

    llm = LLM(config=EngineConfig(model=str(hf_tiny.tiny_model_dir("llama")), num_blocks=12, max_model_len=160,
                                  max_num_seqs=1, kv_offload_memory="1MiB", dtype="float32"), progress=False)
    try:
        prompts = [WAVE1[0], WAVE1[1], wave2("llama")[0]]  # one at a time: WAVE1[1] evicts WAVE1[0]
        outs = [llm.generate([p], UserParams(max_tokens=NEW_TOKENS), use_tqdm=False)[0] for p in prompts]
        stats = llm.parts.engine.scheduler.make_stats()
    finally:
        llm.shutdown()
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == hf_tiny.oracle("llama", p, NEW_TOKENS)[0]
    assert stats.num_offload_loaded_blocks > 0 and stats.num_offloaded_blocks > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_chunked_local_model_loads_from_host(async_scheduling: bool) -> None:
    """Llama 4 (3 chunked-local groups + 1 full): the continuation's prefix comes back from
    host memory (the full group's hit blocks and each chunked group's current chunk)."""
    eng, conn = make_engine("llama4", async_scheduling=async_scheduling, num_blocks=48)
    try:
        run_waves("llama4", eng)
        stats = eng.scheduler.make_stats()
        assert_nothing_leaks(eng, conn)
    finally:
        eng.shutdown()
    assert stats.num_offloaded_blocks > 0
    assert stats.num_offload_hit_tokens > 0 and stats.num_offload_loaded_blocks > 0
