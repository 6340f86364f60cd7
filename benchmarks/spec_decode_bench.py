"""Speed-up of n-gram speculative decoding on a repetitive workload, spec on vs off in one run.

    python benchmarks/spec_decode_bench.py                    # tiny random Mistral only
    python benchmarks/spec_decode_bench.py --gemma            # also Gemma 3 270M via LLM()
    python benchmarks/spec_decode_bench.py --spec 0 2 4 --num-prompts 8 --output-len 96

Workloads (greedy, ignore EOS, all requests submitted at once through `LLM.generate`):
- tiny-copy: a random Mistral (hidden 256, 4 layers, vocab 512, sliding window 16, so 60
  tokens of reach) written to a temp folder. Prompt i = S + G + S + G[:4], where G is the
  model's own greedy continuation (output-len + 8 tokens) of a random S of 64 tokens: the
  second copy continues like the first (a model quoting its context), which prompt lookup
  finds. The best case for n-gram drafting.
- tiny-random: the same model on random prompts of the same length: drafts rarely match,
  so this shows what speculative decoding costs when it does not help.
- gemma (--gemma): the default model with text prompts that ask it to copy a paragraph
  that is in the prompt (the case prompt lookup is for: edits, quoting, summaries).
For each num_speculative_tokens: output tok/s (median of --repeat runs), the speed-up
against spec off, acceptance rate, mean accepted length, and whether every stream equals
the spec-off stream token for token (greedy speculative decoding must not change output).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridserve.config import EngineConfig  # noqa: E402
from hybridserve.engine.llm import LLM  # noqa: E402
from hybridserve.core.request import SamplingParams  # noqa: E402

COPY_TEXT = (
    "The quick brown fox jumps over the lazy dog near the river bank. Every morning the fox "
    "runs along the path, stops at the old bridge, and watches the boats drift slowly past. "
    "In the evening it returns home through the tall grass, tired but happy."
)


def build_tiny_model(out: Path) -> Path:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.MistralConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                           sliding_window=16, initializer_range=0.3, eos_token_id=None, bos_token_id=1,
                           pad_token_id=0, tie_word_embeddings=False)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out)
    return out


def random_prompts(n: int, length: int, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(3, 511) for _ in range(length)] for _ in range(n)]


def copy_prompts(model: str, n: int, output_len: int) -> list[list[int]]:
    """S + G + S + G[:4] with G the model's greedy continuation of S (see the module doc)."""
    heads = random_prompts(n, 64)
    with LLM(config=EngineConfig(model=model, max_model_len=1024), progress=False) as llm:
        outs = llm.generate(heads, SamplingParams(max_tokens=output_len + 8, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
    return [s + list(o.outputs[0].token_ids) + s + list(o.outputs[0].token_ids[:4]) for s, o in zip(heads, outs)]


def gemma_prompts(n: int) -> list[str]:
    sentences = COPY_TEXT.split(". ")
    prompts = []
    for i in range(n):
        text = ". ".join(sentences[i % len(sentences):] + sentences[: i % len(sentences)])
        prompts.append(f"Copy the following text exactly.\n\nText: {text}\n\nCopy: {text[:40]}")
    return prompts


def measure(model: str | None, prompts: list[Any], spec: int, output_len: int, repeat: int,
            threads: int | None) -> dict[str, Any]:
    cfg = EngineConfig(model=model, num_speculative_tokens=spec, num_threads=threads, max_model_len=1024)
    llm = LLM(config=cfg, progress=False)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    try:
        llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
        stats = llm.parts.engine.scheduler.stats
        base = (stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_spec_steps)
        times, outs = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - t0)
        drafts = stats.num_draft_tokens - base[0]
        accepted = stats.num_accepted_tokens - base[1]
        steps = stats.num_spec_steps - base[2]
    finally:
        llm.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    elapsed = statistics.median(times)
    return {"spec": spec, "tok_s": sum(map(len, tokens)) / elapsed, "elapsed": elapsed, "tokens": tokens,
            "acceptance": accepted / drafts if drafts else 0.0,
            "mean_len": 1 + accepted / steps if steps else 1.0}


def report(name: str, rows: list[dict[str, Any]]) -> None:
    base = next(r for r in rows if r["spec"] == 0)
    print(f"\n{name}  (load {' '.join(f'{x:.2f}' for x in os.getloadavg())})")
    print("| spec tokens | output tok/s | speed-up | acceptance | mean accepted length | same tokens |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        same = "yes" if r["tokens"] == base["tokens"] else "NO"
        print(f"| {r['spec']} | {r['tok_s']:.1f} | {r['tok_s'] / base['tok_s']:.2f}x | "
              f"{r['acceptance']:.1%} | {r['mean_len']:.2f} | {same} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", type=int, nargs="+", default=[0, 2, 4])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--gemma", action="store_true", help="also run the default Gemma 3 270M model")
    ap.add_argument("--skip-tiny", action="store_true")
    a = ap.parse_args()
    specs = sorted(set([0, *a.spec]))
    if not a.skip_tiny:
        with tempfile.TemporaryDirectory(prefix="spec_bench_") as tmp:
            model_dir = str(build_tiny_model(Path(tmp) / "tiny_mistral"))
            copy = copy_prompts(model_dir, a.num_prompts, a.output_len)
            for name, prompts in (("copy", copy), ("random", random_prompts(a.num_prompts, len(copy[0])))):
                rows = [measure(model_dir, prompts, s, a.output_len, a.repeat, a.num_threads) for s in specs]
                report(f"tiny Mistral (hidden 256, 4 layers), {name} workload, {a.num_prompts} prompts of "
                       f"~{len(prompts[0])} tokens -> {a.output_len} tokens", rows)
    if a.gemma:
        prompts_g = gemma_prompts(a.num_prompts)
        rows = [measure(None, prompts_g, s, a.output_len, a.repeat, a.num_threads) for s in specs]
        report(f"Gemma 3 270M (default model), {a.num_prompts} copy prompts -> {a.output_len} tokens", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
