"""Gemma 3 270M (the default model): load time and output tokens/s next to HF generate.

    python benchmarks/gemma_bench.py                 # everything, markdown table at the end
    python benchmarks/gemma_bench.py --skip-first-start --skip-hf --repeat 1

Workload (as the peer kit's vllm_cpu/workload.py with --prompts-file prompts16.json,
copied here as benchmarks/prompts16.json): the 16 text prompts tokenized with the model's tokenizer (HF
`tok(text)["input_ids"]`, BOS included), 64 new tokens each, greedy, ignore EOS, float32;
2 warmup prompts of 16 random ids (seed 1_000_003, ids 5..vocab-1) first. Reported:
- first start: a fresh $HYBRIDSERVE_CACHE_DIR in a temp folder, `LLM()` in a new process
  (assemble the GGUF, dequantize, cache) until it is ready; cached start: the same again;
- output tok/s: 16 x 64 tokens submitted at once, median of --repeat runs (prefix caching
  off, so a repeat recomputes its prompts as HF does; up to commit 9c18591 it was on);
- HF generate at batch 8 (left padding, EOS off), same prompts, median of --hf-repeat runs,
  and how many of the 16 streams match ours token for token.
Load on the machine (other processes) is printed next to the numbers: on 2 shared cores it
moves them a lot.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_baseline import left_padded_generate  # noqa: E402  (this folder is on sys.path)

# The peer kit's 16 prompts, copied next to this script so a fresh clone runs it.
PROMPTS_FILE = Path(__file__).resolve().parent / "prompts16.json"
WARMUP_SEED, WARMUP_LEN, WARMUP_COUNT, TOKEN_LOW = 1_000_003, 16, 2, 5
_START_SNIPPET = (
    "import time; t0 = time.perf_counter(); from hybridserve import LLM; "
    "llm = LLM(progress=False); print(round(time.perf_counter() - t0, 3))"
)


def timed_start(cache_dir: str) -> float:
    """Seconds for `LLM()` (default model) in a new process with the given cache folder."""
    env = dict(os.environ, HYBRIDSERVE_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, "-c", _START_SNIPPET], env=env, capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[1])
    return float(out.stdout.strip().splitlines()[-1])


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def build_prompts(model_dir: Path, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    texts = json.loads(PROMPTS_FILE.read_text())[:16]
    prompts = [tok(t)["input_ids"] for t in texts]
    rng = random.Random(WARMUP_SEED)
    warmup = [[rng.randint(TOKEN_LOW, vocab - 1) for _ in range(WARMUP_LEN)] for _ in range(WARMUP_COUNT)]
    return prompts, warmup


def run_ours(model_dir: Path, prompts: list[list[int]], warmup: list[list[int]], new_tokens: int,
             repeat: int, async_scheduling: bool) -> tuple[float, list[float], list[list[int]]]:
    """(median output tok/s, all run seconds, output ids) through hybridserve.LLM."""
    from hybridserve import LLM, SamplingParams

    # Prefix caching off: the repeats reuse the prompts, and HF recomputes them every time.
    llm = LLM(model=str(model_dir), async_scheduling=async_scheduling, max_model_len=1024,
              enable_prefix_caching=False, progress=False)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(warmup, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    times, ids = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
        ids = [list(o.outputs[0].token_ids) for o in outs]
    n_out = sum(len(x) for x in ids)
    return n_out / statistics.median(times), times, ids


def run_hf(model_dir: Path, prompts: list[list[int]], warmup: list[list[int]], new_tokens: int, batch: int,
           repeat: int) -> tuple[float, list[float], list[list[int]]]:
    """(median output tok/s, all run seconds, output ids) through HF generate, left-padded batches."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    gen_cfg = model.generation_config
    gen_cfg.eos_token_id = None  # never stop early (ignore_eos)
    gen_cfg.do_sample = False
    for name in ("temperature", "top_p", "top_k"):
        if getattr(gen_cfg, name, None) is not None:
            setattr(gen_cfg, name, None)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def run_batch(rows: list[list[int]], max_new: int) -> list[list[int]]:
        return left_padded_generate(model, rows, max_new, pad_id)

    run_batch(warmup, 4)
    times, ids = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        ids = [row for s in range(0, len(prompts), batch) for row in run_batch(prompts[s:s + batch], new_tokens)]
        times.append(time.perf_counter() - t0)
    return sum(len(x) for x in ids) / statistics.median(times), times, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--hf-repeat", type=int, default=1)
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--skip-first-start", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--sync", action="store_true", help="also measure sync scheduling")
    args = ap.parse_args()

    from hybridserve.models.loaders.default_model import default_model_path
    from hybridserve.models.config import load_model_config

    rows: list[tuple[str, str, str]] = []
    if not args.skip_first_start:
        with tempfile.TemporaryDirectory(prefix="hs-gemma-cache-") as cache:
            first = timed_start(cache)
            rows.append(("first start (assemble + convert + load), s", f"{first:.1f}", load_avg()))
            cached = timed_start(cache)
            rows.append(("cached start, s", f"{cached:.1f}", load_avg()))
        print(f"first start {first:.1f}s, cached start {cached:.1f}s", flush=True)

    model_dir = default_model_path(progress=False)
    prompts, warmup = build_prompts(model_dir, load_model_config(model_dir).vocab_size)
    modes = [True, False] if args.sync else [True]
    ours_ids: list[list[int]] = []
    for is_async in modes:
        tok_s, times, ids = run_ours(model_dir, prompts, warmup, args.new_tokens, args.repeat, is_async)
        ours_ids = ours_ids or ids
        label = f"hybridserve ({'async' if is_async else 'sync'}), output tok/s"
        rows.append((label, f"{tok_s:.1f}", load_avg()))
        print(f"{label}: {tok_s:.1f} (runs {[round(t, 2) for t in times]} s)", flush=True)
    if not args.skip_hf:
        tok_s, times, hf_ids = run_hf(model_dir, prompts, warmup, args.new_tokens, args.hf_batch, args.hf_repeat)
        same = sum(a == b for a, b in zip(ours_ids, hf_ids))
        label = f"HF generate (batch {args.hf_batch}), output tok/s"
        rows.append((label, f"{tok_s:.1f}", load_avg()))
        rows.append(("streams equal to HF (of 16)", str(same), ""))
        print(f"{label}: {tok_s:.1f} (runs {[round(t, 2) for t in times]} s); {same}/16 streams equal", flush=True)

    print(f"\n16 prompts x {args.new_tokens} new tokens, greedy, float32, {os.cpu_count()} cores\n")
    print("| measure | value | load avg (1/5/15 min) |")
    print("|---|---|---|")
    for name, value, load in rows:
        print(f"| {name} | {value} | {load} |")


if __name__ == "__main__":
    main()
