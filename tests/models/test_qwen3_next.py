"""Qwen3-Next beyond the recurrent matrices (tests/helpers/hf_tiny_mamba.py KINDS runs it
through test_mamba, offload, spec decode, prompt logprobs, PP and TP against HF): the
published 80B-A3B config parsed, its state memory derived by hand, bad configs refused,
and the chunked delta rule equal to the token-by-token recurrence it replaces.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from hybridserve.core.errors import ConfigError  # noqa: E402
from hybridserve.core.kv.spec import (FullAttentionSpec, MambaSpec, WindowTail, blocks_per_request,  # noqa: E402
                                      bytes_per_block, group_layers, with_mamba_checkpoints)
from hybridserve.models.arch.gated_deltanet import delta_rule_scan  # noqa: E402
from hybridserve.models.config import FULL, LINEAR, parse_model_config  # noqa: E402
from hybridserve.models.kv_specs import model_kv_layer_specs  # noqa: E402
from hybridserve.sim.presets import get_layout  # noqa: E402

# Qwen/Qwen3-Next-80B-A3B-Instruct config.json (the fields that shape the model).
QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "decoder_sparse_step": 1,
    "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
    "mlp_only_layers": [], "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16,
    "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48, "num_key_value_heads": 2,
    "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_theta": 10000000,
    "shared_expert_intermediate_size": 512, "tie_word_embeddings": False, "vocab_size": 151936,
}


def test_the_published_80b_config() -> None:
    cfg = parse_model_config(QWEN3_NEXT_80B)
    assert cfg.layer_types == (LINEAR, LINEAR, LINEAR, FULL) * 12
    assert cfg.rotary_dim == 64 and cfg.rope[FULL].theta == 1e7 and cfg.gemma_norm and cfg.qk_norm
    g, moe = cfg.gated_deltanet, cfg.qwen3_next_moe
    assert g is not None and moe is not None
    # q|k|v channels 2 * 16 * 128 + 32 * 128; in_proj adds z (32 * 128) and b, a (32 each).
    assert (g.conv_dim, g.in_proj_size) == (8192, 8192 + 4096 + 64)
    assert (moe.num_experts, moe.top_k, moe.moe_intermediate_size, moe.shared_intermediate_size) == (512, 10, 512, 512)
    assert moe.dense_layers == frozenset()
    specs = model_kv_layer_specs(cfg, 16, "bfloat16")
    assert specs["layers.0"] == MambaSpec(16, ((8192, 3), (32, 128, 128)), "bfloat16")
    assert specs["layers.3"] == FullAttentionSpec(16, 2, 256, "bfloat16")
    # The simulator's preset is the same model.
    preset = get_layout("qwen3-next-80b-like").layer_specs(16, "bfloat16")
    assert sorted(preset.values(), key=repr) == sorted(specs.values(), key=repr)


@pytest.mark.parametrize("steps", [1, 2], ids=["sync", "async"])
@pytest.mark.parametrize("length,bytes_per_token", [(8192, 29_472), (131_072, 24_882)], ids=["8k", "128k"])
def test_state_memory_per_token_by_hand(steps: int, length: int, bytes_per_token: int) -> None:
    """bf16, blocks of 16. An attention page: 2 (K, V) * 16 tokens * 2 KV heads * 256 * 2 B
    = 32768 B. A Gated DeltaNet state: (8192 * 3 + 32 * 128 * 128) * 2 B = 1,097,728 B, cut
    into cdiv(1097728, 32768) = 34 pages. Groups of 12 layers (12 attention, 36 linear):
    1 attention group + 3 * 34 page groups; a block costs 12 * 32768 = 393,216 B. A request
    of L tokens holds L / 16 attention blocks and one block per page group (the running
    state in place, whatever the steps in flight), 102:
        8k:   (512 + 102) * 393216 / 8192   = 29,472 B/token
        128k: (8192 + 102) * 393216 / 131072 = 24,882 B/token
    against a need of 12 * 2048 B/token of K/V + 36 states: 29,400 and 24,878 (page padding)."""
    specs = model_kv_layer_specs(parse_model_config(QWEN3_NEXT_80B), 16, "bfloat16")
    groups = with_mamba_checkpoints(group_layers(specs), WindowTail(steps, 0))
    assert bytes_per_block(groups) == 393_216
    total = bytes_per_block(groups) * blocks_per_request(groups, steps * 8192, length)
    assert total == bytes_per_token * length
    need = 12 * 2048 * length + 36 * 1_097_728
    assert 1.0 < total / need < 1.003


def _raw(**changes: object) -> dict:
    raw = dict(QWEN3_NEXT_80B)
    raw.update(changes)
    return raw


@pytest.mark.parametrize("change,needle", [
    ({"linear_num_value_heads": 24}, "linear_num_value_heads 24 is not a multiple of linear_num_key_heads 16"),
    ({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim must be >= 2"),
    ({"linear_key_head_dim": 0}, "linear_key_head_dim must be a positive integer"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"layer_types": ["linear_attention"] * 47 + ["mamba"]}, r"unsupported layer type\(s\) \['mamba'\]"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types has 3 entries for 48 layers"),
    ({"mlp_only_layers": [48]}, "mlp_only_layers"),
    ({"num_experts_per_tok": 600}, "num_experts_per_tok 600 exceeds num_experts 512"),
    ({"partial_rotary_factor": 0.001}, "partial_rotary_factor"),
])
def test_bad_configs_raise(change: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        parse_model_config(json.loads(json.dumps(_raw(**change))))


def test_mlp_only_and_sparse_step_pick_the_dense_layers() -> None:
    moe = parse_model_config(_raw(num_hidden_layers=8, mlp_only_layers=[0], decoder_sparse_step=2)).qwen3_next_moe
    assert moe is not None and moe.dense_layers == frozenset({0, 2, 4, 6})


def _token_by_token(q, k, v, g, beta, state):  # type: ignore[no-untyped-def]
    """The gated delta rule as written, one token at a time (float64)."""
    s, out, states = state.clone(), [], []
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", s, k[t]))
        s = s + k[t][:, :, None] * u[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", s, q[t]))
        states.append(s)
    return torch.stack(out), states


@pytest.mark.parametrize("length,chunk,save_at", [(50, 16, ()), (37, 64, (5, 21)), (70, 8, (16, 32, 48, 64)),
                                                  (3, 64, (1, 2))])
def test_chunked_delta_rule_equals_the_recurrence(length: int, chunk: int, save_at: tuple[int, ...]) -> None:
    g_ = torch.Generator().manual_seed(length)
    H, dk, dv = 3, 8, 4
    q = torch.nn.functional.normalize(torch.randn(length, H, dk, generator=g_), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(length, H, dk, generator=g_), dim=-1)
    v = torch.randn(length, H, dv, generator=g_)
    g = -torch.rand(length, H, generator=g_) * 2
    beta = torch.rand(length, H, generator=g_)
    start = torch.randn(H, dk, dv, generator=g_)
    want, states = _token_by_token(*(t.double() for t in (q, k, v, g, beta, start)))
    state = start.clone()
    got, saved = delta_rule_scan(q, k, v, g, beta, state, chunk, list(save_at))
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.double(), states[-1], atol=1e-5, rtol=1e-5)
    for j, kept in zip(save_at, saved, strict=True):  # the state after j tokens
        torch.testing.assert_close(kept.double(), states[j - 1], atol=1e-5, rtol=1e-5)


# -- Qwen3_5ForCausalLM: the same layers, a dense MLP in each ---------------------------------
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_qwen3_5_greedy_and_prefix_hits_match_hf(async_scheduling: bool) -> None:
    """Its separate in_proj_qkv / z / b / a and dense MLPs: HF's tokens and logprobs, prefills
    in chunks of 24, then a second wave that starts from checkpointed states."""
    from tests.helpers.mamba_engine import BS, NEW_TOKENS, PROMPTS, check, make_engine, model, run

    assert model("qwen3_5").cfg.qwen3_next_moe.dense_layers == frozenset(range(4))  # type: ignore[union-attr]
    eng = make_engine("qwen3_5", async_scheduling=async_scheduling, max_num_batched_tokens=24)
    first = run(eng, PROMPTS[:2], tag="a", shutdown=False, logprobs=0)
    check("qwen3_5", PROMPTS[:2], first, tag="a")
    turn2 = [PROMPTS[0] + first["a0"][0] + [5, 6, 7]]
    got = run(eng, turn2, tag="b")
    check("qwen3_5", turn2, got, tag="b")
    assert got["b0"][2] == (len(PROMPTS[0]) + NEW_TOKENS - 1) // BS * BS
