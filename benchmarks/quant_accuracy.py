"""Accuracy of each reduced-precision mode against float32 on the default model (Gemma 3 270M).

    python benchmarks/quant_accuracy.py                      # bf16, bf16+int8, bf16+int4, fp32+int8
    python benchmarks/quant_accuracy.py --modes bfloat16/none --max-tokens 32
    python benchmarks/quant_accuracy.py --isa avx2 --modes auto/auto   # as on a CPU with AVX2 alone

Greedy streams of the peer kit's 16 text prompts (benchmarks/prompts16.json, its copy), 128
new tokens, EOS ignored, each chosen token's logprob recorded; each mode is compared with the
float32 / no-quantization run by hybridserve.models.accuracy.drift: token agreement (common
prefix / all tokens), identical streams, mean and max |logprob difference| of the chosen tokens
over the common prefixes. Prints a markdown table with the CPU flags, load and commit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's hybridserve, whatever is installed

from common import checkout_commit, isa_limits, rerun_as_avx2  # noqa: E402
from hybridserve.models.accuracy import drift, greedy_streams  # noqa: E402
from hybridserve.models.platform.cpu_features import read_cpu_flags  # noqa: E402

PROMPTS_FILE = REPO / "benchmarks" / "prompts16.json"  # the peer kit's 16 text prompts


def streams(dtype: str, quantization: str, prompts: list[str], max_tokens: int) -> list:
    from hybridserve import LLM

    llm = LLM(None, dtype=dtype, quantization=quantization, progress=False)
    try:
        return greedy_streams(llm, prompts, max_tokens)
    finally:
        llm.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="bfloat16/none,bfloat16/int8,bfloat16/int4,float32/int8",
                   help="comma-separated DTYPE/QUANTIZATION, each compared with float32/none")
    p.add_argument("--prompts-file", type=Path, default=PROMPTS_FILE)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--isa", choices=["native", "avx2"], default="native",
                   help="avx2: measure as on a CPU with AVX2 alone (oneDNN, fbgemm and ATen limited to AVX2, "
                        "hybridserve choosing from such a CPU's flags)")
    a = p.parse_args()
    if a.isa == "avx2" and (rc := rerun_as_avx2()) is not None:
        return rc
    prompts = json.loads(a.prompts_file.read_text())
    commit = checkout_commit()
    flags = sorted(f for f in read_cpu_flags() if f.startswith(("avx512", "amx", "avx2")))
    print(f"# commit {commit}; {len(prompts)} prompts x {a.max_tokens} tokens; CPU flags: {' '.join(flags)}; "
          f"{isa_limits()}")
    reference = streams("float32", "none", prompts, a.max_tokens)
    print("| mode | token agreement | identical streams | mean abs dlogprob | max abs dlogprob | load |")
    print("|---|---:|---:|---:|---:|---|")
    for mode in a.modes.split(","):
        dtype, _, quantization = mode.partition("/")
        d = drift(reference, streams(dtype, quantization or "none", prompts, a.max_tokens))
        load = "/".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"| {mode} | {d.token_agreement:.3f} | {d.identical_streams}/{d.num_streams} | "
              f"{d.mean_abs_logprob_diff:.4f} | {d.max_abs_logprob_diff:.4f} | {load} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
