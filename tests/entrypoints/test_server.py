"""The OpenAI-compatible server, in a subprocess on a free loopback port, driven by the official client.

Served outputs must equal the Python API's for the same prompts and seeds; 64
concurrent streams must equal a sequential greedy run; disconnects and bad requests
must leave nothing running and the KV pool empty (checked through /metrics).
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import threading
import importlib
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
schemathesis = pytest.importorskip("schemathesis")
# The OpenAPI loader's modules imported at collection, not lazily inside the fuzz test:
# pytest rewrites a plugin's modules as they are imported, and on Python 3.11 compiling
# them deep in a long test session once failed with CPython's "AST constructor recursion
# depth mismatch" (a SystemError from the compiler, not from the code under test).
importlib.import_module("schemathesis.specs.openapi.schemas")

from tests.helpers.server_proc import running_server, scrape_metrics  # noqa: E402
from tests.helpers.serving_models import PROMPTS, WORDS, tiny_serving_dir  # noqa: E402

from hybridserve import LLM, SamplingParams  # noqa: E402
from hybridserve.entrypoints.openai.sse_chunks import sse_line  # noqa: E402

MAX_LEN = 256


@pytest.fixture(scope="module")
def server():
    with running_server(tiny_serving_dir(), "--max-model-len", str(MAX_LEN), "--dtype", "float32") as srv:
        yield srv


@pytest.fixture(scope="module")
def ref() -> LLM:
    llm = LLM(str(tiny_serving_dir()), max_model_len=MAX_LEN, dtype="float32", progress=False)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=60)


metrics = scrape_metrics


def wait_idle(url: str, timeout: float = 300.0) -> dict[str, float]:
    """Metrics once nothing runs or waits and every KV block is free. `timeout` only turns a
    server that never gets there into a failure: a loaded machine takes longer, that's all."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        groups = [v for k, v in m.items() if k.startswith("hybridserve_kv_cache_group_usage_ratio")]
        if (m["hybridserve_num_requests_running"] == 0 and m["hybridserve_num_requests_waiting"] == 0
                and m["hybridserve_kv_cache_usage_ratio"] == 0 and groups and not any(groups)):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle: {m}")
        time.sleep(0.05)


def aborted(m: dict[str, float]) -> float:
    return m.get('hybridserve_request_finished_total{finish_reason="abort"}', 0.0)


def test_models_and_health(server, client) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server["url"] + "/health").json() == {"status": "ok"}


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, seed=5)], ids=["greedy", "seeded"])
def test_completions_equal_the_python_api(client, ref: LLM, sampling: dict) -> None:
    want = ref.generate(PROMPTS[:4], SamplingParams(max_tokens=12, **sampling), use_tqdm=False)
    for prompt, exp in zip(PROMPTS[:4], want):
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, **sampling)
        assert got.choices[0].text == exp.text and got.choices[0].finish_reason == exp.finish_reason
        assert got.usage.prompt_tokens == len(exp.prompt_token_ids)
        assert got.usage.completion_tokens == len(exp.token_ids)
    # Several prompts with n=2: choice index = prompt index * n + choice.
    want = ref.generate(PROMPTS[:3], SamplingParams(max_tokens=8, n=2, **sampling), use_tqdm=False)
    got = client.completions.create(model="tiny", prompt=PROMPTS[:3], max_tokens=8, n=2, **sampling)
    assert [c.index for c in got.choices] == list(range(6))
    assert [c.text for c in got.choices] == [c.text for o in want for c in o.outputs]


def test_streamed_completion_equals_the_whole_one(client, ref: LLM) -> None:
    want = ref.generate(PROMPTS[4], SamplingParams(max_tokens=16), use_tqdm=False)[0]
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[4], max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 2
    assert "".join(c.choices[0].text for c in text_chunks) == want.text
    assert text_chunks[-1].choices[0].finish_reason == want.finish_reason
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)


