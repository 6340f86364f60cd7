"""Logits controls (allowed tokens, bad words, logit bias, repetition / frequency /
presence penalties): greedy token streams equal Hugging Face generate with its own
logits processors, sync and async, with and without speculative decoding."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import LogitsProcessor, LogitsProcessorList  # noqa: E402

from tests.helpers import hf_tiny  # noqa: E402
from tests.helpers.serving_models import tiny_serving_dir  # noqa: E402

from hybridserve import LLM, SamplingParams  # noqa: E402
from hybridserve.core.errors import RequestError  # noqa: E402

MAX_LEN = 256
NEW = 16
# Repetitive prompts, so penalties and bad words change greedy outputs.
PROMPTS = [[2, 10, 11, 12, 10, 11, 12, 10, 11], [2, 40, 41, 40, 41, 40], [2, 100, 7, 100, 7, 8, 9]]


class OutputPenalties(LogitsProcessor):
    """The OpenAI frequency/presence penalties over generated tokens, written here
    independently of hybridserve as the test's oracle."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        out = input_ids[0, self.prompt_len:]
        counts = torch.zeros(scores.shape[-1])
        for t in out.tolist():
            counts[t] += 1
        return scores - self.frequency * counts - self.presence * (counts > 0).float()


class OnlyAllowed(LogitsProcessor):
    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        out = torch.full_like(scores, float("-inf"))
        out[:, self.allowed] = scores[:, self.allowed]
        return out


@pytest.fixture(scope="module")
def hf_model():
    return hf_tiny.load_hf(tiny_serving_dir())


def hf_greedy(model, prompt: list[int], **kwargs) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0,
                             eos_token_id=None, **kwargs)
    return out[0, len(prompt):].tolist()


CASES = {
    "repetition": (dict(repetition_penalty=1.6), lambda p: dict(repetition_penalty=1.6)),
    "repetition_below_1": (dict(repetition_penalty=0.7), lambda p: dict(repetition_penalty=0.7)),
    "frequency": (dict(frequency_penalty=1.5),
                  lambda p: dict(logits_processor=LogitsProcessorList([OutputPenalties(len(p), 1.5, 0.0)]))),
    "presence": (dict(presence_penalty=2.0),
                 lambda p: dict(logits_processor=LogitsProcessorList([OutputPenalties(len(p), 0.0, 2.0)]))),
    # HF applies its built-in repetition penalty before processors passed in: the same order.
    "all_penalties": (dict(repetition_penalty=1.3, frequency_penalty=0.8, presence_penalty=-0.5),
                      lambda p: dict(repetition_penalty=1.3,
                                     logits_processor=LogitsProcessorList([OutputPenalties(len(p), 0.8, -0.5)]))),
    "logit_bias": (dict(logit_bias={30: 8.0, 31: 6.5, 12: -100.0}),
                   lambda p: dict(sequence_bias={(30,): 8.0, (31,): 6.5, (12,): -100.0})),
    # Pairs and a single token that the plain greedy outputs of PROMPTS contain.
    "bad_words": (dict(bad_words_token_ids=((31, 54), (220, 187), (170,))),
                  lambda p: dict(bad_words_ids=[[31, 54], [220, 187], [170]])),
    "allowed": (dict(allowed_token_ids=tuple(range(20, 60))),
                lambda p: dict(logits_processor=LogitsProcessorList([OnlyAllowed(list(range(20, 60)))]))),
}


@pytest.fixture(scope="module", params=["sync", "async", "async_spec"])
def llm(request):
    kwargs = dict(async_scheduling=request.param != "sync", dtype="float32")  # HF's oracle is float32
    if request.param == "async_spec":
        kwargs.update(num_speculative_tokens=3)
    engine = LLM(str(tiny_serving_dir()), max_model_len=MAX_LEN, progress=False, **kwargs)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_outputs(hf_model) -> dict:
    """HF's outputs per (case, prompt), computed once for all engine modes."""
    cache: dict = {}

    def get(case: str, i: int) -> list[int]:
        if (case, i) not in cache:
            cache[case, i] = hf_greedy(hf_model, PROMPTS[i], **CASES[case][1](PROMPTS[i]))
        return cache[case, i]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_hf_with_the_same_controls(llm: LLM, hf_outputs, case: str) -> None:
    ours, _ = CASES[case]
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True, **ours), use_tqdm=False)
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    changed = 0
    for i, (out, base) in enumerate(zip(outs, plain)):
        assert out.token_ids == hf_outputs(case, i), (case, PROMPTS[i])
        changed += out.token_ids != base.token_ids
    assert changed >= 1, f"{case} changed no output: the test would not notice a missing control"


def test_controls_hold_for_sampled_outputs_too(llm: LLM) -> None:
    allowed = tuple(range(50, 58))
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=1.0, seed=3, ignore_eos=True,
                                                allowed_token_ids=allowed, logit_bias={57: -100.0}), use_tqdm=False)
    for out in outs:
        assert set(out.token_ids) <= set(allowed) - {57}


def test_bad_words_as_text_ban_both_spellings(llm: LLM) -> None:
    text = llm.generate(["the cat sat on a mat"], SamplingParams(max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    word = text[0].text.split()[0]
    banned = llm.generate(["the cat sat on a mat"], SamplingParams(max_tokens=NEW, ignore_eos=True, bad_words=[word]),
                          use_tqdm=False)
    assert word not in banned[0].text.split()


@pytest.mark.parametrize("params, param", [
    (dict(logit_bias={999: 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[5, 300]), "allowed_token_ids"),
    (dict(bad_words_token_ids=[[5, 256]]), "bad_words"),
])
def test_token_ids_past_the_vocabulary_are_refused(llm: LLM, params: dict, param: str) -> None:
    with pytest.raises(RequestError, match="outside the vocabulary") as info:
        llm.generate([[10, 11]], SamplingParams(**params), use_tqdm=False)
    assert info.value.param == param
