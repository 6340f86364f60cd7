"""gpt-oss (GptOssForCausalLM) end to end against HF transformers.

Tiny random model (tests/helpers/hf_tiny.py "gpt_oss"): hidden 64, 4 layers alternating sliding
(window 16) and full attention, 4 query / 2 KV heads of 16, a sink per head, 4 experts
top-2 with biases and a clamp limit the activations cross, YaRN RoPE. Prompts of 40-120
tokens cross windows and blocks of 16. Sinks get a hand-worked attention case; MXFP4
expert weights a checkpoint twin (tests/models/test_mxfp4.py checks the unpacking itself).

The kind-parametrized suites run it too: greedy sync / async, chunked prefill, prefix
hits, preemption (tests/executor/test_torch_engine.py), the runner (test_torch_models.py), prompt
logprobs (test_prompt_logprobs.py), PP=2 and TP=2 (test_model_parallel.py).
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hybridserve.core.errors import ConfigError  # noqa: E402
from hybridserve.core.kv.spec import FullAttentionSpec, SlidingWindowSpec  # noqa: E402
from hybridserve.executor.torch.attention import StepAttention  # noqa: E402
from hybridserve.executor.torch.requests import BlockTables  # noqa: E402
from hybridserve.executor.torch.spec_decode import NgramDrafter  # noqa: E402
from hybridserve.models.config import FULL, SLIDING, load_model_config, parse_model_config  # noqa: E402
from hybridserve.models.arch.gpt_oss import GptOssLM  # noqa: E402
from hybridserve.models.kv_specs import model_kv_layer_specs  # noqa: E402
from hybridserve.models.loaders.loader import load_model  # noqa: E402
from hybridserve.models.layers.rope import RopeTable  # noqa: E402
from tests.helpers import hf_tiny, mxfp4_pack  # noqa: E402
from tests.helpers.flat_backend import FlatBackend  # noqa: E402
from tests.helpers.torch_engine import PROMPTS, check_tokens, make_engine, model, run  # noqa: E402
from tests.helpers import spec_engine as sd  # noqa: E402

KIND = "gpt_oss"


def _raw() -> dict:
    return json.loads((hf_tiny.tiny_model_dir(KIND) / "config.json").read_text())


# -- config -------------------------------------------------------------------------
def test_config_layers_options_and_kv_specs() -> None:
    cfg = load_model_config(hf_tiny.tiny_model_dir(KIND))
    assert cfg.family == "gpt_oss" and cfg.gpt_oss is not None
    assert cfg.layer_types == (SLIDING, FULL, SLIDING, FULL) and cfg.sliding_window == 16
    opts = cfg.gpt_oss
    assert (opts.num_experts, opts.num_experts_per_tok, opts.swiglu_alpha, opts.swiglu_limit, opts.mxfp4) == (
        4, 2, 1.702, 3.0, False)
    assert cfg.qkv_bias and cfg.o_bias and not cfg.tie_word_embeddings
    rope = cfg.rope[FULL]
    assert (rope.rope_type, rope.factor, rope.original_max_position_embeddings, rope.truncate) == ("yarn", 4.0, 64,
                                                                                                    False)
    specs = model_kv_layer_specs(cfg, 16)
    assert specs["layers.0"] == SlidingWindowSpec(16, 2, 16, "float32", sliding_window=16)
    assert specs["layers.1"] == FullAttentionSpec(16, 2, 16, "float32")


def test_layer_types_alternate_without_the_list() -> None:
    raw = _raw()
    raw.pop("layer_types")
    assert parse_model_config(raw).layer_types == (SLIDING, FULL, SLIDING, FULL)


# openai/gpt-oss-20b's published config.json (its fields that shape the model; the 120b
# differs in 36 layers and 128 experts).
PUBLISHED_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64,
    "num_key_value_heads": 8, "num_hidden_layers": 24, "num_local_experts": 32, "num_experts_per_tok": 4,
    "experts_per_token": 4, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "sliding_window": 128, "swiglu_limit": 7.0,
    "rope_theta": 150000, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                           "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                           "truncate": False},
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "tie_word_embeddings": False, "vocab_size": 201088, "eos_token_id": 200002, "pad_token_id": 199999,
}


def test_published_20b_config() -> None:
    cfg = parse_model_config(PUBLISHED_20B)
    assert cfg.layer_types == (SLIDING, FULL) * 12 and cfg.sliding_window == 128
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (64, 8, 64, 2880)
    assert cfg.gpt_oss is not None and cfg.gpt_oss.mxfp4
    assert (cfg.gpt_oss.num_experts, cfg.gpt_oss.num_experts_per_tok, cfg.gpt_oss.swiglu_alpha) == (32, 4, 1.702)
    rope = cfg.rope[SLIDING]
    assert (rope.theta, rope.rope_type, rope.factor, rope.original_max_position_embeddings, rope.truncate) == (
        150000.0, "yarn", 32.0, 4096, False)


def test_sim_preset_is_the_published_120b() -> None:
    """The simulator's gpt-oss-120b-like layout has the published 120b's KV shapes, layer by
    layer (tests/entrypoints/test_simulate_cli.py runs the race detector on it: 0 violations with the
    rule, > 0 with --unsafe-optimistic-free)."""
    from hybridserve.sim.presets import get_layout

    published = dict(PUBLISHED_20B, num_hidden_layers=36, num_local_experts=128,
                     layer_types=["sliding_attention", "full_attention"] * 18)
    cfg = parse_model_config(published)
    layout = get_layout("gpt-oss-120b-like")
    assert (layout.num_layers, layout.hidden_size, layout.num_q_heads, layout.vocab_size,
            layout.max_position_embeddings) == (36, cfg.hidden_size, cfg.num_heads, cfg.vocab_size,
                                                cfg.max_position_embeddings)
    ours = list(model_kv_layer_specs(cfg, 16, "bfloat16").values())
    assert list(layout.layer_specs(16, "bfloat16").values()) == ours


@pytest.mark.parametrize("change,needle", [
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quant_method 'fp8'"),
    ({"swiglu_limit": -1.0}, "swiglu_limit"),
])
def test_bad_configs_raise(change: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        parse_model_config(dict(_raw(), **change))


def test_yarn_tables_equal_hf() -> None:
    """Frequencies and the cos / sin scale against HF's own YaRN (its rotary module)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    hf_rope = GptOssRotaryEmbedding(hf_tiny.hf_config(KIND))
    assert hf_rope.attention_scaling == pytest.approx(1 + 0.1 * math.log(4.0))  # YaRN's mscale at factor 4
    pos = torch.arange(200)
    with torch.no_grad():
        want_cos, want_sin = hf_rope(torch.zeros(1, dtype=torch.float32), pos[None])
    table = RopeTable(load_model_config(hf_tiny.tiny_model_dir(KIND)).rope[FULL], 16, 200, torch.device("cpu"),
                      torch.float32)
    assert torch.equal(table.inv_freq, hf_rope.inv_freq)
    cos, sin = table.lookup(pos, 199)
    assert torch.equal(cos[:, 0, :8], want_cos[0]) and torch.equal(sin[:, 0, 8:], want_sin[0])


