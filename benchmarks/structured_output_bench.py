"""What a grammar mask costs per decode step: constrained against unconstrained decoding.

Both sides generate exactly the same number of tokens per request (the constraint is a
regex of exactly --tokens characters from a set, greedy, ignore_eos for the free side),
so the difference is the mask: building it (llguidance) and applying it (one masked
row per request). Runs interleaved, median of --repeat timed rounds after a warm-up.

    python benchmarks/structured_output_bench.py                     # byte-level tiny model
    python benchmarks/structured_output_bench.py --model PATH-OR-GGUF --tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model (default: the byte-level tiny test model)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dtype", default=None)
    args = ap.parse_args()
    from hybridserve import LLM, SamplingParams, StructuredOutput

    if args.model is None:
        from tests.helpers.structured_models import byte_model_dir

        model = str(byte_model_dir())
    else:
        model = args.model
    extra = {"dtype": args.dtype} if args.dtype else {}
    llm = LLM(model, max_model_len=512, progress=False, **extra)
    prompts = [f"Item {i}: write some letters." for i in range(args.prompts)]
    # Letters and spaces, one token at a time for byte-level tokenizers; any tokenizer can
    # spell it, so the constraint never ends a request early.
    regex = f"[a-z ]{{{args.tokens}}}"
    free = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.tokens, ignore_eos=True,
                                 structured_output=StructuredOutput("regex", regex))
    times: dict[str, list[float]] = {"free": [], "constrained": []}
    tokens: dict[str, int] = {}
    for name, params in (("free", free), ("constrained", constrained)):  # warm-up (grammar tokenizer too)
        llm.generate(prompts, params, use_tqdm=False)
    for _ in range(args.repeat):
        for name, params in (("free", free), ("constrained", constrained)):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            times[name].append(time.perf_counter() - t0)
            tokens[name] = sum(len(o.token_ids) for o in outs)
    llm.shutdown()
    result = {}
    for name in times:
        med = statistics.median(times[name])
        result[name] = {"median_s": round(med, 4), "tokens": tokens[name], "tok_s": round(tokens[name] / med, 1),
                        "ms_per_step": round(1000 * med / args.tokens, 3)}
    result["mask_ms_per_step"] = round(result["constrained"]["ms_per_step"] - result["free"]["ms_per_step"], 3)
    result["ratio_constrained_over_free"] = round(result["constrained"]["median_s"] / result["free"]["median_s"], 3)
    print(json.dumps({"model": args.model or "tiny-byte", "prompts": args.prompts, **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