STREAMED_BODIES = {
    "completions": ("/v1/completions", {"prompt": PROMPTS[:3], "max_tokens": 8, "n": 2, "temperature": 0.8, "seed": 5,
                                        "stream_options": {"include_usage": True}}),
    "completions-logprobs": ("/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 6, "logprobs": 2, "echo": True,
                                                 "temperature": 0}),
    "completions-token-ids": ("/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 5, "return_token_ids": True}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello cat"}], "max_tokens": 8, "n": 2,
                                      "stream_options": {"include_usage": True}}),
    "chat-logprobs": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "one two"}], "max_tokens": 5,
                                               "logprobs": True, "top_logprobs": 2, "temperature": 0}),
}


@pytest.mark.parametrize("name", list(STREAMED_BODIES))
def test_every_streamed_event_is_its_dict_rendered_as_json(server, client, ref: LLM, name: str) -> None:
    """The wire bytes: whichever path rendered an event (the common chunk's template or the
    chunk's dict), it is json.dumps of what it decodes to; the stream ends with [DONE]."""
    path, body = STREAMED_BODIES[name]
    with httpx.stream("POST", server["url"] + path, json={**body, "model": "tiny", "stream": True}, timeout=60) as r:
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert [f"{e}\n\n" for e in events[:-2]] == [sse_line(c) for c in chunks]
    assert all(e.startswith("data: {") for e in events[:-2])
    if name == "completions":  # several prompts and choices: each choice's text as the Python API's
        want = ref.generate(PROMPTS[:3], SamplingParams(max_tokens=8, n=2, temperature=0.8, seed=5), use_tqdm=False)
        texts = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
                 for i in range(6)]
        assert texts == [c.text for o in want for c in o.outputs]
        assert chunks[-1]["usage"]["completion_tokens"] == sum(len(c.token_ids) for o in want for c in o.outputs)


def test_chat_whole_and_streamed(client, ref: LLM) -> None:
    messages = [{"role": "system", "content": "one two"}, {"role": "user", "content": "hello cat"}]
    want = ref.chat(messages, SamplingParams(max_tokens=10))[0]
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    stream = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want.text
    assert stream[-1].choices[0].finish_reason == want.finish_reason


def test_stop_strings_echo_and_logprobs(client, ref: LLM) -> None:
    full = ref.generate(PROMPTS[0], SamplingParams(max_tokens=12), use_tqdm=False)[0].text
    stop = full.split()[2]
    got = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop])
    assert got.choices[0].text == full[: full.index(stop)] and got.choices[0].finish_reason == "stop"
    echoed = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPTS[0] + full
    got = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 5 == got.usage.completion_tokens
    assert all(len(top) == 2 and max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)


def test_echo_with_logprobs_scores_the_prompt(server, client, ref: LLM) -> None:
    prompt = PROMPTS[1]
    want = ref.generate(prompt, SamplingParams(max_tokens=3, prompt_logprobs=2, logprobs=2), use_tqdm=False)[0]
    ids, scored = want.prompt_token_ids, want.prompt_logprobs
    assert scored is not None and len(scored) == len(ids) > 3
    # max_tokens 0 with echo: the prompt alone, scored (the way evaluation harnesses ask).
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0)
    c = got.choices[0]
    assert c.text == prompt and c.finish_reason == "length" and got.usage.completion_tokens == 0
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in scored[1:]], abs=1e-5)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # Each top list: the 2 best, plus the prompt token when it is not among them.
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    # With a completion, its tokens follow the prompt's, offset past the echoed text.
    both = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, echo=True, logprobs=2, temperature=0)
    blp = both.choices[0].logprobs
    assert both.choices[0].text == prompt + want.text
    assert blp.token_logprobs[0] is None and blp.token_logprobs[1: len(ids)] == pytest.approx(lp.token_logprobs[1:])
    assert blp.token_logprobs[len(ids):] == pytest.approx([e.logprob for e in want.outputs[0].logprobs], abs=1e-5)
    assert blp.text_offset[len(ids)] == len(prompt)
    # Streamed, the first chunk carries the echo and the prompt's logprobs.
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=2,
                                            temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == prompt
    streamed = chunks[0].choices[0].logprobs.token_logprobs
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:])
    assert chunks[-1].choices[0].finish_reason == "length"
    wait_idle(server["url"])


