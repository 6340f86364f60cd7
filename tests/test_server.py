"""The OpenAI-compatible server, in a subprocess on a free loopback port, driven by the official client.

Served outputs must equal the Python API's for the same prompts and seeds; 64
concurrent streams must equal a sequential greedy run; disconnects and bad requests
must leave nothing running and the KV pool empty (checked through /metrics).
"""

from __future__ import annotations

import asyncio
import os
import random
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from tests.serving_models import PROMPTS, WORDS, tiny_serving_dir  # noqa: E402

from hybridserve import LLM, SamplingParams  # noqa: E402

MAX_LEN = 256
REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT = 240.0


@pytest.fixture(scope="module")
def server():
    model = tiny_serving_dir()
    log = tempfile.NamedTemporaryFile("w+", prefix="hybridserve_server_", suffix=".log", delete=False)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridserve.entrypoints.cli", "serve", "--model", str(model), "--port", "0",
         "--served-model-name", "tiny", "--max-model-len", str(MAX_LEN), "--dtype", "float32"],
        stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO, env=env)
    try:
        url = _wait_ready(proc, log.name)
        yield {"url": url, "proc": proc, "log": log.name}
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        log.close()
        os.unlink(log.name)


def _wait_ready(proc: subprocess.Popen, log_path: str) -> str:
    deadline = time.monotonic() + START_TIMEOUT
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}: {Path(log_path).read_text()[-2000:]}")
        if sel.select(timeout=0.5):
            line = proc.stdout.readline()
            if "serving tiny on " in line:
                url = line.rsplit(" ", 1)[1].strip()
                for _ in range(100):
                    try:
                        if httpx.get(url + "/health", timeout=2).status_code == 200:
                            return url
                    except httpx.TransportError:
                        pass
                    time.sleep(0.1)
    raise AssertionError(f"server not ready in {START_TIMEOUT}s: {Path(log_path).read_text()[-2000:]}")


@pytest.fixture(scope="module")
def ref() -> LLM:
    llm = LLM(str(tiny_serving_dir()), max_model_len=MAX_LEN, dtype="float32", progress=False)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=60)


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_idle(url: str) -> dict[str, float]:
    """Metrics once nothing runs or waits and every KV block is free (bounded wait)."""
    for _ in range(300):
        m = metrics(url)
        groups = [v for k, v in m.items() if k.startswith("hybridserve_kv_cache_group_usage_ratio")]
        if (m["hybridserve_num_requests_running"] == 0 and m["hybridserve_num_requests_waiting"] == 0
                and m["hybridserve_kv_cache_usage_ratio"] == 0 and groups and not any(groups)):
            return m
        time.sleep(0.05)
    raise AssertionError(f"server not idle: {m}")


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
                              timeout=httpx.Timeout(30, read=0.2))
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(n=4, **long)
    m = wait_idle(url)
    assert aborted(m) == before + 5


BAD = [
    ({"model": "gpt-4", "prompt": "hi"}, "model", "model_not_found"),
    ({"prompt": "hello " * 300}, "prompt", "context_length_exceeded"),
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens", None),
    ({"prompt": "hi", "max_tokens": 300}, "max_tokens", "context_length_exceeded"),
    ({"prompt": "hi", "max_tokens": "abc"}, "max_tokens", None),
    ({"prompt": "hi", "temperature": "hot"}, "temperature", None),
    ({"prompt": "hi", "n": 0}, "n", None),
    ({"prompt": "hi", "logprobs": 50}, "logprobs", None),
    ({"prompt": "hi", "stop": [""]}, "stop", None),
    ({"prompt": [99999]}, None, None),
    ({"prompt": []}, "prompt", None),
    ({"prompt": "hi", "presence_penalty": 1.0}, "presence_penalty", None),
    ({"max_tokens": 3}, "prompt", None),
]


@pytest.mark.parametrize("body, param, code", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_completion_requests_are_400_with_an_openai_error(server, body: dict, param, code) -> None:
    r = httpx.post(server["url"] + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param and err["code"] == code


def test_other_bad_requests(server, client) -> None:
    url = server["url"]
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("malformed JSON body")
    for body in ({"messages": "hi"}, {"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]},
                 {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
                 {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}):
        r = httpx.post(url + "/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (body, r.text)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="nope", prompt="hi")
    assert info.value.status_code == 400 and info.value.body["code"] == "model_not_found"
    assert httpx.get(url + "/v1/completions").status_code == 405
    assert httpx.get(url + "/v2/nothing").json()["error"]["code"] == "404"
    wait_idle(url)


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
    assert m["hybridserve_prefix_cache_hit_rate"] >= 0.0


def test_sigterm_shuts_the_server_down_cleanly(server) -> None:
    """uvicorn re-raises SIGTERM after its graceful shutdown (exit by the signal, as
    supervisors expect); the engine stops inside the app's lifespan, without a traceback."""
    proc = server["proc"]
    proc.terminate()
    assert proc.wait(30) in (0, -signal.SIGTERM)
    log = Path(server["log"]).read_text()
    assert "Traceback" not in log, log[-2000:]
