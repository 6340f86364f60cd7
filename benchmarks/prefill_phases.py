"""Where a 64 x 64 prefill's time goes: 64 prompts of 64 random ids -> 1 token each (temperature
1, the served default) in one 4096-token step, profiled with torch.profiler and its ops'
self time summed per phase (the int8 GEMMs, the row-scale multiplies after them, the
compiled element-wise chains, attention's SDPA, dtype copies and gathers, the KV write,
the head), with the step's wall time and the process's minor page faults per step.

    python benchmarks/prefill_phases.py [--threads N] [--rounds R]

Phases are shares of one profiled step: compare two checkouts by running this in each,
alternately, and reading ratios (the profiler adds its own cost to every op).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's hybridserve, whatever is installed

from common import checkout_commit  # noqa: E402

ATTENTION_SHAPES = ("256]", "64, 64]")  # q/k/v of Gemma 3 270M's heads, the 64 x 64 masks


def phase(name: str, shapes: str) -> str:
    """The phase a profiled op belongs to, from its name and input shapes."""
    if name == "onednn::qlinear_pointwise":
        return "int8 GEMM, head" if "32768" in shapes else "int8 GEMM, decoder"
    if name == "aten::mul_" and ", 1]]" in shapes:
        return "row-scale multiply after a GEMM"
    if any(k in name for k in ("CompiledFxGraph", "Torch-Compiled Region", "TorchDynamo", "Pregraph", "AOTDispatcher")):
        return "compiled element-wise chains"
    if "scaled_dot_product" in name:
        return "attention: SDPA"
    if name in ("aten::copy_", "aten::_to_copy", "aten::to") and any(s in shapes for s in ATTENTION_SHAPES):
        return "attention: dtype copies"
    if name in ("aten::index", "aten::_index_put_impl_", "aten::index_put_"):
        return "attention: gathers and scatters"
    if name == "aten::index_copy_":
        return "KV cache write"
    return "other"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    import torch

    from hybridserve import LLM, SamplingParams
    from hybridserve.config import EngineConfig

    llm = LLM(config=EngineConfig(enable_prefix_caching=False, max_num_batched_tokens=4096, num_threads=a.threads),
              progress=False)
    rng = random.Random(0)
    vocab = llm.parts.model_config.vocab_size
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=1.0)

    def prefill() -> None:
        llm.generate([[rng.randrange(5, vocab) for _ in range(64)] for _ in range(64)], params, use_tqdm=False)

    for _ in range(2):  # the compiled chains build on the first
        prefill()
    walls, faults = [], []
    for _ in range(a.rounds):
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        prefill()
        walls.append(round(time.perf_counter() - t0, 3))
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    with torch.profiler.profile(record_shapes=True) as prof:
        prefill()
    ms: dict[str, float] = defaultdict(float)
    for e in prof.key_averages(group_by_input_shape=True):
        ms[phase(e.key, str(e.input_shapes))] += e.self_cpu_time_total / 1e3
    llm.shutdown()
    print(json.dumps({"commit": checkout_commit(), "threads": a.threads, "walls_s": walls, "minor_faults": faults,
                      "profiled_ms": {k: round(v, 1) for k, v in sorted(ms.items(), key=lambda kv: -kv[1])}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