# -- sinks: a case worked by hand ----------------------------------------------------
def _hand_case_attention(window: int | None) -> tuple[list[list[float]], list[list[float]]]:
    """One head dim, scale 1, q = 1 everywhere, keys 0, ln 2, ln 4 (exp: 1, 2, 4), values 6,
    12, 30; a prefill of 2 tokens, then a decode of the third. Head 0's sink is ln 3 (adds
    3 to each denominator), head 1's is 0 (adds 1); both heads read the one KV head."""
    keys, vals = [0.0, math.log(2.0), math.log(4.0)], [6.0, 12.0, 30.0]
    sinks = torch.tensor([math.log(3.0), 0.0])
    cache = torch.zeros(2, 16, 2, 1, 1)
    tables = BlockTables(1)
    row = tables.alloc_row()
    tables.append(0, row, [1])
    out = []
    for start, count in ((0, 2), (2, 1)):
        q = torch.ones(count, 2, 1)
        kv = torch.tensor([[[[keys[p]]], [[vals[p]]]] for p in range(start, start + count)])
        step = StepAttention([(0, cache)], [window], tables, 16, np.array([row]), np.array([start]),
                             np.array([count]), 1.0, None, torch.device("cpu"), torch.float32)
        out += step.attention(0, q, kv, sinks=sinks).tolist()
    plain = StepAttention([(0, cache)], [window], tables, 16, np.array([row]), np.array([2]), np.array([1]), 1.0,
                          None, torch.device("cpu"), torch.float32)
    return out, plain.attention(0, torch.ones(1, 2, 1), torch.tensor([[[[keys[2]]], [[vals[2]]]]])).tolist()


