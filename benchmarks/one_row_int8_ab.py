"""One stream's decode with the int8 decoder on two paths, interleaved: the speed cost of one path for every row count.

    python benchmarks/one_row_int8_ab.py                        # packed vs plain, 1 row, 8 rounds
    python benchmarks/one_row_int8_ab.py --rows 16 --rounds 6

The default model is loaded once; each round generates the same --rows prompts of
--prompt-tokens random ids (seed 0) x --max-tokens greedy tokens twice, once with every
W8A8Linear of the decoder on oneDNN's packed GEMM and once on torch._int_mm over the plain
rows (made from the packed copy on first use), the order alternating between rounds so both
see the same machine. The first round is a warm-up. Printed: each path's median seconds,
tokens/s, the ratio packed / plain and whether both gave the same tokens (they must: the
paths agree bit for bit). Why: models/layers/int8.choose_int8_path serves every row count on
the packed GEMM where the CPU has int8 dot products, giving up _int_mm's one-row speed to
hold the weights once (benchmarks/results/memory_peak.md).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's hybridserve, whatever is installed

from common import checkout_commit  # noqa: E402
from hybridserve import LLM, SamplingParams  # noqa: E402
from hybridserve.models.layers.int8 import PACKED, PLAIN, W8A8Linear  # noqa: E402

VOCAB_LOW, VOCAB_HIGH = 5, 256000  # random prompt ids: past the special tokens, inside Gemma 3's vocabulary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    a = p.parse_args()
    llm = LLM(progress=False)
    with warnings.catch_warnings():  # gc's walk touches deprecated torch objects
        warnings.simplefilter("ignore")
        linears = [o for o in gc.get_objects() if isinstance(o, W8A8Linear)]
    rng = random.Random(0)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    seconds: dict[str, list[float]] = {PACKED: [], PLAIN: []}
    same = True
    for r in range(a.rounds + 1):
        prompts = [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(a.prompt_tokens)] for _ in range(a.rows)]
        tokens = {}
        for path in (PACKED, PLAIN) if r % 2 else (PLAIN, PACKED):
            for linear in linears:
                linear._path = path  # the path __call__ serves (a benchmark's switch, not an API)
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            if r:
                seconds[path].append(time.perf_counter() - start)
            tokens[path] = [o.outputs[0].token_ids for o in outs]
        same = same and tokens[PACKED] == tokens[PLAIN]
    llm.shutdown()
    med = {path: statistics.median(s) for path, s in seconds.items()}
    made = a.rows * a.max_tokens
    print(f"# commit {checkout_commit()}; {len(linears)} int8 linears; {a.rows} row(s) x {a.max_tokens} tokens, "
          f"{a.rounds} rounds")
    print(f"packed {med[PACKED]:.2f} s ({made / med[PACKED]:.1f} tok/s), plain {med[PLAIN]:.2f} s "
          f"({made / med[PLAIN]:.1f} tok/s); packed / plain time {med[PACKED] / med[PLAIN]:.3f}; same tokens: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
