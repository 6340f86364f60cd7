"""`hybridserve bench`: offline throughput of a model on this machine (or, with --url, a
serving benchmark against a running server: see bench_serving.py).

    hybridserve bench --model ./my-model --num-prompts 16 --input-len 128 --output-len 64

N random token prompts (seeded, EOS excluded) all arrive at t=0 and run greedily with
ignore_eos, so every request produces exactly --output-len tokens. A short warm-up
batch runs first. Reports output tokens/s, total tokens/s, time to first token and
time per output token (mean / median / p99 over requests), optionally as JSON; with
--num-speculative-tokens also the draft acceptance rate and mean accepted length.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

from hybridserve.entrypoints.command import FlagError, one_line_errors, run_guarded, standalone_main
from hybridserve.entrypoints.engine_flags import add_engine_arguments, engine_config_from_args

PROG = "hybridserve bench"
DESCRIPTION = "Measure output tokens/s, TTFT and TPOT of a model on N prompts x M tokens."
# What the serving-mode flags (with --url) take when not given.
SERVING_DEFAULTS = {"request_rate": float("inf"), "goodput_ttft_ms": 1000.0, "goodput_tpot_ms": 100.0}


def _add_arguments(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=16, help="requests in the measured run (default: %(default)s)")
    w.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (default: %(default)s)")
    w.add_argument("--output-len", type=int, default=64, help="new tokens per request (default: %(default)s)")
    w.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="run two short requests first, untimed (default: on)")
    w.add_argument("--json", default=None, metavar="OUT.json", help="also write the results as JSON")
    sv = p.add_argument_group("serving mode (against a running server; the engine flags are then unused)")
    sv.add_argument("--url", default=None, help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000 "
                    "(default: none, benchmark the engine offline)")
    # Serving-only flags default to None here, so that giving one without --url is caught;
    # SERVING_DEFAULTS fills them in.
    sv.add_argument("--request-rate", type=float, default=None,
                    help=f"Poisson arrivals per second; inf sends all at once (default: {SERVING_DEFAULTS['request_rate']})")
    sv.add_argument("--goodput-ttft-ms", type=float, default=None,
                    help=f"goodput counts requests with TTFT at most this (default: {SERVING_DEFAULTS['goodput_ttft_ms']:g})")
    sv.add_argument("--goodput-tpot-ms", type=float, default=None,
                    help=f"... and TPOT at most this (default: {SERVING_DEFAULTS['goodput_tpot_ms']:g})")
    sv.add_argument("--api-key", default=None, help="bearer key for the server (default: $HYBRIDSERVE_API_KEY)")
    add_engine_arguments(p)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="measure throughput, TTFT and TPOT on a model", description=DESCRIPTION)
    one_line_errors(p, PROG)
    _add_arguments(p)
    return p


def random_prompts(n: int, length: int, vocab_size: int, avoid: set[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    pool = [t for t in range(min(vocab_size, 1 << 20)) if t not in avoid]
    return [[rng.choice(pool) for _ in range(length)] for _ in range(n)]


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    return {"mean": statistics.fmean(values), "median": statistics.median(values),
            "p99": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]}


def run(args: argparse.Namespace) -> int:
    return run_guarded(PROG, lambda: _run(args))


def _run(a: argparse.Namespace) -> int:
    for flag, value in (("--num-prompts", a.num_prompts), ("--input-len", a.input_len),
                        ("--output-len", a.output_len)):
        if value < 1:
            raise FlagError(f"argument {flag}: must be >= 1, got {value}")
    if a.url is not None:
        return _run_serving(a)
    given = [name for name in (*SERVING_DEFAULTS, "api_key") if getattr(a, name) is not None]
    if given:
        raise FlagError(f"argument --{given[0].replace('_', '-')}: applies to a running server only (give --url)")
    from hybridserve.engine.llm import LLM
    from hybridserve.core.request import SamplingParams

    config = engine_config_from_args(a)
    llm = LLM(config=config)
    try:
        if a.input_len + a.output_len > llm.max_model_len:
            raise FlagError(f"--input-len + --output-len = {a.input_len + a.output_len} exceeds max_model_len "
                            f"{llm.max_model_len}")
        avoid = {t for t in (llm.parts.eos_token_id, *llm.parts.model_stop_ids) if t is not None}
        prompts = random_prompts(a.num_prompts, a.input_len, llm.parts.vocab_size, avoid, config.seed)
        params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
        if a.warmup:
            llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
        start = time.monotonic()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.monotonic() - start
        stats = llm.parts.engine.scheduler.stats  # includes the warm-up's few drafts
    finally:
        llm.shutdown()
    metrics = [m for o in outs for m in (o.metrics or [])]
    output_tokens = sum(len(o.token_ids) for o in outs)
    ttft = [m.first_token_time - start for m in metrics if m.first_token_time is not None]
    tpot = [t for t in (m.tpot for m in metrics) if t is not None]
    result = {
        "model": str(llm.parts.model_path), "num_prompts": a.num_prompts, "input_len": a.input_len,
        "output_len": a.output_len, "elapsed_s": elapsed, "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (output_tokens + a.num_prompts * a.input_len) / elapsed,
        "ttft_ms": {k: v * 1000 for k, v in _summary(ttft).items()},
        "tpot_ms": {k: v * 1000 for k, v in _summary(tpot).items()},
        "async_scheduling": config.async_scheduling, "dtype": config.dtype,
        "num_speculative_tokens": config.num_speculative_tokens,
    }
    if config.num_speculative_tokens:
        result["spec_acceptance_rate"] = stats.acceptance_rate
        result["spec_mean_accepted_length"] = stats.mean_accepted_length
    _print(result)
    _write_json(a.json, result)
    return 0


def _write_json(path: str | None, result: dict[str, Any]) -> None:
    if path:
        try:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=2)
        except OSError as exc:
            raise FlagError(f"argument --json: cannot write {path} ({exc.strerror or exc})") from None


def _run_serving(a: argparse.Namespace) -> int:
    import asyncio

    import httpx

    from hybridserve.entrypoints.bench_serving import run_serving_benchmark, summarize
    from hybridserve.entrypoints.openai.limits import api_key_from_env

    for name, default in SERVING_DEFAULTS.items():
        if getattr(a, name) is None:
            setattr(a, name, default)
    if not a.request_rate > 0:
        raise FlagError(f"argument --request-rate: must be > 0 (inf for all at once), got {a.request_rate}")
    for flag, value in (("--goodput-ttft-ms", a.goodput_ttft_ms), ("--goodput-tpot-ms", a.goodput_tpot_ms)):
        if not value >= 0:  # NaN as well
            raise FlagError(f"argument {flag}: must be >= 0 ms, got {value}")
    try:
        run = asyncio.run(run_serving_benchmark(a.url, a.num_prompts, a.input_len, a.output_len, a.request_rate,
                                                a.seed or 0, api_key_from_env(a.api_key)))
    except (httpx.TransportError, httpx.InvalidURL, ValueError, KeyError) as exc:
        raise FlagError(f"argument --url: cannot benchmark {a.url} ({type(exc).__name__}: {exc})") from None
    result = {"url": a.url, "model": run["model"], "num_prompts": a.num_prompts, "input_len": a.input_len,
              "output_len": a.output_len, "request_rate": a.request_rate,
              **summarize(run["results"], run["duration_s"], a.goodput_ttft_ms, a.goodput_tpot_ms)}
    lines = [
        f"server              {a.url} ({result['model']})",
        f"workload            {a.num_prompts} requests x {a.input_len} tokens -> {a.output_len} new tokens, "
        f"{a.request_rate:g} requests/s",
        f"completed           {result['completed']} ({result['failed']} failed{': ' if result['errors'] else ''}"
        f"{', '.join(result['errors'])}) in {result['duration_s']:.2f} s",
        f"throughput          {result['request_throughput']:.2f} requests/s, {result['output_tok_s']:.1f} output tok/s",
        f"goodput             {result['goodput_req_s']:.2f} requests/s (TTFT <= {a.goodput_ttft_ms:g} ms, "
        f"TPOT <= {a.goodput_tpot_ms:g} ms)",
    ]
    for name in ("ttft_ms", "tpot_ms", "itl_ms"):
        s = result[name]
        lines.append(f"{name[:-3].upper():<19} mean {s['mean']:.1f} ms  median {s['median']:.1f} ms  "
                     f"p90 {s['p90']:.1f} ms  p99 {s['p99']:.1f} ms")
    print("\n".join(lines), flush=True)
    _write_json(a.json, result)
    return 0 if result["completed"] else 1


def _print(r: dict[str, Any]) -> None:
    lines = [
        f"model               {r['model']}",
        f"workload            {r['num_prompts']} prompts x {r['input_len']} tokens -> {r['output_len']} new tokens",
        f"elapsed             {r['elapsed_s']:.2f} s",
        f"output throughput   {r['output_tokens_per_s']:.1f} tok/s",
        f"total throughput    {r['total_tokens_per_s']:.1f} tok/s",
    ]
    for name in ("ttft_ms", "tpot_ms"):
        s = r[name]
        lines.append(f"{name[:4].upper():<19} mean {s['mean']:.1f} ms  median {s['median']:.1f} ms  p99 {s['p99']:.1f} ms")
    if "spec_acceptance_rate" in r:
        lines.append(f"spec decoding       {r['num_speculative_tokens']} n-gram drafts/step: acceptance "
                     f"{r['spec_acceptance_rate']:.1%}, mean accepted length {r['spec_mean_accepted_length']:.2f}")
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> int:
    return standalone_main(PROG, DESCRIPTION, _add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
