"""The blocking Python API on a tiny hybrid model, checked against HF transformers' greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.helpers import hf_tiny  # noqa: E402
from tests.helpers.hand_clock import HandClock, wait_until  # noqa: E402
from tests.helpers.serving_models import PROMPTS, tiny_serving_dir, vocabulary  # noqa: E402

from hybridserve import LLM, SamplingParams  # noqa: E402
from hybridserve.core.errors import ConfigError, RequestError  # noqa: E402

EOS = 1
MAX_LEN = 256


@pytest.fixture(scope="module")
def llm() -> LLM:
    engine = LLM(str(tiny_serving_dir()), max_model_len=MAX_LEN, dtype="float32", progress=False)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_model():
    return hf_tiny.load_hf(tiny_serving_dir())


def words(token_ids: list[int]) -> str:
    vocab = vocabulary()
    return "".join(f" {vocab[t]}" for t in token_ids if t >= 7)


def test_greedy_matches_hf_in_input_order(llm: LLM, hf_model) -> None:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12), use_tqdm=False)
    assert [o.prompt for o in outs] == PROMPTS
    stopped = 0
    for o in outs:
        assert o.prompt_token_ids == llm.tokenizer.encode(o.prompt)
        want, _ = hf_tiny.hf_greedy(hf_model, o.prompt_token_ids, 12)
        if o.finish_reason == "stop":  # EOS: HF (no eos set) continues past it
            stopped += 1
            assert o.token_ids == want[: want.index(EOS) + 1]
        else:
            assert o.finish_reason == "length" and o.token_ids == want
        assert o.text == words(o.token_ids)  # EOS is a special token: not in the text
    assert stopped >= 1  # this model ends at least one of these prompts with EOS


def test_token_id_prompts_give_the_same_result_as_text(llm: LLM) -> None:
    ids = llm.tokenizer.encode(PROMPTS[1])
    by_ids, by_text = llm.generate([ids, PROMPTS[1]], SamplingParams(max_tokens=8), use_tqdm=False)
    assert by_ids.prompt is None and by_ids.prompt_token_ids == ids
    assert by_ids.token_ids == by_text.token_ids and by_ids.text == by_text.text
    single = llm.generate(ids, SamplingParams(max_tokens=8), use_tqdm=False)
    assert len(single) == 1 and single[0].token_ids == by_ids.token_ids


def test_stop_string_truncates_text_and_ends_the_request(llm: LLM) -> None:
    full = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12), use_tqdm=False)[0]
    stop_word = full.text.split()[3]
    cut = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, stop=[stop_word]), use_tqdm=False)[0]
    assert cut.finish_reason == "stop" and cut.outputs[0].stop_reason == stop_word
    assert cut.text == full.text[: full.text.index(stop_word)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)] and len(cut.token_ids) < 12


def test_n_choices_use_seed_plus_index_and_ignore_batch_company(llm: LLM) -> None:
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=11, n=3)
    together = llm.generate(PROMPTS[2], p, use_tqdm=False)[0]
    assert [c.index for c in together.outputs] == [0, 1, 2]
    for i, choice in enumerate(together.outputs):
        alone = llm.generate([PROMPTS[5], PROMPTS[2]], [SamplingParams(max_tokens=10),
                                                        SamplingParams(max_tokens=10, temperature=1.0, seed=11 + i)],
                             use_tqdm=False)[1]
        assert alone.token_ids == choice.token_ids and alone.text == choice.text
    assert len({tuple(c.token_ids) for c in together.outputs}) > 1  # temperature 1 differs across seeds


def test_logprobs_of_greedy_tokens_are_the_top_ones(llm: LLM) -> None:
    out = llm.generate(PROMPTS[3], SamplingParams(max_tokens=6, logprobs=2), use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 6
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and len(lp.top) == 2
        assert lp.top[0] == (tok, pytest.approx(lp.logprob)) and lp.top[0][1] >= lp.top[1][1]
        assert lp.logprob <= 0.0


def test_max_tokens_is_capped_by_max_model_len(llm: LLM) -> None:
    prompt = [10] * (MAX_LEN - 6)
    out = llm.generate(prompt, SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6


@pytest.mark.parametrize("prompt, pattern", [
    ([10] * MAX_LEN, r"prompt 0: the prompt has 256 tokens, but max_model_len=256 allows at most 255"),
    ([10, 999], r"prompt 0: token id 999 is outside the vocabulary \(0..255\)"),
    ([], r"prompt 0: the prompt is empty"),
    ("ab\ud800", r"prompt 0: prompt is not valid Unicode: a lone surrogate U\+D800 at character 2"),
])
def test_unusable_prompts_are_request_errors(llm: LLM, prompt: list[int] | str, pattern: str) -> None:
    with pytest.raises(RequestError, match=pattern):
        llm.generate([prompt], use_tqdm=False)


@pytest.mark.parametrize("params, param, pattern", [
    # The fatal request of old: an id past the 256-token vocabulary reached the sampler's
    # min_tokens mask and killed the engine.
    (dict(stop_token_ids=[99999], min_tokens=2), "stop_token_ids", r"token id 99999 is outside the vocabulary \(0..255\)"),
    (dict(stop_token_ids=[256]), "stop_token_ids", r"token id 256 is outside"),
    (dict(stop_token_ids=[2**64]), "stop_token_ids", r"token id 18446744073709551616 is outside"),
    (dict(stop_token_ids=[-1], min_tokens=1), "stop_token_ids", r"must be >= 0"),
    (dict(max_tokens=2, min_tokens=5), "min_tokens", r"^min_tokens \(5\) must be <= max_tokens \(2\)$"),
    (dict(stop_token_ids=[True]), "stop_token_ids", r"must be an integer"),
    (dict(stop_token_ids="7"), "stop_token_ids", r"must be a list of token ids"),
    (dict(temperature=float("nan")), "temperature", r"temperature must be a finite number, got nan"),
    (dict(temperature=float("inf")), "temperature", r"finite number"),
    (dict(top_p=float("nan")), "top_p", r"finite number"),
    (dict(top_p=0.0), "top_p", r"top_p must be in \(0, 1\], got 0.0"),
    (dict(min_p=1.5), "min_p", r"min_p must be in \[0, 1\]"),
    (dict(max_tokens=2.5), "max_tokens", r"max_tokens must be an integer"),
    (dict(seed="7"), "seed", r"seed must be an integer"),
])
def test_unusable_sampling_params_are_request_errors_naming_the_field(llm: LLM, params: dict, param: str,
                                                                       pattern: str) -> None:
    with pytest.raises(RequestError, match=pattern) as info:
        llm.generate([[10, 11]], SamplingParams(**params), use_tqdm=False)
    assert info.value.param == param
    # Nothing was left behind, and the engine still serves.
    assert not llm.parts.engine.has_unfinished_requests()
    assert len(llm.generate([[10, 11]], SamplingParams(max_tokens=3, min_tokens=2, stop_token_ids=[255]),
                            use_tqdm=False)[0].token_ids) == 3


def test_any_64_bit_seed_is_usable(llm: LLM) -> None:
    """Seeds wrap to 64 bits as torch's generator does: 2**64 + 5 samples like 5, and -1 like 2**64 - 1."""
    def run(seed: int) -> list[int]:
        return llm.generate([[10, 11]], SamplingParams(max_tokens=6, temperature=1.0, seed=seed),
                            use_tqdm=False)[0].token_ids

    assert run(2**64 + 5) == run(5)
    assert run(-1) == run(2**64 - 1)


