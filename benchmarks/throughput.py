"""Throughput of hybridserve's engine (TorchExecutor) next to HF transformers generate.

    python benchmarks/throughput.py --model tiny-mistral --repeat 5 --hf
    python benchmarks/throughput.py --model tiny-gemma3 --repeat 5 --hf
    python benchmarks/throughput.py --model tiny-llama4 --repeat 5 --hf
    python benchmarks/throughput.py --model tiny-mamba2 --repeat 5 --hf    (also tiny-bamba)
    python benchmarks/throughput.py --model /path/to/hf_dir --prompts-file prompts.json --hf

N prompts are submitted at once; greedy, ignore EOS, exactly M new tokens each. Reported:
output tokens/s (median of --repeat timed runs; warmup excluded), mean time to first
token and mean time per output token, for sync and async scheduling, and HF generate
with left-padded batches as the baseline (same prompts; the token match count is a
cross-check). Prompts are those of the peer kit in shared/peers/vllm_cpu (workload.py):
random ids from random.Random(seed), lengths in [min, max], ids in [token_low, vocab).
The tiny models are the kit's `--tiny` models (hidden 128, 4 layers, 4/2 heads, vocab
512, window 16, initializer_range 0.3, seed 0), built with transformers on first use;
tiny-llama4 (not in the kit) is the same size with chunks of 32 on 3 of 4 layers, a
NoPE global layer, and 4 experts (top-1) on every other layer.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_baseline import left_padded_generate  # noqa: E402  (this folder is on sys.path)

from hybridserve.core.kv.spec import DEFAULT_BLOCK_SIZE  # noqa: E402

TINY = ("tiny-mistral", "tiny-gemma3", "tiny-llama4", "tiny-mamba2", "tiny-bamba")


def build_tiny(kind: str, out_dir: Path, window: int = 16, seed: int = 0) -> Path:
    import torch
    from transformers import (AutoModelForCausalLM, BambaConfig, Gemma3TextConfig, Llama4TextConfig, Mamba2Config,
                              MistralConfig)

    common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  initializer_range=0.3, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                  eos_token_id=None)
    # Mamba models: 8 heads of 32 channels (expand 2), state 32, SSD chunks of 16;
    # tiny-bamba has attention at layer 2 of 4 (its KV cache and 3 Mamba state groups share the pool).
    mamba = dict(vocab_size=512, hidden_size=128, num_hidden_layers=4, initializer_range=0.3,
                 tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    if kind == "tiny-mistral":
        config = MistralConfig(sliding_window=window, **common)
    elif kind == "tiny-llama4":
        config = Llama4TextConfig(head_dim=32, intermediate_size_mlp=256, num_local_experts=4, num_experts_per_tok=1,
                                  interleave_moe_layer_step=2, attention_chunk_size=2 * window, **common)
    elif kind == "tiny-mamba2":
        config = Mamba2Config(num_heads=8, head_dim=32, state_size=32, n_groups=1, chunk_size=16, **mamba)
    elif kind == "tiny-bamba":
        config = BambaConfig(intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                             attn_layer_indices=[2], mamba_n_heads=8, mamba_d_state=32, mamba_n_groups=1,
                             mamba_chunk_size=16, max_position_embeddings=4096, **mamba)
    else:
        config = Gemma3TextConfig(head_dim=32, query_pre_attn_scalar=32, sliding_window=window,
                                  layer_types=["sliding_attention"] * 3 + ["full_attention"], **common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.save_pretrained(out_dir)
    return out_dir


def model_dir(args: argparse.Namespace) -> Path:
    if args.model not in TINY:
        return Path(args.model)
    d = Path(args.cache_dir).expanduser() / args.model
    if not (d / "config.json").exists():
        d.mkdir(parents=True, exist_ok=True)
        build_tiny(args.model, d)
    return d


def build_prompts(args: argparse.Namespace, mdir: Path) -> list[list[int]]:
    if args.prompts_file:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(mdir))
        texts = json.loads(Path(args.prompts_file).read_text())[: args.num_prompts]
        return [tok(t)["input_ids"] for t in texts]
    vocab = json.loads((mdir / "config.json").read_text())["vocab_size"]
    rng = random.Random(args.seed)
    prompts = []
    for _ in range(args.num_prompts):
        length = rng.randint(args.min_prompt_len, args.max_prompt_len)
        prompts.append([rng.randint(args.token_low, vocab - 1) for _ in range(length)])
    return prompts


Run = tuple[float, list[list[int]], list[float], list[float]]  # seconds, tokens, TTFTs, TPOTs
Runner = tuple[Callable[[], Run], Callable[[], None], float]  # generate, close, startup seconds


def engine_runner(args: argparse.Namespace, mdir: Path, prompts: list[list[int]], mode: str) -> Runner:
    """A warmed-up engine; returns (generate() -> Run, close(), startup seconds).

    mode: sync | async (runner in its worker thread) | async-inline (async scheduling,
    each step executed at dispatch in the calling thread: no GIL hand-offs on CPU).
    """
    from hybridserve.core.request import Request, SamplingParams
    from hybridserve.core.sched.config import SchedulerConfig
    from hybridserve.engine.loop import build_engine
    from hybridserve.executor.torch.executor import TorchExecutor

    t0 = time.perf_counter()
    ex = TorchExecutor(mdir, device=args.device, use_worker_thread=mode == "async")
    max_len = max(len(p) for p in prompts) + args.max_new_tokens + 1
    cfg = SchedulerConfig(max_model_len=max_len, async_scheduling=mode != "sync", max_num_seqs=args.num_prompts,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          enable_prefix_caching=args.prefix_caching)
    engine = build_engine(cfg, ex.kv_cache_config(args.block_size, kv_cache_memory=args.kv_cache_memory), ex)
    startup_s = time.perf_counter() - t0
    run_id = [0]

    def generate(batch: list[list[int]] = prompts, max_tokens: int = args.max_new_tokens) -> Run:
        run_id[0] += 1
        ids = [f"{run_id[0]}-{i}" for i in range(len(batch))]
        start = time.perf_counter()
        for rid, p in zip(ids, batch):
            engine.add_request(Request(rid, p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        while engine.has_unfinished_requests():
            _, outs = engine.step()
            now = time.perf_counter()
            for o in outs:
                if o.new_token_ids:
                    first.setdefault(o.request_id, now)
                    last[o.request_id] = now
                    tokens[o.request_id].extend(o.new_token_ids)
        gen_s = time.perf_counter() - start
        ttft = [first[r] - start for r in ids]
        tpot = [(last[r] - first[r]) / (len(tokens[r]) - 1) for r in ids if len(tokens[r]) > 1]
        return gen_s, [tokens[r] for r in ids], ttft, tpot

    generate([[5] * 16, [6] * 16], 4)  # warmup
    return generate, engine.shutdown, startup_s


def hf_runner(args: argparse.Namespace, mdir: Path, prompts: list[list[int]]) -> Runner:
    """HF generate over left-padded batches; returns (generate() -> Run, close(), startup seconds)."""
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model_type = json.loads((mdir / "config.json").read_text()).get("model_type")
    attn = {"gemma2": "eager", "mamba2": None}.get(model_type, "sdpa")  # Mamba2 has no attention to choose
    kwargs = {} if attn is None else {"attn_implementation": attn}
    model = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32, **kwargs).eval()
    model.generation_config.eos_token_id = None
    pad = model.config.pad_token_id or 0
    startup_s = time.perf_counter() - t0

    def batch_generate(batch: list[list[int]], max_new: int) -> list[list[int]]:
        return left_padded_generate(model, batch, max_new, pad)

    def generate() -> Run:
        start = time.perf_counter()
        outputs: list[list[int]] = []
        for s in range(0, len(prompts), args.hf_batch_size):
            outputs += batch_generate(prompts[s : s + args.hf_batch_size], args.max_new_tokens)
        return time.perf_counter() - start, outputs, [], []

    batch_generate([[5] * 16, [6] * 16], 4)  # warmup
    return generate, lambda: None, startup_s


def summarize(engine: str, mode: str, startup_s: float, runs: list[Run]) -> dict:
    times = [r[0] for r in runs]
    median_run = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    n_out = sum(len(t) for t in median_run[1])
    return dict(
        engine=engine, mode=mode, startup_s=round(startup_s, 3),
        gen_s=round(statistics.median(times), 4), gen_s_all=[round(t, 4) for t in times], output_tokens=n_out,
        output_tok_s=round(n_out / statistics.median(times), 1),
        ttft_ms=round(1000 * statistics.mean(median_run[2]), 2) if median_run[2] else None,
        tpot_ms=round(1000 * statistics.mean(median_run[3]), 3) if median_run[3] else None,
        output_ids=median_run[1],
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-mistral", help=f"{' | '.join(TINY)} | an HF model directory")
    p.add_argument("--cache-dir", default="~/.cache/hybridserve/bench", help="where tiny models are written")
    p.add_argument("-n", "--num-prompts", type=int, default=16)
    p.add_argument("-m", "--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-prompt-len", type=int, default=8)
    p.add_argument("--max-prompt-len", type=int, default=64)
    p.add_argument("--token-low", type=int, default=5)
    p.add_argument("--prompts-file", help="JSON list of text prompts (tokenized with the model's tokenizer)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--modes", default="sync,async,async-inline", help="comma list of sync, async, async-inline")
    p.add_argument("--hf", action="store_true", help="also run HF generate as the baseline")
    p.add_argument("--hf-batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--prefix-caching", action="store_true", help="off by default: repeats reuse the prompts")
    p.add_argument("--out", help="also write the JSON results here")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    mdir = model_dir(args)
    prompts = build_prompts(args, mdir)
    runners = [("hybridserve", m, *engine_runner(args, mdir, prompts, m)) for m in args.modes.split(",") if m]
    if args.hf:
        runners.append(("hf-generate", f"batch={args.hf_batch_size}", *hf_runner(args, mdir, prompts)))
    # Interleave the timed repeats so that load drifting on a shared machine hits every
    # runner alike; each figure is the median of its repeats.
    runs: list[list[Run]] = [[] for _ in runners]
    for _ in range(max(1, args.repeat)):
        for k, (_, _, generate, _, _) in enumerate(runners):
            runs[k].append(generate())
    results = [summarize(e, m, st, r) for (e, m, _, _, st), r in zip(runners, runs)]
    for _, _, _, close, _ in runners:
        close()
    ref = results[-1]["output_ids"] if args.hf else None
    print(f"model={args.model} prompts={len(prompts)} new_tokens={args.max_new_tokens} "
          f"threads={torch.get_num_threads()} repeat={args.repeat}")
    print(f"{'engine':<12} {'mode':<24} {'tok/s':>9} {'gen_s':>8} {'TTFT ms':>8} {'TPOT ms':>8} {'==HF':>6}")
    for r in results:
        match = "" if ref is None else f"{sum(a == b for a, b in zip(r['output_ids'], ref))}/{len(ref)}"
        print(f"{r['engine']:<12} {r['mode']:<24} {r['output_tok_s']:>9.1f} {r['gen_s']:>8.3f} "
              f"{r['ttft_ms'] if r['ttft_ms'] is not None else '-':>8} "
              f"{r['tpot_ms'] if r['tpot_ms'] is not None else '-':>8} {match:>6}")
    summary = [{k: v for k, v in r.items() if k != "output_ids"} for r in results]
    line = json.dumps(dict(model=args.model, threads=torch.get_num_threads(), results=summary))
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