def test_sinks_enlarge_the_denominator_only_hand_worked() -> None:
    got, plain = _hand_case_attention(window=None)
    # Position 0: 6 * 1 / (1 + 3) = 1.5 and 6 / (1 + 1) = 3. Position 1: (6 + 24) / (3 + 3) = 5
    # and 30 / (3 + 1) = 7.5. Position 2: (6 + 24 + 120) / (7 + 3) = 15 and 150 / 8 = 18.75.
    want = [[1.5, 3.0], [5.0, 7.5], [15.0, 18.75]]
    assert np.allclose(got, want, rtol=1e-6, atol=0)
    assert np.allclose(plain, [[150 / 7, 150 / 7]], rtol=1e-6)  # no sinks: the plain softmax


def test_sinks_with_a_sliding_window_hand_worked() -> None:
    got, _ = _hand_case_attention(window=2)
    # Position 2 sees keys 1 and 2 only: (24 + 120) / (6 + 3) = 16 and 144 / 7.
    assert np.allclose(got[2], [16.0, 144 / 7], rtol=1e-6, atol=0)


# -- the model against HF -------------------------------------------------------------
def test_logits_match_hf() -> None:
    prompt = PROMPTS[3]
    with torch.no_grad():
        want = hf_tiny.hf_model(KIND)(torch.tensor([prompt])).logits[0]
    m = model(KIND)
    assert isinstance(m, GptOssLM)
    backend = FlatBackend(m.cfg, 1)
    pos = backend.step([len(prompt)])
    with torch.inference_mode():
        got = m.logits(m(torch.tensor(prompt), pos, int(pos.max()), backend))
    # float32 both, summed in other orders through the layers (oneDNN's blocked GEMMs, HF's):
    # measured 1.7e-5 of the largest logit with AVX-512, 1.8e-5 as on AVX2 alone
    assert (got - want).abs().max().item() < 4e-5 * want.abs().max().item()


def test_greedy_with_three_steps_in_flight() -> None:
    """Sync and two steps in flight run in tests/executor/test_torch_engine.py with every kind."""
    eng = make_engine(KIND, async_scheduling=True, max_concurrent_batches=3)
    try:
        got = run(eng, PROMPTS)
    finally:
        eng.shutdown()
    check_tokens(KIND, PROMPTS, got)


@dataclass(frozen=True)
class KnownAnswerDrafter(NgramDrafter):
    """Proposes each request's known greedy continuation with its second draft made wrong:
    the random tiny model never continues an n-gram the way the text did, so plain n-gram
    lookups are all rejected; this drafter makes steps that accept one draft and reject the
    next, through the same verification."""

    answers: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()

    def propose(self, token_ids: list[int], num_drafts: int) -> list[int]:
        for prompt, answer in self.answers:
            if tuple(token_ids[: len(prompt)]) == prompt:
                drafts = list(answer[len(token_ids) - len(prompt) :][:num_drafts])
                if len(drafts) > 1:
                    drafts[1] = (drafts[1] + 1) % 256
                return drafts
        return []