def test_prompt_logprobs_extension_on_both_endpoints(server, client, ref: LLM) -> None:
    got = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 1})
    want = ref.generate(PROMPTS[2], SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)[0]
    field = got.choices[0].model_extra["prompt_logprobs"]
    assert field[0] is None and len(field) == len(want.prompt_token_ids)
    for entry, token, exp in zip(field[1:], want.prompt_token_ids[1:], want.prompt_logprobs[1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(exp.logprob, abs=1e-5)
        assert set(entry) == {str(token)} | {str(t) for t, _ in exp.top}  # the token and the best one
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "the cat"}],
                                          max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0})
    field = chat.choices[0].model_extra["prompt_logprobs"]
    assert field[0] is None and len(field) == chat.usage.prompt_tokens
    assert all(len(entry) == 1 and next(iter(entry.values()))["logprob"] <= 0 for entry in field[1:])
    stream = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "the cat"}],
                                                 max_tokens=2, temperature=0, stream=True,
                                                 extra_body={"prompt_logprobs": 0}))
    carried = [ch.choices[0].model_extra["prompt_logprobs"] for ch in stream
               if ch.choices and (ch.choices[0].model_extra or {}).get("prompt_logprobs")]
    assert carried == [field]  # once, on the choice's first chunk with content
    wait_idle(server["url"])


def test_tokenize_and_detokenize(server, ref: LLM) -> None:
    url = server["url"]
    got = httpx.post(url + "/tokenize", json={"prompt": "the cat sat", "return_token_strs": True}).json()
    want = ref.tokenizer.encode("the cat sat")
    assert got["tokens"] == want and got["count"] == len(want) and got["max_model_len"] == MAX_LEN
    assert got["token_strs"] == [ref.tokenizer.token_text(t) for t in want]
    bare = httpx.post(url + "/tokenize", json={"prompt": "the cat sat", "add_special_tokens": False}).json()
    assert bare["tokens"] == ref.tokenizer.encode("the cat sat", add_special_tokens=False) != want
    # A conversation counts as a chat request renders it: usage.prompt_tokens of the same messages.
    messages = [{"role": "user", "content": "the cat"}]
    chat = httpx.post(url + "/tokenize", json={"messages": messages}).json()
    reply = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert chat["count"] == reply["usage"]["prompt_tokens"]
    # Longer than the context: counted all the same (a client checks it against max_model_len).
    assert httpx.post(url + "/tokenize", json={"prompt": "the " * 400}).json()["count"] > MAX_LEN
    text = httpx.post(url + "/detokenize", json={"tokens": got["tokens"]}).json()["prompt"]
    assert text == ref.tokenizer.decode(want, skip_special_tokens=False) and text.endswith("the cat sat")
    for path, body, param in [("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
                              ("/tokenize", {"prompt": 5}, "prompt"), ("/detokenize", {"tokens": [256]}, "tokens"),
                              ("/detokenize", {"tokens": [-1]}, "tokens"), ("/detokenize", {"tokens": "ab"}, "tokens"),
                              ("/tokenize", {"prompt": "ok \ud800"}, "prompt")]:
        # json.dumps spells the lone surrogate as the escape a client would send.
        r = httpx.post(url + path, content=json.dumps(body), headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
    r = httpx.post(url + "/tokenize", json={"model": "gpt-4", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_concurrent_requests_equal_the_python_api(server, ref: LLM) -> None:
    want = ref.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.7, seed=9), use_tqdm=False)
    aclient = openai.AsyncOpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=60)

    async def one(i: int, prompt: str) -> str:
        if i % 2:
            return (await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0.7,
                                                     seed=9)).choices[0].text
        chunks = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0.7, seed=9,
                                                  stream=True)
        return "".join([c.choices[0].text async for c in chunks])

    async def main() -> list[str]:
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))), 120)
        finally:
            await aclient.close()

    assert asyncio.run(main()) == [o.text for o in want]
    wait_idle(server["url"])


