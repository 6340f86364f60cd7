"""Cohere2's attention by hand: its full layers have no RoPE, its sliding layers do.

One-head, 4-dim layers whose weights are set so the expected output is arithmetic on paper:
q = k = c = [3, 0, 3, 0] for every token (biases only), v = the normed input, o = identity
and a zero MLP, with embeddings of mean 0 and variance 1 (the LayerNorm leaves them as they
are). Then a layer's output at position p is e_p + sum_j a_pj e_j, with a_pj the softmax of
0.5 * q_p . k_j over the positions p reads.

- Without RoPE every score is 0.5 * |c|^2 = 9: the full layer averages e_0..e_p evenly.
- With RoPE (theta 10000, head_dim 4) q_p . k_j = 18 cos(p - j) (c lies in the first
  frequency's pair of dims 0 and 2, angle 1 per position), so a sliding layer of window 2
  weighs e_{p-1} and e_p by the softmax of (9 cos 1, 9).
The expected values below are computed from these formulas, not with the model.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from hybridserve.models.arch.cohere2 import Cohere2LM  # noqa: E402
from hybridserve.models.config import FULL, SLIDING, ModelConfig, RopeConfig  # noqa: E402
from hybridserve.models.parallel import PipelineStage  # noqa: E402
from tests.helpers.flat_backend import FlatBackend  # noqa: E402

EMBED = [[1.0, -1.0, 1.0, -1.0], [1.0, 1.0, -1.0, -1.0], [1.0, -1.0, -1.0, 1.0], [-1.0, 1.0, 1.0, -1.0]]
IDS = [0, 1, 2, 3, 1, 0]


def first_layer_output(first_layer: str) -> list[list[float]]:
    """The residual stream after layer 0 (pipeline stage 0 of 2: no final norm after it)."""
    cfg = ModelConfig(
        architecture="Cohere2ForCausalLM", family="cohere2", vocab_size=4, hidden_size=4, intermediate_size=1,
        num_layers=2, num_heads=1, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-12, activation="silu",
        layer_types=(first_layer, FULL if first_layer == SLIDING else SLIDING), sliding_window=2,
        rope={SLIDING: RopeConfig(theta=10000.0)}, max_position_embeddings=64, qkv_bias=True, o_bias=True,
        parallel_block=True, attn_scale=0.5,
    )
    model = Cohere2LM(cfg, stage=PipelineStage(rank=0, size=2))
    layer = model.layers[0]
    with torch.no_grad():
        model.embed.data = torch.tensor(EMBED)
        layer.input_norm.fill_(1.0)
        layer.qkv.zero_()
        layer.qkv[8:12] = torch.eye(4)  # v = the normed input
        layer.qkv_bias.copy_(torch.tensor([3.0, 0.0, 3.0, 0.0] * 2 + [0.0] * 4))  # q = k = c
        layer.o.copy_(torch.eye(4))
        layer.o_bias.zero_()
        layer.gate_up.zero_()
        layer.down.zero_()
    model.setup_rope(device=torch.device("cpu"), max_positions=64)
    backend = FlatBackend(cfg, num_requests=1)
    positions = backend.step([len(IDS)])
    with torch.inference_mode():
        out = model(torch.tensor(IDS), positions, max_position=len(IDS) - 1, backend=backend)
    return out.tolist()


def test_full_layer_attends_evenly_without_rope() -> None:
    got = first_layer_output(FULL)
    for p, row in enumerate(got):
        seen = [EMBED[t] for t in IDS[: p + 1]]
        want = [EMBED[IDS[p]][d] + sum(e[d] for e in seen) / len(seen) for d in range(4)]
        assert row == pytest.approx(want, abs=1e-5), p


def test_sliding_layer_rotates_q_and_k() -> None:
    got = first_layer_output(SLIDING)
    earlier = math.exp(9.0 * math.cos(1.0)) / (math.exp(9.0 * math.cos(1.0)) + math.exp(9.0))
    for p, row in enumerate(got):
        e = EMBED[IDS[p]]
        if p == 0:
            want = [2.0 * x for x in e]
        else:
            before = EMBED[IDS[p - 1]]
            want = [e[d] + earlier * before[d] + (1.0 - earlier) * e[d] for d in range(4)]
        assert row == pytest.approx(want, abs=1e-5), p
