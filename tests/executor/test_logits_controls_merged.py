"""Logit bias and the repetition / frequency / presence penalties share one read and one
write of the entries any of them names (executor/torch/logits_controls.py): each entry ends
as the controls applied in turn would leave it, worked out by hand here, on logits held
dense and in pieces, the sign of a zero included."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridserve.core.request import SamplingParams  # noqa: E402
from hybridserve.executor.torch.logits_controls import TokenHistory, apply_logits_controls  # noqa: E402
from hybridserve.models.layers.span_logits import SPAN, LogitsBuffer, SpanLogits  # noqa: E402

VOCAB = 2 * SPAN  # two spans; held in pieces, one span each


def _logits(pieces: bool) -> SpanLogits:
    x = torch.zeros(2, VOCAB)
    x[0, 3], x[0, 5], x[0, 7], x[0, SPAN + 1] = 1.0, -1.0, 0.5, 4.0
    x[0, 9] = -0.0
    x[1, 3] = 1.0
    span = torch.zeros(2, 2)
    common = dict(vocab_size=VOCAB, inv_temperature=torch.ones(2), span_max=span, span_sum=span.clone(),
                  buffer=LogitsBuffer(VOCAB))
    if pieces:
        return SpanLogits(**common, pieces=[x[:, :SPAN].clone(), x[:, SPAN:].clone()])
    return SpanLogits(**common, padded=x.clone())


@pytest.mark.parametrize("pieces", [False, True])
def test_bias_then_repetition_then_output_penalties_by_hand(pieces: bool) -> None:
    """Row 0: prompt [3, 9], outputs [5, 5, SPAN + 1]; bias +2 on 3, -1 on 7; repetition 2;
    frequency 0.5, presence 0.25.
      3:  1.0 + 2 = 3.0, > 0 so / 2 = 1.5 (a prompt token: no output penalty)
      5: -1.0, <= 0 so * 2 = -2.0, then - (0.5 * 2 + 0.25) = -3.25
      7:  0.5 - 1 = -0.5 (named by the bias alone)
      9: -0.0 * 2 = -0.0 (the repetition alone: its sign kept)
      SPAN + 1: 4.0 / 2 = 2.0, then - (0.5 + 0.25) = 1.25 (in the second piece)
    Row 1 asks for nothing: untouched."""
    sl = _logits(pieces)
    params = SamplingParams(temperature=1.0, logit_bias={3: 2.0, 7: -1.0}, repetition_penalty=2.0,
                            frequency_penalty=0.5, presence_penalty=0.25)
    history = TokenHistory(tokens=[3, 9, 5, 5, SPAN + 1], num_prompt=2)
    changes, failed = apply_logits_controls(sl, [(0, params, history)])
    assert failed == {}
    got = sl.at(torch.tensor([0, 0, 0, 0, 0, 1]), torch.tensor([3, 5, 7, 9, SPAN + 1, 3]))
    assert got.tolist() == [1.5, -3.25, -0.5, -0.0, 1.25, 1.0]
    assert bool(torch.signbit(got[3]))
    assert set(zip(changes.rows.tolist(), changes.ids.tolist())) == {(0, 3), (0, 5), (0, 7), (0, 9), (0, SPAN + 1)}
