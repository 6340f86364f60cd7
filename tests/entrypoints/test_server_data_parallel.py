"""`hybridserve serve --data-parallel-size 2`: both engine-core replicas serve (counted per
replica in /metrics); a killed core fails its own stream with an error event while the
other replica serves on; no core process outlives a server that is killed outright."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tests.helpers.server_proc import process_alive, running_server, scrape_metrics  # noqa: E402
from tests.helpers.serving_models import PROMPTS, tiny_serving_dir  # noqa: E402

from hybridserve.engine.core_process import CORE_NAME_PREFIX  # noqa: E402

ARGS = ("--max-model-len", "256", "--dtype", "float32", "--num-threads", "1")


def cores_of(server_pid: int) -> dict[int, int]:
    """{replica index: pid} of the server's engine core processes (by their OS names)."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
        if rest[0] != "Z" and int(rest[1]) == server_pid and name.startswith(CORE_NAME_PREFIX):
            out[int(name[len(CORE_NAME_PREFIX):])] = int(stat.parent.name)
    return out


def gone(pids, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(process_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


metrics = scrape_metrics


def complete(url: str, prompt: str, max_tokens: int = 6) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                      timeout=60)


def test_two_replicas_serve_and_a_killed_one_fails_only_its_stream() -> None:
    with running_server(tiny_serving_dir(), *ARGS, "--data-parallel-size", "2", "--max-engine-restarts", "0") as srv:
        url, server_pid = srv["url"], srv["proc"].pid
        cores = cores_of(server_pid)
        assert sorted(cores) == [0, 1], cores
        for p in PROMPTS:
            assert complete(url, p).status_code == 200
        m = metrics(url)
        routed = [m[f'hybridserve_requests_routed_total{{replica="{i}"}}'] for i in (0, 1)]
        assert sum(routed) == len(PROMPTS) and min(routed) > 0, routed
        assert all(m[f'hybridserve_generation_tokens_total{{replica="{i}"}}'] > 0 for i in (0, 1))
        assert m['hybridserve_engine_healthy{replica="0"}'] == m['hybridserve_engine_healthy{replica="1"}'] == 1

        # Two long streams, one per replica (the second goes to the less loaded one).
        body = {"prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as client, client.stream("POST", url + "/v1/completions", json=body) as a, \
                client.stream("POST", url + "/v1/completions", json=body) as b:
            lines = [a.iter_lines(), b.iter_lines()]
            for it in lines:
                assert next(l for l in it if l.startswith("data: ")).startswith("data: {")
            m = metrics(url)
            busy = [i for i in (0, 1) if m[f'hybridserve_num_requests_running{{replica="{i}"}}'] == 1]
            assert busy == [0, 1], m
            os.kill(cores[0], signal.SIGKILL)
            rests = [[l for l in it if l.startswith("data: ")] for it in lines]
        events = [[json.loads(l[6:]) for l in rest if l != "data: [DONE]"] for rest in rests]
        assert all(rest[-1] == "data: [DONE]" for rest in rests)
        failed = [i for i, ev in enumerate(events) if ev and "error" in ev[-1]]
        assert len(failed) == 1 and events[failed[0]][-1]["error"]["type"] == "engine_dead", events
        other = events[1 - failed[0]]
        assert other[-1]["choices"][0]["finish_reason"] == "length"

        assert httpx.get(url + "/health").status_code == 200  # replica 1 serves on
        for p in PROMPTS[:4]:
            assert complete(url, p).status_code == 200
        m = metrics(url)
        assert m['hybridserve_engine_healthy{replica="0"}'] == 0 and m['hybridserve_engine_healthy{replica="1"}'] == 1
        log = Path(srv["log"]).read_text()
        assert "Traceback" not in log and "killed by signal 9" in log, log[-2000:]
        # No shutdown at all (a graceful one stops the cores itself, as AsyncLLM.shutdown):
        # the surviving core sees its pipe close and exits.
        srv["proc"].kill()
        srv["proc"].wait(30)
    assert gone(cores.values())
