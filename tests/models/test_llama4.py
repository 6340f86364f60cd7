"""Llama 4 text end to end against HF transformers' Llama4ForCausalLM.

Tiny random model (tests/helpers/hf_tiny.py "llama4"): hidden 64, 4 layers = chunked + dense,
chunked + MoE, chunked + dense, NoPE global + MoE; 4 experts (top-1); chunks of 32,
blocks of 16; temperature tuning visible from position 15 on (floor_scale 16). Prompts of
5, 40 and 70 tokens cross chunk and block boundaries, and so do 16 new tokens after 70.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hybridserve.core.errors import ConfigError  # noqa: E402
from hybridserve.core.kv.spec import ChunkedLocalAttentionSpec, FullAttentionSpec  # noqa: E402
from hybridserve.core.sched.config import SchedulerConfig  # noqa: E402
from hybridserve.core.sched.output import SchedulerOutput  # noqa: E402
from hybridserve.engine.loop import EngineCore, build_engine  # noqa: E402
from hybridserve.executor.torch.attention import StepAttention  # noqa: E402
from hybridserve.executor.torch.executor import build_kv_cache_config  # noqa: E402
from hybridserve.executor.torch.kv_cache import PagedKVCache  # noqa: E402
from hybridserve.executor.torch.requests import BlockTables  # noqa: E402
from hybridserve.models.config import CHUNKED, FULL, load_model_config, parse_model_config  # noqa: E402
from hybridserve.models.kv_specs import layer_name, model_kv_layer_specs  # noqa: E402
from hybridserve.models.arch.llama4 import Llama4LM  # noqa: E402
from tests.helpers import hf_tiny  # noqa: E402
from tests.helpers.torch_engine import RecordingExecutor, check_tokens, model, run  # noqa: E402

KIND = "llama4"
BS = 16
PROMPTS = [p[:n] for p, n in zip(hf_tiny.random_prompts(3, 70, 70, vocab=512, seed=11), (5, 40, 70))]


def _raw() -> dict:
    import json

    return json.loads((hf_tiny.tiny_model_dir(KIND) / "config.json").read_text())


# -- config and KV specs --------------------------------------------------------------
def test_config_layers_and_kv_specs() -> None:
    cfg = load_model_config(hf_tiny.tiny_model_dir(KIND))
    assert cfg.family == "llama4" and cfg.llama4 is not None
    assert cfg.layer_types == (CHUNKED, CHUNKED, CHUNKED, FULL) and cfg.attention_chunk_size == 32
    assert cfg.llama4.rope_layers == (True, True, True, False)
    assert cfg.llama4.moe_layers == (False, True, False, True)
    assert (cfg.llama4.num_experts, cfg.llama4.intermediate_size_mlp, cfg.intermediate_size) == (4, 128, 64)
    specs = model_kv_layer_specs(cfg, BS)
    assert specs["layers.0"] == ChunkedLocalAttentionSpec(BS, 2, 16, "float32", attention_chunk_size=32)
    assert specs["layers.3"] == FullAttentionSpec(BS, 2, 16, "float32")
    kvc = build_kv_cache_config(cfg, BS, num_blocks=10)
    # Groups share a size (here 1 layer): three chunked-local groups and one full group.
    assert sorted(type(g.spec).__name__ for g in kvc.groups) == ["ChunkedLocalAttentionSpec"] * 3 + ["FullAttentionSpec"]
    # Chunks of 32 cannot be split into blocks of 64; the error names the block size that works.
    with pytest.raises(ConfigError, match=r"attention_chunk_size=32 is not a multiple of block_size=64; use "
                                          r"--block-size 32 \(block_size=32\)"):
        model_kv_layer_specs(cfg, 64)


@pytest.mark.parametrize("change,needle", [
    ({"layer_types": ["chunked_attention"] * 4, "attention_chunk_size": None}, "attention_chunk_size"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"layer_types": ["sliding_attention"] * 4}, "sliding_attention"),
])
def test_bad_llama4_configs_raise(change: dict, needle: str) -> None:
    raw = _raw()
    raw.update(change)
    with pytest.raises(ConfigError, match=needle):
        parse_model_config(raw)


def test_derived_layers_without_layer_types() -> None:
    raw = _raw()
    for key in ("layer_types", "no_rope_layers", "moe_layers"):
        raw.pop(key)
    assert parse_model_config(raw) == load_model_config(hf_tiny.tiny_model_dir(KIND))
    raw["attention_chunk_size"] = None  # no chunk size: every layer is global
    assert parse_model_config(raw).layer_types == (FULL,) * 4


# -- logits vs HF, computed in prefill chunks through the paged cache ------------------------
def _chunked_logits(m: Llama4LM, prompt: list[int], chunk_lens: list[int]) -> torch.Tensor:
    """All positions' logits, the prompt computed in consecutive steps of chunk_lens tokens."""
    nb = -(-len(prompt) // BS)
    kvc = build_kv_cache_config(m.cfg, BS, num_blocks=1 + m.cfg.num_layers * nb)  # >= one group per layer
    kv = PagedKVCache(kvc, torch.device("cpu"))
    layers = [(kv.layer_group[layer_name(i)], kv.layer_view[layer_name(i)]) for i in range(m.cfg.num_layers)]
    tables = BlockTables(len(kvc.groups))
    row = tables.alloc_row()
    for g in range(len(kvc.groups)):  # distinct blocks per group, in reverse order to catch mix-ups
        tables.append(g, row, [1 + g * nb + (nb - 1 - j) for j in range(nb)])
    windows = [None] * len(kvc.groups)
    chunks = [getattr(g.spec, "attention_chunk_size", None) for g in kvc.groups]
    out, s = [], 0
    for c in chunk_lens:
        attn = StepAttention(layers, windows, tables, BS, np.array([row]), np.array([s]), np.array([c]),
                             m.cfg.attn_scale, None, torch.device("cpu"), m.dtype, chunks)
        pos = torch.arange(s, s + c)
        with torch.inference_mode():
            out.append(m.logits(m(torch.tensor(prompt[s : s + c]), pos, s + c - 1, attn)))
        s += c
    return torch.cat(out)


def test_logits_match_hf_and_oracle_is_self_consistent() -> None:
    prompt = PROMPTS[2]
    hf = hf_tiny.load_hf(hf_tiny.tiny_model_dir(KIND))
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    m = model(KIND)
    assert isinstance(m, Llama4LM)
    # One step; then steps ending mid-block and mid-chunk (23, 24), one crossing a chunk boundary
    # (24..63), one starting on one (64..69).
    for lens in ([70], [23, 1, 40, 6]):
        got = _chunked_logits(m, prompt, lens)
        assert (got - want).abs().max().item() < 1e-4, lens
    # HF's own greedy run (its chunked layers keep a sliding cache) agrees with full recompute.
    toks, _ = hf_tiny.oracle(KIND, prompt, 16)
    with torch.no_grad():
        full = hf(torch.tensor([prompt + toks])).logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
    assert full == toks


# -- the engine: exact HF greedy tokens -------------------------------------------------
class NullPrefixExecutor(RecordingExecutor):
    """Also records the longest null prefix the scheduler reports per group (chunk pruning)."""

    max_null: tuple[int, ...] = ()

    def execute(self, scheduler_output: SchedulerOutput):  # type: ignore[no-untyped-def]
        for sr in scheduler_output.requests:
            seen = self.max_null or (0,) * len(sr.num_null_blocks)
            self.max_null = tuple(max(a, b) for a, b in zip(seen, sr.num_null_blocks))
        return super().execute(scheduler_output)


def _engine(async_scheduling: bool, num_blocks: int = 400, max_num_batched_tokens: int = 2048,
            **cfg: object) -> EngineCore:
    """Built as the frontend builds it: window-tail allocation on unless cfg says otherwise."""
    ex = NullPrefixExecutor(model(KIND), use_worker_thread=async_scheduling)
    sc = SchedulerConfig(max_model_len=160, async_scheduling=async_scheduling, enable_prefix_caching=True,
                         max_num_batched_tokens=max_num_batched_tokens, **cfg)  # type: ignore[arg-type]
    return build_engine(sc, ex.kv_cache_config(BS, num_blocks=num_blocks), ex)


def _is_chunked(eng: EngineCore) -> list[bool]:
    return [isinstance(g.spec, ChunkedLocalAttentionSpec) for g in eng.executor.runner.kv.config.groups]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_matches_hf(async_scheduling: bool) -> None:
    eng = _engine(async_scheduling)
    try:
        got = run(eng, PROMPTS, logprobs=0)
        chunked = _is_chunked(eng)
        max_null = eng.executor.max_null  # type: ignore[attr-defined]
    finally:
        eng.shutdown()
    check_tokens(KIND, PROMPTS, got)
    for i, p in enumerate(PROMPTS):
        _, want_lp = hf_tiny.oracle(KIND, p, 16)
        assert max(abs(a - b) for a, b in zip(got[f"r{i}"][1], want_lp)) < 1e-3
    # Chunks before the current one were freed: 70 + 15 processed tokens -> 4 null blocks.
    assert [n >= 4 if c else n == 0 for n, c in zip(max_null, chunked)] == [True] * 4


@pytest.mark.parametrize("window_tail", [False, True], ids=["plain", "window_tail"])
def test_chunked_prefill_across_chunk_and_block_boundaries(window_tail: bool) -> None:
    budget = 23  # chunk ends at every offset inside blocks of 16 and chunks of 32
    eng = _engine(True, max_num_batched_tokens=budget, window_tail_allocation=window_tail)
    try:
        got = run(eng, PROMPTS)
        steps = eng.scheduler.stats.num_steps
    finally:
        eng.shutdown()
    assert steps > sum(len(p) for p in PROMPTS) // budget
    check_tokens(KIND, PROMPTS, got)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prefix_cache_hits(async_scheduling: bool) -> None:
    base = PROMPTS[2]
    eng = _engine(async_scheduling)
    try:
        first = run(eng, [base], tag="a")
        second = [list(base), base + [5, 6, 7, 8, 9], base[:56] + [5, 6, 7, 8, 9, 10, 11]]
        got = run(eng, second, tag="b")
    finally:
        eng.shutdown()
    check_tokens(KIND, [base], first, tag="a")
    check_tokens(KIND, second, got, tag="b")
    # Hits of 64 start a chunk: the chunked group serves them with null blocks only. The
    # third hit (48) is mid-chunk: it needs block 2 (32..47), freed by the first request
    # once 64 tokens were processed but still in the prefix cache.
    assert got["b0"][2] == 64 and got["b1"][2] == 64 and got["b2"][2] == 48


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preemption_recomputes_exactly(async_scheduling: bool) -> None:
    eng = _engine(async_scheduling, num_blocks=30, max_num_batched_tokens=32)
    try:
        got = run(eng, PROMPTS)
        preemptions = eng.scheduler.stats.num_preemptions
    finally:
        eng.shutdown()
    check_tokens(KIND, PROMPTS, got)
    assert preemptions > 0


def test_routed_experts_top2_match_hf_moe_block() -> None:
    """Top-2 routing (released models use top-1): our MoE equals HF's Llama4TextMoe."""
    import transformers as tf
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    from hybridserve.models.arch.llama4 import Llama4Experts, routed_experts

    torch.manual_seed(3)
    hf_cfg = tf.Llama4TextConfig(hidden_size=32, intermediate_size=48, num_local_experts=5, num_experts_per_tok=2)
    moe = Llama4TextMoe(hf_cfg).eval()
    for prm in moe.parameters():
        torch.nn.init.normal_(prm, std=0.3)
    cfg = parse_model_config(dict(_raw(), hidden_size=32, intermediate_size=48))
    ours = Llama4Experts(cfg, 5, torch.float32)
    with torch.no_grad():
        ours.router.copy_(moe.router.weight)
        ours.gate_up.copy_(moe.experts.gate_up_proj)
        ours.down.copy_(moe.experts.down_proj)
        x = torch.randn(9, 32)
        want, _ = moe(x)
        shared = moe.shared_expert(x)
        got = shared + routed_experts(x, ours, 2, torch.nn.functional.silu)
    assert (got - want).abs().max().item() < 1e-5