def test_params_list_must_match_prompts(llm: LLM) -> None:
    with pytest.raises(RequestError, match="got 1 sampling params for 2 prompts"):
        llm.generate(PROMPTS[:2], [SamplingParams()], use_tqdm=False)


@pytest.mark.parametrize("prompts, pattern", [
    (None, r"^prompts are a string, a list of token ids, or a list of those; got NoneType$"),
    (7, r"got int$"),
    (b"cat", r"got bytes$"),  # iterated, it was three token ids
    ({"cat": 1}, r"got dict$"),  # iterated, it was the prompt "cat"
    ([b"cat"], r"^prompt 0: a prompt is a string or a list of token ids, not bytes"),
])
def test_prompts_of_another_type_are_request_errors(llm: LLM, prompts, pattern: str) -> None:
    with pytest.raises(RequestError, match=pattern):
        llm.generate(prompts, use_tqdm=False)


def test_numpy_and_torch_prompts_are_their_lists(llm: LLM) -> None:
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    want = [o.token_ids for o in llm.generate([[10, 11, 12], [13, 14]], params, use_tqdm=False)]
    assert [o.token_ids for o in llm.generate(np.array([10, 11, 12]), params, use_tqdm=False)] == want[:1]
    mixed = [np.array([10, 11, 12], dtype=np.int32), torch.tensor([13, 14])]
    assert [o.token_ids for o in llm.generate(mixed, params, use_tqdm=False)] == want


@pytest.mark.parametrize("conversations, pattern", [
    ("hi", r"^chat takes a conversation \(a list of \{'role', 'content'\} dicts\) or a list of them, got str$"),
    (5, r"got int$"),
    ([{"content": "hi"}], r"^conversation 0: message 0 is not a \{'role', 'content'\} dict with a string role$"),
    ([[{"role": "user", "content": "a"}], "b"], r"^conversation 1: a conversation is a list of .* dicts, got str$"),
])
def test_chats_of_another_shape_are_request_errors(llm: LLM, conversations, pattern: str) -> None:
    with pytest.raises(RequestError, match=pattern):
        llm.chat(conversations, use_tqdm=False)


def test_stream_deltas_add_up_to_generate_and_an_abandoned_stream_frees_its_blocks(llm: LLM) -> None:
    params = SamplingParams(max_tokens=9)
    full = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    texts = ["", "", ""]
    finished = set()
    for i, out in llm.stream(PROMPTS[:3], params):
        texts[i] += out.outputs[0].delta_text
        if out.finished:
            finished.add(i)
    assert texts == [o.text for o in full] and finished == {0, 1, 2}
    for i, _ in llm.stream(PROMPTS, SamplingParams(max_tokens=50, ignore_eos=True)):
        break  # abandon the batch after the first output
    assert not llm.parts.engine.has_unfinished_requests()
    assert llm.parts.engine.scheduler.kv.usage == 0.0


