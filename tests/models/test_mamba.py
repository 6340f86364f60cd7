"""Mamba2, Bamba and Qwen3-Next on the PyTorch runner, against HF transformers' plain-PyTorch path.

Tiny random models (tests/helpers/hf_tiny_mamba.py: SSD chunks of 16, blocks of 16); prompts of
40-100 tokens cross both. Greedy tokens must equal HF's in sync and async mode, with
prefills chunked at every offset, with preemption (states recomputed from zeros), and
with prefix-cache hits (a request starts from the state checkpointed at the last shared
block boundary). The states after a chunked prefill equal those after an unchunked one,
and so does every checkpoint; logits match HF.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybridserve.core.errors import ConfigError, RequestError  # noqa: E402
from hybridserve.core.kv.spec import FullAttentionSpec, MambaSpec, with_mamba_checkpoints  # noqa: E402
from hybridserve.core.request import SamplingParams  # noqa: E402
from hybridserve.core.sched.config import SchedulerConfig  # noqa: E402
from hybridserve.core.sched.output import NewRequestData, ScheduledRequest, SchedulerOutput  # noqa: E402
from hybridserve.engine.loop import build_engine  # noqa: E402
from hybridserve.executor.torch.executor import TorchExecutor, build_kv_cache_config  # noqa: E402
from hybridserve.executor.torch.model_runner import ModelRunner  # noqa: E402
from hybridserve.models.config import FULL, parse_model_config  # noqa: E402
from hybridserve.models.kv_specs import model_kv_layer_specs  # noqa: E402
from hybridserve.models.arch.mamba_config import MAMBA  # noqa: E402
from tests.helpers import hf_tiny_mamba as tiny  # noqa: E402
from tests.helpers.mamba_engine import (BS, NEW_TOKENS, PROMPTS, check, count_skipped_checkpoints,  # noqa: E402
                                        make_engine, model, run)


# -- configs and specs -------------------------------------------------------------------
def test_configs_specs_and_groups() -> None:
    m2, bamba = model("mamba2").cfg, model("bamba").cfg
    assert m2.layer_types == (MAMBA,) * 3 and bamba.layer_types == (MAMBA, FULL, MAMBA, MAMBA)
    assert bamba.rotary_dim == 8 and bamba.attn_scale == pytest.approx(16**-0.5)
    mc = m2.mamba
    assert mc is not None and (mc.conv_dim, mc.intermediate_size, mc.in_proj_size) == (192, 128, 328)
    specs = model_kv_layer_specs(bamba, BS)
    # conv state [conv_dim, K-1] + SSM state [H, P, N], float32.
    assert specs["layers.0"] == MambaSpec(BS, ((192, 3), (8, 16, 16)), "float32")
    assert specs["layers.0"].page_size_bytes == (192 * 3 + 8 * 16 * 16) * 4
    assert specs["layers.1"] == FullAttentionSpec(BS, 2, 16, "float32")
    kvc = build_kv_cache_config(bamba, BS, num_blocks=40)
    # 3 Mamba layers + 1 attention layer -> groups of 1 layer. The attention page is
    # 2 (K, V) * 16 tokens * 2 heads * 16 dims * 4 bytes = 4096 bytes; a state, 2624
    # elements = 10496 bytes, is cut into cdiv(10496, 4096) = 3 pages of cdiv(2624, 3) =
    # 875 elements (3500 bytes): 3 Mamba groups * 3 page groups + 1 attention group.
    assert sorted(type(g.spec).__name__ for g in kvc.groups) == ["FullAttentionSpec"] + ["MambaSpec"] * 9
    mamba = [g.spec for g in kvc.groups if isinstance(g.spec, MambaSpec)]
    assert {(s.num_pages, s.page_elems, s.page_size_bytes) for s in mamba} == {(3, 875, 3500)}
    assert sorted(s.page_index for s in mamba) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert kvc.bytes_per_block == 4096


@pytest.mark.parametrize("change,needle", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_heads": 4}, "expand"),
    ({"n_groups": 3}, "n_groups"),
    ({"chunk_size": 0}, "chunk_size"),
])
def test_bad_mamba2_configs_raise(change: dict, needle: str) -> None:
    import json

    raw = json.loads((tiny.tiny_model_dir("mamba2") / "config.json").read_text())
    raw.update(change)
    with pytest.raises(ConfigError, match=needle):
        parse_model_config(raw)


# -- the runner by hand: logits and states -------------------------------------------------
class HandRun:
    """One request "r" on a ModelRunner, scheduled by hand: all blocks are handed out at
    its first step (attention: enough for the prompt + 48 tokens; Mamba: one state block)."""

    def __init__(self, kind: str, prompt: list[int], checkpoints: bool = False) -> None:
        self.model = model(kind)
        kvc = build_kv_cache_config(self.model.cfg, BS, num_blocks=256)  # Bamba: 10 groups (3 pages a state)
        if checkpoints:  # positional Mamba tables, as with prefix caching
            kvc = replace(kvc, groups=with_mamba_checkpoints(kvc.groups))
        self.runner = ModelRunner(self.model, kvc, torch.device("cpu"))
        self.prompt = prompt
        nb = -(-(len(prompt) + 48) // BS)
        ids, next_id = [], 1
        for g in kvc.groups:
            count = 1 if isinstance(g.spec, MambaSpec) and not checkpoints else nb
            ids.append(list(range(next_id, next_id + count)))
            next_id += count
        self.first_ids = tuple(ids)
        self.done = self.steps = 0
        self.tokens: list[int] = []
        self.logits: list[torch.Tensor] = []  # of every sampling step

    def step(self, n: int) -> None:
        first = self.steps == 0
        nulls = (0,) * len(self.first_ids)
        new = NewRequestData("r", self.prompt, SamplingParams(max_tokens=64), list(self.prompt)) if first else None
        sr = ScheduledRequest("r", self.done, n, 0, self.first_ids if first else tuple([] for _ in nulls), nulls,
                              self.done + n >= len(self.prompt), new)
        real = self.model.logits
        self.model.logits = lambda h: self._record(real(h))  # type: ignore[method-assign]
        try:
            out = self.runner.execute(SchedulerOutput(self.steps, [sr], n))
        finally:
            del self.model.logits
        self.tokens += out.sampled_token_ids[0]
        self.done += n
        self.steps += 1

    def _record(self, out: torch.Tensor) -> torch.Tensor:
        self.logits.append(out[0].clone())
        return out


def _hand_run(kind: str, prompt: list[int], chunks: list[int], decodes: int, checkpoints: bool = False) -> HandRun:
    """Prefill `prompt` in chunks of the given sizes, then `decodes` decode steps."""
    run = HandRun(kind, prompt, checkpoints)
    for n in chunks + [1] * decodes:
        run.step(n)
    return run


def _states(runner: ModelRunner, col: int = 0) -> list[torch.Tensor]:
    """Every Mamba layer's conv and SSM state of the single request, in table column col."""
    assert runner.mamba is not None
    out = []
    for pages in runner.mamba.states:
        if pages is not None:
            ids = [[int(runner.tables.table[g, runner.states["r"].row, col]) for g in pages.page_groups]]
            out += [part[0] for part in pages.read(torch.tensor(ids))]
    return out


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.abs().max() > 0
        assert (x - y).abs().max() <= 1e-4 * x.abs().max()


