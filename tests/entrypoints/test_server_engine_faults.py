"""The server over an in-process engine (httpx's ASGI transport): engine failures and
restarts as clients and /health and /metrics see them, and a model without a tokenizer."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from tests.helpers.faults import fail_execute_after  # noqa: E402
from tests.helpers.serving_models import PROMPTS, tiny_model_dir_without_tokenizer, tiny_serving_dir  # noqa: E402

from hybridserve import LLM, AsyncLLM, SamplingParams  # noqa: E402
from hybridserve.entrypoints.openai.app import build_app  # noqa: E402

MAX_LEN = 256


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def client_for(engine: AsyncLLM) -> httpx.AsyncClient:
    app = build_app(engine, "tiny")
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60)


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_an_injected_executor_fault_fails_open_requests_then_service_resumes() -> None:
    engine = AsyncLLM(str(tiny_serving_dir()), max_model_len=MAX_LEN, progress=False, dtype="float32")
    ref = LLM(str(tiny_serving_dir()), max_model_len=MAX_LEN, progress=False, dtype="float32")
    want = ref.generate(PROMPTS[2], SamplingParams(max_tokens=8), use_tqdm=False)[0].text
    ref.shutdown()

    async def main() -> None:
        async with client_for(engine) as client:
            assert (await client.get("/health")).status_code == 200
            fail_execute_after(engine, 2, "CUDA error at /opt/secret/kernel.cu:42")
            body = {"prompt": PROMPTS[0], "max_tokens": 100, "ignore_eos": True}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            err = r.json()["error"]
            assert err["type"] == "engine_dead" and "secret" not in r.text and "CUDA" not in r.text
            # /health says unhealthy until the rebuilt engine serves, then healthy again.
            statuses = []
            for _ in range(400):
                h = await client.get("/health")
                statuses.append(h.status_code)
                if h.status_code == 200:
                    break
                assert h.json()["error"]["type"] == "engine_restarting"
                await asyncio.sleep(0.02)
            assert statuses[-1] == 200
            r = await client.post("/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
            text = (await client.get("/metrics")).text
            assert metric(text, 'hybridserve_engine_restarts_total{reason="RuntimeError"}') == 1.0
            assert metric(text, "hybridserve_engine_healthy") == 1.0

    try:
        run(main())
    finally:
        engine.shutdown()


def test_an_engine_out_of_restarts_reports_unhealthy() -> None:
    engine = AsyncLLM(str(tiny_serving_dir()), max_model_len=MAX_LEN, progress=False, max_restarts=0)
    fail_execute_after(engine, 0, "CUDA error at /opt/secret/kernel.cu:42")

    async def main() -> None:
        async with client_for(engine) as client:
            r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            assert r.status_code == 503
            for _ in range(100):
                if engine.dead_error is not None:
                    break
                await asyncio.sleep(0.02)
            h = await client.get("/health")
            assert h.status_code == 503 and h.json()["error"]["type"] == "engine_dead" and "secret" not in h.text
            r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            assert r.status_code == 503 and r.json()["error"]["type"] == "engine_dead"
            assert metric((await client.get("/metrics")).text, "hybridserve_engine_healthy") == 0.0

    try:
        run(main())
    finally:
        engine.shutdown()


def test_a_model_without_a_tokenizer_returns_token_ids_and_refuses_stop_strings() -> None:
    path = str(tiny_model_dir_without_tokenizer())
    ref = LLM(path, max_model_len=MAX_LEN, progress=False, dtype="float32")
    want = ref.generate([[10, 11, 12]], SamplingParams(max_tokens=6, logprobs=1), use_tqdm=False)[0]
    ref.shutdown()
    engine = AsyncLLM(path, max_model_len=MAX_LEN, progress=False, dtype="float32")

    async def main() -> None:
        async with client_for(engine) as client:
            body = {"prompt": [10, 11, 12], "max_tokens": 6, "temperature": 0, "logprobs": 1}
            r = await client.post("/v1/completions", json=body)
            choice = r.json()["choices"][0]
            assert r.status_code == 200 and choice["text"] == "" and choice["token_ids"] == want.token_ids
            lp = choice["logprobs"]
            assert lp["tokens"] == [f"token_id:{t}" for t in want.token_ids]
            assert lp["token_logprobs"] == pytest.approx([e.logprob for e in want.outputs[0].logprobs], abs=1e-4)
            chunks = []
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
                async for line in s.aiter_lines():
                    if line.startswith("data: {"):
                        chunks.extend(json.loads(line[6:])["choices"][0].get("token_ids", []))
            assert chunks == want.token_ids
            r = await client.post("/v1/completions", json={**body, "stop": ["x"]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
            r = await client.post("/v1/completions", json={"prompt": "text", "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"

    try:
        run(main())
    finally:
        engine.shutdown()