def test_progress_bar_only_when_asked(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=2), use_tqdm=False)
    assert capsys.readouterr().err == ""
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=2), use_tqdm=True)
    assert "generating" in capsys.readouterr().err


def test_chat_uses_the_template_or_the_plain_one(llm: LLM) -> None:
    conv = [{"role": "user", "content": "hello cat"}]
    templated = llm.chat(conv, SamplingParams(max_tokens=4))[0]
    assert templated.prompt == "<bos><user> hello cat <assistant>"
    assert templated.prompt_token_ids == [2, 5, 7, 10, 6]
    plain_llm = LLM(str(tiny_serving_dir(chat_template=False)), max_model_len=MAX_LEN, progress=False)
    try:
        plain = plain_llm.chat(conv, SamplingParams(max_tokens=4))[0]
    finally:
        plain_llm.shutdown()
    assert plain.prompt == "User: hello cat\nAssistant:"
    assert plain.prompt_token_ids == plain_llm.tokenizer.encode(plain.prompt)


def test_a_chat_template_file_replaces_the_plain_template(tmp_path: Path) -> None:
    from hybridserve.engine.frontend import prepare_chat

    path = str(tiny_serving_dir(chat_template=False))
    plain = LLM(path, max_model_len=MAX_LEN, progress=False)
    try:
        # Without a template a reply also stops where the model would start another turn.
        _, _, p = prepare_chat(plain.parts, [{"role": "user", "content": "hi"}], SamplingParams())
        assert p.stop == ("\nUser:", "\nAssistant:")
    finally:
        plain.shutdown()
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}<assistant>")
    templated = LLM(path, max_model_len=MAX_LEN, progress=False, chat_template=template)
    try:
        out = templated.chat([{"role": "user", "content": "hello cat"}], SamplingParams(max_tokens=3))[0]
        assert out.prompt == "[user] hello cat <assistant>"
        _, _, p = prepare_chat(templated.parts, [{"role": "user", "content": "hi"}], SamplingParams())
        assert p.stop == ()
    finally:
        templated.shutdown()
    with pytest.raises(ConfigError, match="chat_template: no such file 'nope.jinja'"):
        LLM(path, max_model_len=MAX_LEN, progress=False, chat_template="nope.jinja")


def test_a_too_small_pool_fails_before_loading_weights() -> None:
    with pytest.raises(ConfigError, match=r"num_blocks=4 is too small: .* the smallest num_blocks that works is \d+"):
        LLM(str(tiny_serving_dir()), max_model_len=MAX_LEN, num_blocks=4, progress=False)


def test_the_runner_gives_its_step_heap_back_after_a_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor reports every step to an IdleHeapRelease (models/platform/heap.py), so the C
    heap's free pages go back once steps pause, and shutdown stops its thread."""
    import hybridserve.executor.torch.executor as torch_executor
    from hybridserve.models.platform.heap import IdleHeapRelease

    made: list[IdleHeapRelease] = []
    releases: list[int] = []
    IDLE = 0.05  # the hand clock's seconds, also how long the waiter sleeps between looks
    clock = HandClock()  # stands still during generate: no gap between its steps counts as a pause

    def quick(*_args, **_kwargs) -> IdleHeapRelease:
        made.append(IdleHeapRelease(idle_s=IDLE, release=lambda: releases.append(1), clock=clock))
        return made[-1]

    monkeypatch.setattr(torch_executor, "IdleHeapRelease", quick)
    engine = LLM(str(tiny_serving_dir()), max_model_len=MAX_LEN, dtype="float32", progress=False)
    try:
        engine.generate([[10, 11]], SamplingParams(max_tokens=4), use_tqdm=False)
        assert releases == []
        clock.advance(IDLE)  # the pause after the last step
        assert wait_until(lambda: releases != [])
        assert len(made) == 1 and releases == [1]
    finally:
        engine.shutdown()
    thread = made[0]._thread
    assert thread is not None and not thread.is_alive()


def test_prompt_logprobs_match_hf_for_each_prompt_and_choice(llm: LLM, hf_model) -> None:
    params = SamplingParams(max_tokens=3, prompt_logprobs=2, n=2, temperature=1.0, seed=3)
    outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    plain = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3), use_tqdm=False)
    assert plain[0].prompt_logprobs is None  # only when asked for
    for o in outs:
        ids = o.prompt_token_ids
        want, want_top = hf_tiny.hf_prompt_logprobs(hf_model, ids, 2)
        got = o.prompt_logprobs
        assert got is not None and len(got) == len(ids) and got[0] is None
        assert [e.token_id for e in got[1:]] == ids[1:]
        assert max(abs(e.logprob - w) for e, w in zip(got[1:], want)) < 1e-4
        assert [[t for t, _ in e.top] for e in got[1:]] == want_top
        assert len(o.outputs) == 2 and all(len(c.token_ids) == 3 for c in o.outputs)
