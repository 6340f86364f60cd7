"""A server configured as a public endpoint: API key (from the environment), CORS, a
short queue, a short shutdown timeout. Driven over loopback in a subprocess."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
from pathlib import Path

import pytest

pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tests.helpers.hand_clock import wait_until  # noqa: E402
from tests.helpers.server_proc import running_server, scrape_metrics  # noqa: E402
from tests.helpers.serving_models import PROMPTS, tiny_serving_dir  # noqa: E402

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def server():
    with running_server(tiny_serving_dir(), "--max-model-len", "256", "--max-num-seqs", "1",
                        "--max-waiting-requests", "2", "--shutdown-timeout", "0.3", "--allowed-origins", ORIGIN,
                        env={"HYBRIDSERVE_API_KEY": KEY}) as srv:
        yield srv


def test_the_api_needs_the_key_and_health_and_metrics_stay_open(server) -> None:
    url = server["url"]
    body = {"prompt": "hello", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}):
        r = httpx.post(url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (headers, r.text)
        assert r.headers["www-authenticate"].startswith("Bearer")
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/v1/models", headers=AUTH).json()["data"][0]["id"] == "tiny"
    r = httpx.post(url + "/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200


def test_cors_only_for_the_allowed_origin(server) -> None:
    url = server["url"]
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(url + "/v1/completions", headers=pre)  # a preflight carries no key
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.options(url + "/v1/completions", headers={**pre, "Origin": "http://evil.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(url + "/v1/models", headers={**AUTH, "Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN


def test_a_full_queue_answers_429_with_retry_after(server) -> None:
    """One running slot and 2 waiting: of 7 long requests sent together, 3 are taken."""
    url = server["url"]

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as client:
            body = {"prompt": PROMPTS[0], "max_tokens": 120, "ignore_eos": True}
            return await asyncio.gather(*(client.post(url + "/v1/completions", json=body) for _ in range(7)))

    responses = asyncio.run(main())
    codes = sorted(r.status_code for r in responses)
    assert codes == [200] * 3 + [429] * 4, [r.text for r in responses]
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error" and refused.json()["error"]["code"] == "queue_full"
    # Once the queue drains, requests are taken again.
    assert httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=AUTH).status_code == 200


def test_sigterm_ends_open_streams_with_an_error_event_after_the_timeout(server) -> None:
    """Three long streams, one running and two waiting; SIGTERM with a 0.3 s shutdown
    timeout: the streams not finished by then end with an error event and [DONE], none
    is cut off, and the log has no traceback."""
    proc, url = server["proc"], server["url"]
    results: dict[int, list[str]] = {}

    def stream(i: int) -> None:
        lines: list[str] = []
        with httpx.stream("POST", url + "/v1/completions", headers=AUTH, timeout=60,
                          json={"prompt": PROMPTS[i], "max_tokens": 240, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
        results[i] = lines

    def taken() -> float:  # requests the engine has: running, waiting or finished
        m = scrape_metrics(url)
        return (m["hybridserve_num_requests_running"] + m["hybridserve_num_requests_waiting"]
                + sum(v for k, v in m.items() if k.startswith("hybridserve_request_finished_total")))

    before = taken()
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    # SIGTERM once the engine has all three (however long a loaded machine takes to send
    # them): a stream still connecting then would be refused, not ended by the shutdown.
    assert wait_until(lambda: taken() - before >= 3, timeout=120)
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    assert proc.wait(30) in (0, -signal.SIGTERM)
    ended_by_shutdown = 0
    for lines in results.values():
        assert lines[-1] == "data: [DONE]", lines[-3:]
        last = json.loads(lines[-2][len("data: "):])
        if "error" in last:
            assert last["error"]["code"] == "shutting_down" and last["error"]["type"] == "service_unavailable"
            ended_by_shutdown += 1
        else:
            assert last["choices"][0]["finish_reason"] == "length"
    assert len(results) == 3 and ended_by_shutdown >= 1
    log = Path(server["log"]).read_text()
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