def test_a_disconnect_aborts_the_request_and_frees_its_blocks(server, client) -> None:
    url = server["url"]
    before = aborted(wait_idle(url))
    long = dict(model="tiny", prompt=PROMPTS[1], max_tokens=240, extra_body={"ignore_eos": True})
    stream = client.completions.create(stream=True, **long)
    chunks = iter(stream)
    assert next(chunks).choices[0].text and next(chunks).choices[0].text
    stream.close()  # hang up mid-stream
    m = wait_idle(url)
    assert aborted(m) == before + 1
    # A non-streaming client that gives up (read timeout) aborts too: all 4 choices,
    # 960 tokens of work, far more than the 0.2 s it waits.
    impatient = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                              timeout=openai.Timeout(30, read=0.2))  # the HTTP library openai itself uses
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(n=4, **long)
    m = wait_idle(url)
    assert aborted(m) == before + 5


BAD = [
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model", "model_not_found"),
    ({"prompt": "hello " * 300}, 400, "prompt", "context_length_exceeded"),
    ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens", None),
    ({"prompt": "hi", "max_tokens": 300}, 400, "max_tokens", "context_length_exceeded"),
    ({"prompt": "hi", "max_tokens": "abc"}, 400, "max_tokens", None),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature", None),
    ({"prompt": "hi", "n": 0}, 400, "n", None),
    ({"prompt": "hi", "logprobs": 50}, 400, "logprobs", None),
    ({"prompt": "hi", "stop": [""]}, 400, "stop", None),
    ({"prompt": [99999]}, 400, "prompt", None),
    ({"prompt": []}, 400, "prompt", None),
    ({"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty", None),
    ({"prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty", None),
    ({"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty", None),
    ({"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias", None),
    ({"prompt": "hi", "logit_bias": {"300": 1}}, 400, "logit_bias", None),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias", None),
    ({"prompt": "hi", "allowed_token_ids": []}, 400, "allowed_token_ids", None),
    ({"prompt": "hi", "bad_words": [" "]}, 400, "bad_words", None),
    ({"max_tokens": 3}, 400, "prompt", None),
    # The request that used to kill the engine for good (an id past the 256-token vocabulary
    # reached the sampler's min_tokens mask), and its relatives.
    ({"prompt": [1, 2, 3, 4], "max_tokens": 3, "stop_token_ids": [99999], "min_tokens": 2}, 400, "stop_token_ids", None),
    ({"prompt": "hi", "stop_token_ids": [256]}, 400, "stop_token_ids", None),
    ({"prompt": "hi", "stop_token_ids": [-1], "min_tokens": 1}, 400, "stop_token_ids", None),
    ({"prompt": "hi", "stop_token_ids": [-300]}, 400, "stop_token_ids", None),
    ({"prompt": "hi", "stop_token_ids": [2**64]}, 400, "stop_token_ids", None),
    ({"prompt": "hi", "temperature": float("nan")}, 400, "temperature", None),
    ({"prompt": "hi", "temperature": float("inf")}, 400, "temperature", None),
    ({"prompt": "hi", "top_p": float("nan")}, 400, "top_p", None),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p", None),
    ({"prompt": "hi", "min_p": -0.5}, 400, "min_p", None),
    ({"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, 400, "stop", None),
    ({"prompt": "hi", "stop": ["x" * 257]}, 400, "stop", None),
    ({"prompt": ["hi", "yo"], "n": 65}, 400, "n", None),
    ({"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens", None),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),  # scores nothing without echo
    ({"prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs", None),
    ({"prompt": "hi", "prompt_logprobs": -1}, 400, "prompt_logprobs", None),
    ({"prompt": "hi", "prompt_logprobs": "all"}, 400, "prompt_logprobs", None),
    # JSON can spell a lone UTF-16 surrogate, which no tokenizer encodes (it was a 500).
    ({"prompt": "ok \ud800"}, 400, "prompt", None),
    ({"prompt": ["hi", "\udfff"]}, 400, "prompt", None),
    ({"prompt": "hi", "bad_words": ["\ud800"]}, 400, "bad_words", None),
]


@pytest.mark.parametrize("body, status, param, code", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_completion_requests_are_4xx_with_an_openai_error(server, body: dict, status: int, param, code) -> None:
    # json.dumps writes NaN and Infinity as the bare words a careless client sends.
    r = httpx.post(server["url"] + "/v1/completions", content=json.dumps(body), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param and err["code"] == code


def test_sampling_controls_equal_the_python_api(client, ref: LLM) -> None:
    controls = dict(presence_penalty=1.0, frequency_penalty=0.5, logit_bias={"30": 5.0, "12": -100})
    extra = dict(repetition_penalty=1.2, bad_words=["cat"])
    want = ref.generate(PROMPTS[1], SamplingParams(max_tokens=12, presence_penalty=1.0, frequency_penalty=0.5,
                                                   logit_bias={30: 5.0, 12: -100.0}, repetition_penalty=1.2,
                                                   bad_words=("cat",)), use_tqdm=False)[0]
    got = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0, **controls,
                                    extra_body=extra)
    assert got.choices[0].text == want.text and "cat" not in got.choices[0].text.split()
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          temperature=0, extra_body={"allowed_token_ids": [20, 21, 22]})
    assert set(chat.choices[0].message.content.split()) <= {ref.tokenizer.token_text(t).strip() for t in (20, 21, 22)}


def test_the_fatal_request_leaves_the_engine_serving(server, client) -> None:
    url = server["url"]
    for body in ({"prompt": [1, 2, 3, 4], "max_tokens": 3, "stop_token_ids": [99999], "min_tokens": 2},
                 {"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [2**63 + 5], "min_tokens": 2}):
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        r = httpx.post(url + path, json=body)
        assert r.status_code == 400 and "outside the vocabulary (0..255)" in r.json()["error"]["message"], r.text
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    # min_tokens with valid stop ids still works: 3 tokens although 1 (<eos>) is banned only for 2.
    got = client.completions.create(model="tiny", prompt=[10, 11], max_tokens=3,
                                    extra_body={"min_tokens": 2, "stop_token_ids": [255]})
    assert got.usage.completion_tokens >= 2
    wait_idle(url)


def test_other_bad_requests(server, client) -> None:
    url = server["url"]
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("malformed JSON body")
    for body in ({"messages": "hi"}, {"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]},
                 {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
                 {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}):
        r = httpx.post(url + "/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (body, r.text)
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="hi")
    assert info.value.status_code == 404 and info.value.body["code"] == "model_not_found"
    as_json = {"content-type": "application/json"}  # json.dumps escapes the surrogates; httpx's json= cannot
    r = httpx.post(url + "/v1/chat/completions", headers=as_json,
                   content=json.dumps({"messages": [{"role": "user", "content": "a\ud800"}]}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "lone surrogate U+D800" in r.json()["error"]["message"]
    # An error message that quotes a surrogate from the request is still a JSON answer.
    r = httpx.post(url + "/v1/completions", headers=as_json, content=json.dumps({"model": "x\ud800", "prompt": "hi"}))
    assert r.status_code == 404 and "x\\ud800" in r.json()["error"]["message"], r.text
    r = httpx.get(url + "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["code"] == "405"
    assert httpx.get(url + "/v2/nothing").json()["error"]["code"] == "404"
    r = httpx.post(url + "/v1/completions", content=b'{"prompt": "hi"}', headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    wait_idle(url)


def test_an_image_part_is_a_400_naming_the_model(server) -> None:
    """Multimodal checkpoints are served by their language model: an image part is refused
    with a message a client can act on, not a server error."""
    parts = [{"type": "text", "text": "what is in this picture?"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]
    r = httpx.post(server["url"] + "/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}]})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "messages" and error["type"] == "invalid_request_error"
    assert error["message"] == ("the model `tiny` takes text content parts only here: 'image_url' parts (images) "
                                "are not supported yet")


def test_bodies_over_the_limit_are_refused_before_they_are_read(server) -> None:
    url = server["url"]
    big = b'{"prompt": "' + b"a" * (33 << 20) + b'"}'
    r = httpx.post(url + "/v1/completions", content=big, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the guard counts the streamed bytes
        yield b'{"prompt": "'
        for _ in range(33):
            yield b"a" * (1 << 20)
        yield b'"}'

    r = httpx.post(url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert httpx.get(url + "/health").status_code == 200


def test_health_answers_while_a_10mb_prompt_is_tokenized(server) -> None:
    """Order, not speed: between the last byte of a 10 MB prompt going out and its answer
    (parsing, then tokenizing, which a loaded machine only makes longer), /health answers
    at least 5 times. Were the tokenizer run on the event loop, the probes would wait for
    it: only those answered while the body was still being read and parsed (one or two,
    as the probe sends one at most every 50 ms) could fall in between."""
    url = server["url"]
    events: list[str] = []  # "uploaded", "health" (a probe answered), "answered", as they happen

    def body():  # type: ignore[no-untyped-def]
        yield b'{"max_tokens": 1, "prompt": "'
        for _ in range(10):  # 10 MB, far over max_model_len once tokenized
            yield b"hello world the cat " * 50_000
        yield b'"}'
        events.append("uploaded")  # httpx asks for the next chunk once the last one is written

    result: dict = {}

    def post() -> None:
        result["r"] = httpx.post(url + "/v1/completions", content=body(), headers={"content-type": "application/json"},
                                 timeout=300)
        events.append("answered")

    poster = threading.Thread(target=post)
    with httpx.Client(timeout=300) as probe:  # a long timeout: a slow answer under load is no failure
        probe.get(url + "/health")  # connection warm
        poster.start()
        while poster.is_alive():
            assert probe.get(url + "/health").status_code == 200
            events.append("health")
            time.sleep(0.05)
        poster.join()
    between = events[events.index("uploaded"):events.index("answered")].count("health")
    assert between >= 5, ("the prompt was tokenized too fast to probe, or /health waited for it", events)
    r = result["r"]
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_models_and_openapi_show_no_paths_and_describe_the_bodies(server) -> None:
    url = server["url"]
    data = httpx.get(url + "/v1/models").json()["data"][0]
    assert data["root"] == "tiny" and "/" not in json.dumps(data)
    spec = httpx.get(url + "/openapi.json").json()
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatRequest")):
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/" + model)
    assert "prompt" in spec["components"]["schemas"]["CompletionRequest"]["properties"]


def _load_prompts(n: int) -> list[str]:
    rng = random.Random(64)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 14))) for _ in range(n)]


def test_64_concurrent_streams_equal_a_sequential_greedy_run(server, ref: LLM) -> None:
    prompts = _load_prompts(64)
    params = SamplingParams(max_tokens=16)
    want = [ref.generate(p, params, use_tqdm=False)[0].text for p in prompts]  # one at a time
    aclient = openai.AsyncOpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=90)

    async def stream(prompt: str) -> str:
        chunks = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                                  stream=True)
        return "".join([c.choices[0].text async for c in chunks])

    async def main() -> list[str]:
        try:
            return await asyncio.wait_for(asyncio.gather(*(stream(p) for p in prompts)), 150)
        finally:
            await aclient.close()

    assert asyncio.run(main()) == want
    m = wait_idle(server["url"])
    assert m["hybridserve_generation_tokens_total"] >= sum(len(ref.tokenizer.encode(t, False)) for t in want)
    assert m["hybridserve_time_to_first_token_seconds_count"] >= 64


def test_a_repeated_prompt_is_served_from_the_prefix_cache(server, client) -> None:
    """49 prompt tokens: 3 full blocks of 16 and one more token. The second time the hit is
    48 tokens: the full-attention group holds blocks 0-2, and the sliding-window group
    (window 16) kept the block the window before position 48 needs (tokens 33-47, block
    2); blocks 0-1 it never held (window-tail allocation). With 48 tokens the hit would
    be 0: the last token is always recomputed, and a hit at 32 needs block 1 of the
    window group, which it never held."""
    url = server["url"]
    prompt = [10 + (i * 7) % 200 for i in range(49)]
    before = wait_idle(url)
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    after = wait_idle(url)
    hits = after["hybridserve_prefix_cache_hits_total"] - before["hybridserve_prefix_cache_hits_total"]
    queries = after["hybridserve_prefix_cache_queries_total"] - before["hybridserve_prefix_cache_queries_total"]
    assert hits == 48 and queries == 98, (hits, queries)
    assert after["hybridserve_prefix_cache_hit_rate"] > 0


def test_bench_serving_mode_measures_a_running_server(server, tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "serving.json"
    proc = subprocess.run([sys.executable, "-m", "hybridserve.entrypoints.cli", "bench", "--url", server["url"],
                           "--num-prompts", "8", "--input-len", "12", "--output-len", "6", "--request-rate", "40",
                           "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert r["completed"] == 8 and r["failed"] == 0 and r["model"] == "tiny"
    assert r["output_tok_s"] * r["duration_s"] == pytest.approx(48)  # 8 requests x 6 tokens, counted by id
    assert 0 < r["ttft_ms"]["median"] <= r["ttft_ms"]["p99"] and r["tpot_ms"]["mean"] > 0
    assert 0 <= r["goodput_req_s"] <= r["request_throughput"]
    assert "TTFT" in proc.stdout and "goodput" in proc.stdout
    wait_idle(server["url"])


def test_fuzzed_requests_never_get_a_5xx_and_leave_the_server_healthy(server) -> None:
    """Bounded fuzzing from the server's own /openapi.json (schemathesis, via hypothesis):
    request bodies of every shape the schema allows and many it does not."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    url = server["url"]
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    modes = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
    with httpx.Client(timeout=60) as http:
        for op in schema.get_all_operations():
            operation = op.ok()

            @settings(max_examples=30, deadline=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=st.one_of(*(operation.as_strategy(m) for m in modes)))
            def fuzz(case) -> None:
                kwargs = case.as_transport_kwargs(base_url=url)
                r = http.request(kwargs["method"], kwargs["url"], params=kwargs.get("params"),
                                 headers={"content-type": "application/json", **(kwargs.get("headers") or {})},
                                 content=None if case.body is None or "json" not in kwargs
                                 else json.dumps(kwargs["json"]))
                assert r.status_code < 500, (case.body, r.text)
                if r.status_code >= 400:
                    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
                assert http.get(url + "/health").status_code == 200

            fuzz()
    wait_idle(url)


def test_sigterm_lets_open_streams_finish_then_exits_cleanly(server) -> None:
    """SIGTERM drains: a stream already running finishes normally (the default shutdown
    timeout, 10 s, is far longer than it needs), the listener closes, and the engine
    stops inside the app's lifespan without a traceback. uvicorn re-raises SIGTERM after
    its graceful shutdown (exit by the signal, as supervisors expect)."""
    proc, url = server["proc"], server["url"]
    events: list[str] = []
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={"prompt": PROMPTS[1], "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if not line:
                continue
            events.append(line)
            if len(events) == 2:
                proc.terminate()
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: "):])
    assert last["choices"][0]["finish_reason"] == "length", last
    assert proc.wait(30) in (0, -signal.SIGTERM)
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=2)
    log = Path(server["log"]).read_text()
    assert "Traceback" not in log, log[-2000:]