@pytest.mark.parametrize("async_scheduling,spec", [(False, 2), (True, 4)], ids=["sync2", "async4"])
def test_ngram_drafts_with_rejections(async_scheduling: bool, spec: int) -> None:
    eng = sd.make_engine(KIND, async_scheduling=async_scheduling, spec=spec, drafter=NgramDrafter(1, 3))
    got = sd.run(eng, sd.prompts_for(KIND))
    sd.check_hf(KIND, got)
    st = eng.scheduler.stats
    assert st.num_draft_tokens > 10 and st.num_accepted_tokens < st.num_draft_tokens


@pytest.mark.parametrize("async_scheduling,spec", [(False, 2), (True, 4)], ids=["sync2", "async4"])
def test_drafts_accepted_then_rejected(async_scheduling: bool, spec: int) -> None:
    prompts = sd.prompts_for(KIND)
    answers = tuple((tuple(p), tuple(hf_tiny.oracle(KIND, p, sd.NEW_TOKENS)[0])) for p in prompts)
    eng = sd.make_engine(KIND, async_scheduling=async_scheduling, spec=spec, drafter=KnownAnswerDrafter(answers=answers))
    got = sd.run(eng, prompts)
    sd.check_hf(KIND, got)
    sd.check_stats(eng)  # drafts both accepted and rejected


# -- MXFP4 expert weights -----------------------------------------------------------
def _twins(root: Path) -> tuple[Path, Path]:
    """The tiny model with expert weights that MXFP4 holds exactly, saved twice: as floats
    (HF's layout, [E, in, out], gate and up alternating) and packed as the published
    checkpoints store them (`_blocks` / `_scales`, rows = outputs), config saying mxfp4."""
    from safetensors.torch import load_file, save_file

    src = hf_tiny.tiny_model_dir(KIND)
    plain, packed = root / "plain", root / "mxfp4"
    for d in (plain, packed):
        shutil.copytree(src, d)
    tensors = load_file(str(src / "model.safetensors"))
    float_twin, packed_twin = dict(tensors), dict(tensors)
    gen = torch.Generator().manual_seed(5)
    for name, t in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        E, n_in, n_out = t.shape
        codes, exps = mxfp4_pack.random_codes((E, n_out, n_in), gen, exponents=(-5, -3))
        blocks, scales = mxfp4_pack.pack(codes, exps)
        float_twin[name] = mxfp4_pack.values(codes, exps).transpose(1, 2).contiguous()
        del packed_twin[name]
        packed_twin[name + "_blocks"], packed_twin[name + "_scales"] = blocks, scales
    save_file(float_twin, str(plain / "model.safetensors"), metadata={"format": "pt"})
    save_file(packed_twin, str(packed / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (packed / "config.json").write_text(json.dumps(config))
    return plain, packed


def test_mxfp4_checkpoint_loads_to_its_dequantized_twin(tmp_path: Path) -> None:
    plain, packed = _twins(tmp_path)
    assert load_model_config(packed).gpt_oss.mxfp4  # type: ignore[union-attr]
    a, b = load_model(plain), load_model(packed)
    for ea, eb in zip(a.experts.values(), b.experts.values()):  # type: ignore[union-attr]
        assert torch.equal(ea.gate_up, eb.gate_up) and torch.equal(ea.down, eb.down)
    prompt = PROMPTS[1]
    hf = hf_tiny.load_hf(plain)
    want, _ = hf_tiny.hf_greedy(hf, prompt, 12)
    for m in (a, b):
        backend = FlatBackend(m.cfg, 1)
        tokens = list(prompt)
        with torch.inference_mode():
            pos = backend.step([len(tokens)])
            h = m(torch.tensor(tokens), pos, int(pos.max()), backend)
            for _ in range(12):
                tokens.append(m.greedy_tokens(h[-1:])[0])
                pos = backend.step([1])
                h = m(torch.tensor(tokens[-1:]), pos, int(pos.max()), backend)
        assert tokens[len(prompt):] == want
