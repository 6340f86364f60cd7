"""Equal-length first chunks in one step (a burst of equal prompts): attention computes them
as a view of the flat rows with SDPA's own causal form where that is the whole mask, and
gives what each sequence computed alone gives, and HF's greedy tokens end to end
(executor/torch/attention.py: _padded, _key_plan)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hybridserve.executor.torch.attention import StepAttention  # noqa: E402
from hybridserve.executor.torch.requests import BlockTables  # noqa: E402
from tests.helpers import hf_tiny  # noqa: E402
from tests.helpers.torch_engine import NEW_TOKENS, check_tokens, make_engine, run  # noqa: E402

BS, HEADS, KV_HEADS, DIM = 4, 2, 1, 8
LENGTH = 20  # past SMALL_CHUNK: before, such a batch went through the padded gather
WINDOWS = [None, 8, 32]  # full attention, a window shorter than the chunk, one longer


def _step(seqs: list[int], cache: torch.Tensor, tables: BlockTables) -> StepAttention:
    n = len(seqs)
    return StepAttention([(g, cache[g]) for g in range(len(WINDOWS))], WINDOWS, tables, BS, np.array(seqs),
                         np.zeros(n, dtype=np.int64), np.full(n, LENGTH), DIM ** -0.5, None, torch.device("cpu"),
                         torch.float32)


def test_equal_first_chunks_equal_each_sequence_alone() -> None:
    seqs = 3
    blocks = LENGTH // BS
    tables = BlockTables(len(WINDOWS))
    for grp in range(len(WINDOWS)):  # distinct real blocks per sequence and group
        for s in range(seqs):
            first = 1 + (grp * seqs + s) * blocks
            tables.table[grp, s, :blocks] = np.arange(first, first + blocks)
            tables.lengths[grp, s] = blocks
    g = torch.Generator().manual_seed(3)
    q = torch.randn(seqs * LENGTH, HEADS, DIM, generator=g)
    kv = torch.randn(seqs * LENGTH, 2, KV_HEADS, DIM, generator=g)
    cache = torch.zeros(len(WINDOWS), 1 + len(WINDOWS) * seqs * blocks, BS, 2, KV_HEADS, DIM)
    step = _step(list(range(seqs)), cache, tables)
    assert [b.row_slice for b in step.batches] == [(0, seqs * LENGTH)]
    # Causal within the window is all the mask says for the full group and the wide window.
    assert [gp.plans[0].mask is None for gp in step.groups] == [True, False, True]
    for layer in range(len(WINDOWS)):
        together = step.attention(layer, q, kv)
        for s in range(seqs):
            rows = slice(s * LENGTH, (s + 1) * LENGTH)
            alone = _step([s], cache, tables).attention(layer, q[rows], kv[rows])
            assert torch.allclose(together[rows], alone, rtol=1e-6, atol=1e-6), (layer, s)


@pytest.mark.parametrize("kind", ["gemma3", "mistral"])
def test_equal_prompts_in_one_step_give_hf_greedy_tokens(kind: str) -> None:
    prompts = hf_tiny.random_prompts(4, 37, 37, seed=11)
    got = run(make_engine(kind, async_scheduling=False, prefix_caching=False), prompts)
    assert all(len(got[f"r{i}"][0]) == NEW_TOKENS for i in range(len(prompts)))
    check_tokens(kind, prompts, got)