@pytest.mark.parametrize("kind", tiny.MIXER_KINDS)
def test_block_checkpoints_hold_the_state_after_each_boundary(kind: str) -> None:
    """With prefix caching, block i holds the state after 16(i+1) tokens: the chunks
    (37, 11 ending at 48, the rest, then decodes) cross boundaries inside chunks, at a chunk's end and in a
    decode; each checkpoint equals the state of an unchunked prefill of that prefix."""
    prompt = PROMPTS[2]  # 40..100 tokens
    run = _hand_run(kind, prompt, [37, 11, len(prompt) - 48], 20, checkpoints=True)
    for i in range(run.done // BS):
        ref = _hand_run(kind, (prompt + run.tokens)[: BS * (i + 1)], [BS * (i + 1)], 0).runner
        _close(_states(ref), _states(run.runner, i))
    # The running state: after `done` tokens, in block (done - 1) // 16.
    seq = (prompt + run.tokens)[: run.done]
    _close(_states(_hand_run(kind, seq, [len(seq)], 0).runner), _states(run.runner, (run.done - 1) // BS))


@pytest.mark.parametrize("kind", tiny.MIXER_KINDS)
def test_chunked_prefill_states_equal_unchunked(kind: str) -> None:
    prompt = PROMPTS[1]
    whole = _hand_run(kind, prompt, [len(prompt)], 0).runner
    # Chunks ending inside SSD chunks and blocks, shorter than the conv kernel, and of 1.
    sizes = [7, 2, 1, 23, 16]
    chunked = _hand_run(kind, prompt, sizes + [len(prompt) - sum(sizes)], 0).runner
    _close(_states(whole), _states(chunked))


@pytest.mark.parametrize("kind", tiny.KINDS)
def test_logits_match_hf(kind: str) -> None:
    prompt = PROMPTS[0]
    hand = _hand_run(kind, prompt, [20, len(prompt) - 20], NEW_TOKENS - 1)
    ours, tokens = hand.logits, hand.tokens
    hf = tiny.load_hf(kind)
    with torch.no_grad(), tiny.one_thread():
        out = hf.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                          eos_token_id=None, return_dict_in_generate=True, output_logits=True)
    assert tokens == out.sequences[0, len(prompt):].tolist()
    for step, (a, b) in enumerate(zip(ours, out.logits, strict=True)):
        assert (a - b[0]).abs().max() <= 1e-4 * b.abs().max(), step


@pytest.mark.parametrize("kind", tiny.KINDS)
def test_verify_step_commits_the_state_at_the_accepted_length(kind: str) -> None:
    """Speculative decoding's Mamba side: a decode + 3 drafts in one step keeps the state
    after every token; committing 2 accepted drafts leaves exactly the state of plain
    decoding, and decoding on from there gives HF's tokens."""
    import numpy as np

    from hybridserve.executor.torch.attention import StepAttention
    from hybridserve.executor.torch.mamba_states import GroupSubset, StepBackend, StepMambaStates

    prompt = PROMPTS[2]
    want, _ = tiny.oracle(kind, prompt, NEW_TOKENS)
    hand = _hand_run(kind, prompt, [len(prompt)], 0)
    assert hand.tokens == want[:1]
    runner, m, state = hand.runner, hand.model, hand.runner.states["r"]
    assert runner.mamba is not None
    # The decode token want[0], drafts want[1], want[2] (right) and a wrong third one.
    chunk = [want[0], want[1], want[2], (want[3] + 1) % 512]
    s, n = len(prompt), len(chunk)
    rows, starts, counts = np.array([state.row]), np.array([s]), np.array([n])
    attn = None
    if runner.group_windows:
        attn = StepAttention(runner.layers, runner.group_windows, GroupSubset(runner.tables, runner.mamba.attn_groups),
                             BS, rows, starts, counts, m.cfg.attn_scale, None, torch.device("cpu"), m.dtype)
    io = StepMambaStates.build(runner.mamba, runner.tables, rows, starts, [n], torch.device("cpu"), verify=[0])
    with torch.inference_mode():
        hidden = m(torch.tensor(chunk), torch.arange(s, s + n), s + n - 1, StepBackend(attn, io))
        predicted = m.logits(hidden).argmax(-1).tolist()
    assert predicted[:3] == want[1:4]  # drafts 1, 2 accepted; the third (wrong) rejected
    io.commit([3])  # the decode token + 2 accepted drafts
    state.token_ids += [want[1], want[2], want[3]]
    state.num_computed += 3
    reference = _hand_run(kind, prompt, [len(prompt)], 3).runner
    for a, b in zip(_states(reference), _states(runner), strict=True):
        assert (a - b).abs().max() <= 1e-4 * a.abs().max()
    hand.done = state.num_computed
    for _ in range(NEW_TOKENS - 4):
        hand.step(1)
    assert hand.tokens[1:] == want[4:]


def test_runner_refuses_a_mid_sequence_start() -> None:
    m = model("mamba2")
    kvc = build_kv_cache_config(m.cfg, BS, num_blocks=16)
    runner = ModelRunner(m, kvc, torch.device("cpu"))
    p = PROMPTS[0]
    sr = ScheduledRequest("x", 16, 4, 0, tuple([1] for _ in kvc.groups), (0,) * len(kvc.groups), False,
                          NewRequestData("x", p, SamplingParams(), list(p)))
    with pytest.raises(RequestError, match="keeps no state mid-sequence"):
        runner.execute(SchedulerOutput(0, [sr], 4))


# -- end to end through the engine ----------------------------------------------------------
@pytest.mark.parametrize("kind", tiny.KINDS)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_matches_hf(kind: str, async_scheduling: bool) -> None:
    got = run(make_engine(kind, async_scheduling=async_scheduling), PROMPTS, logprobs=0)
    check(kind, PROMPTS, got)


@pytest.mark.parametrize("kind", tiny.KINDS)
def test_three_steps_in_flight_match_hf(kind: str) -> None:
    """Async with 3 steps in flight (2 is the async default above): a request's next chunk
    is scheduled while its two previous ones may still be running, each reading the state
    the one before it wrote (steps run in dispatch order)."""
    eng = make_engine(kind, async_scheduling=True, max_num_batched_tokens=29, max_concurrent_batches=3)
    assert eng.max_concurrent_batches == 3
    check(kind, PROMPTS, run(eng, PROMPTS))


@pytest.mark.parametrize("kind", tiny.KINDS)
def test_chunked_prefill_across_ssd_chunk_and_block_boundaries(kind: str) -> None:
    # A budget of 23: chunk ends fall at every offset inside SSD chunks and blocks of 16,
    # and decodes share steps with other requests' prefill chunks.
    eng = make_engine(kind, async_scheduling=True, max_num_batched_tokens=23)
    got = run(eng, PROMPTS)
    assert eng.scheduler.stats.num_steps > sum(len(p) for p in PROMPTS) // 23
    check(kind, PROMPTS, got)


@pytest.mark.parametrize("kind,num_blocks", [("bamba", 26), ("granite", 26), ("nemotron_h", 20), ("falcon_h1", 16),
                                             ("qwen3_next", 14), ("lfm2", 16), ("jamba", 26)])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["recompute", "cached"])
def test_preemption_resumes_from_zero_or_a_checkpoint(kind: str, num_blocks: int, async_scheduling: bool,
                                                      prefix_caching: bool) -> None:
    # The attention group grows with the sequence; a small pool forces preemptions.
    # Bamba (and Jamba): 9 of 26 blocks are each request's running Mamba states (3 layers of
    # 3 pages); Granite 4.0-H has Bamba's layout, Nemotron-H 2 Mamba layers (6 pages), Falcon-H1
    # 2 attention and 2 Mamba layers in groups of 2; Qwen3-Next: 2 of 14 (2 Gated DeltaNet
    # layers a group, 2 pages a state); LFM2: 3 of 16 its conv states (3 layers, one page
    # each). So with prefix caching too (the state stays in place; checkpoints are
    # best-effort). Without it a resumed request restarts at 0; with it, it resumes from its
    # own last cached checkpoint, if one was kept and not evicted meanwhile.
    eng = make_engine(kind, async_scheduling=async_scheduling, num_blocks=num_blocks,
                      max_num_batched_tokens=32, prefix_caching=prefix_caching)
    got = run(eng, PROMPTS)
    assert eng.scheduler.stats.num_preemptions > 0
    check(kind, PROMPTS, got)


def test_reused_state_blocks_start_from_zero() -> None:
    # Without prefix caching a pure Mamba model never grows, so it is never preempted:
    # 3 state blocks run 4 requests by queueing, and the 4th reuses a finished request's
    # block, whose stale states must not leak into it.
    eng = make_engine("mamba2", async_scheduling=True, num_blocks=4, max_num_batched_tokens=64, prefix_caching=False)
    got = run(eng, PROMPTS)
    assert eng.scheduler.stats.num_preemptions == 0
    check("mamba2", PROMPTS, got)


def test_without_prefix_caching_a_mamba_model_gets_no_hit() -> None:
    base = PROMPTS[3]
    eng = make_engine("bamba", async_scheduling=True, prefix_caching=False)
    first = run(eng, [base], tag="a", shutdown=False)
    second = [list(base), base + [5, 6, 7, 8, 9]]
    got = run(eng, second, tag="b")
    check("bamba", [base], first, tag="a")
    check("bamba", second, got, tag="b")
    assert got["b0"][2] == 0 and got["b1"][2] == 0


@pytest.mark.parametrize("kind", tiny.KINDS)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prefix_cache_hits_start_from_the_checkpointed_state(kind: str, async_scheduling: bool) -> None:
    """A second wave shares the first's prompts (and, multi-turn, its outputs): it starts
    from the Mamba checkpoint at the last shared block boundary, attention blocks too.
    Chunks of 24 tokens put most boundaries inside chunks."""
    base = PROMPTS[3]
    eng = make_engine(kind, async_scheduling=async_scheduling, max_num_batched_tokens=24)
    first = run(eng, [base], tag="a", shutdown=False)
    check(kind, [base], first, tag="a")
    turn2 = base + first["a0"][0] + [5, 6, 7]
    second = [list(base), base[:50] + [9] * 20, turn2]
    got = run(eng, second, tag="b")
    check(kind, second, got, tag="b")
    # Hits end at the last whole block every request has seen (and before the last token).
    assert [got[f"b{i}"][2] for i in range(3)] == [
        (len(base) - 1) // BS * BS, 48, (len(base) + NEW_TOKENS - 1) // BS * BS]


@pytest.mark.parametrize("kind", tiny.KINDS)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_requests_sharing_a_prefix_arriving_together(kind: str, async_scheduling: bool) -> None:
    """A Mamba layer reads every request's state before it writes any, so a request must
    not hit a checkpoint that a step in flight (or its own step) is still writing; the
    KV core publishes Mamba checkpoints of processed steps only."""
    base = PROMPTS[3]
    prompts = [base[:70] + [11 + i] * (5 + i) for i in range(3)]
    eng = make_engine(kind, async_scheduling=async_scheduling, max_num_batched_tokens=200)
    got = run(eng, prompts)
    check(kind, prompts, got)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_paged_bamba_states_hit_the_best_effort_checkpoints(async_scheduling: bool) -> None:
    """Bamba's states are 3 pages (see test_configs_specs_and_groups), each kept in place
    (a request's cap: 1 block a page group). The 400-block pool has blocks to spare, so
    every boundary gets a checkpoint, chunk starts, interiors and decodes alike: the
    second wave hits at 80 (86 tokens), 64 (70 shared) and 96 (the first turn processed
    97), starting from paged states, and every token is HF's."""
    base = PROMPTS[3]
    ex = TorchExecutor(model("bamba"), use_worker_thread=async_scheduling)
    sc = SchedulerConfig(max_model_len=2048, async_scheduling=async_scheduling, max_num_batched_tokens=24)
    eng = build_engine(sc, ex.kv_cache_config(BS, num_blocks=400), ex)
    specs = [m.spec for m in eng.scheduler.kv.coordinator.managers if isinstance(m.spec, MambaSpec)]
    assert len(specs) == 9 and {(s.num_pages, s.running_in_place) for s in specs} == {(3, True)}
    assert {eng.scheduler.kv.caps[g] for g, m in enumerate(eng.scheduler.kv.coordinator.managers)
            if isinstance(m.spec, MambaSpec)} == {1}
    first = run(eng, [base], tag="a", shutdown=False)
    check("bamba", [base], first, tag="a")
    second = [list(base), base[:70] + [9] * 20, base + first["a0"][0] + [5, 6, 7]]
    got = run(eng, second, tag="b")
    check("bamba", second, got, tag="b")
    assert len(base) == 86 and [got[f"b{i}"][2] for i in range(3)] == [80, 64, 96]


@pytest.mark.parametrize("kind", tiny.KINDS)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_short_pool_skips_checkpoints_and_every_token_is_hf(kind: str, async_scheduling: bool) -> None:
    """Pools near the admission minimum (one max-length request of 160 tokens: Bamba 10
    attention blocks + 9 running-state pages, 20 blocks with the null block (Jamba alike);
    Mamba2 one group of 3 layers, 1 block, 2; Qwen3-Next 10 attention blocks + 2
    running-state pages (2 Gated DeltaNet layers per group, 2 pages a state), 13; LFM2 10 + 3
    one-page conv states, 14) with the prefix-hit workload: best-effort checkpoints are
    skipped (null entries), hits get fewer, and every token is still HF's. The second wave
    starts only from checkpoints that exist."""
    num_blocks = {"mamba2": 4, "bamba": 26, "granite": 26, "nemotron_h": 22, "falcon_h1": 18, "qwen3_next": 16,
                  "lfm2": 18, "jamba": 26}[kind]
    base = PROMPTS[3]
    eng = make_engine(kind, async_scheduling=async_scheduling, num_blocks=num_blocks, max_num_batched_tokens=24)
    skipped = count_skipped_checkpoints(eng)
    first = run(eng, [base], tag="a", shutdown=False)
    turn2 = base + first["a0"][0] + [5, 6, 7]
    second = [list(base), base[:50] + [9] * 20, turn2]
    got = run(eng, second, tag="b")
    check(kind, [base], first, tag="a")
    check(kind, second, got, tag="b")
    assert sum(skipped) > 0
