"""`hybridserve bench --url URL`: a serving benchmark against a running OpenAI-compatible server.

Requests arrive as a Poisson process at --request-rate per second (inf: all at once),
each a streamed completion of --input-len random token ids asking for exactly
--output-len tokens (ignore_eos; each chunk carries its token ids, so tokens are counted,
not guessed from text). Per request it records the time to first token (TTFT), the mean
time per output token after the first (TPOT) and every inter-token latency (ITL: the gap
between consecutive chunks, shared by the tokens of a chunk). It reports their mean,
median, p90 and p99, request and token throughput, and goodput: completed requests per
second that met both --goodput-ttft-ms and --goodput-tpot-ms.

The server must accept token-id prompts and `return_token_ids` (hybridserve does).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

# Token ids every real vocabulary has, and that are no special token of the usual ones.
_PROMPT_IDS = range(10, 250)


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"mean": statistics.fmean(values), "median": statistics.median(values), "p90": pct(0.9), "p99": pct(0.99)}


async def _one(client: Any, model: str, prompt: list[int], output_len: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0,
            "stream": True, "return_token_ids": True}
    start = time.perf_counter()
    last = start
    result = RequestResult(ok=False)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}"
                await r.aread()
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    result.error = data["error"].get("type", "error")
                    return result
                ids = (data["choices"][0].get("token_ids") or []) if data.get("choices") else []
                if not ids:
                    continue
                now = time.perf_counter()
                if result.output_tokens == 0:
                    result.ttft = now - start
                else:
                    result.itls.extend([(now - last) / len(ids)] * len(ids))
                result.output_tokens += len(ids)
                last = now
    except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash
        result.error = type(exc).__name__
        return result
    result.e2e = last - start
    result.ok = result.output_tokens == output_len
    if not result.ok and not result.error:
        result.error = f"{result.output_tokens} of {output_len} tokens"
    return result


async def run_serving_benchmark(url: str, num_prompts: int, input_len: int, output_len: int, request_rate: float,
                                seed: int = 0, api_key: str | None = None) -> dict[str, Any]:
    import httpx

    rng = random.Random(seed)
    prompts = [[rng.choice(_PROMPT_IDS) for _ in range(input_len)] for _ in range(num_prompts)]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=num_prompts + 4, max_keepalive_connections=num_prompts + 4)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), timeout=600, headers=headers, limits=limits) as client:
        models = (await client.get("/v1/models")).json()["data"]
        model = models[0]["id"]
        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.ensure_future(_one(client, model, prompt, output_len)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return {"model": model, "duration_s": duration, "results": results}


def summarize(results: list[RequestResult], duration: float, ttft_slo_ms: float, tpot_slo_ms: float
              ) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in done)
    good = [r for r in done if r.ttft * 1000 <= ttft_slo_ms and (r.tpot is None or r.tpot * 1000 <= tpot_slo_ms)]
    ms = 1000.0
    return {
        "completed": len(done), "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok}),
        "duration_s": duration, "request_throughput": len(done) / duration, "output_tok_s": tokens / duration,
        "goodput_req_s": len(good) / duration,
        "ttft_ms": {k: v * ms for k, v in percentiles([r.ttft for r in done]).items()},
        "tpot_ms": {k: v * ms for k, v in percentiles([r.tpot for r in done if r.tpot is not None]).items()},
        "itl_ms": {k: v * ms for k, v in percentiles([x for r in done for x in r.itls]).items()},
    }
