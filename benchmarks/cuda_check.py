"""Check the engine on a CUDA device: every tiny family's greedy tokens on CUDA against the
same engine on the CPU and against HF transformers' greedy tokens (its CPU float32 oracle).

For each family of tests/helpers/hf_tiny.py and hf_tiny_mamba.py, sync and async
scheduling: three prompts of 40-120 tokens, 12 greedy tokens each, float32. Then KV
offload (pinned host blocks, the CUDA copy stream): a pool too small for two prompts,
prompts one at a time and the first again, so its prefix comes back from host memory.
The CPU suite never runs the CUDA paths (offload's copy stream and events, device
placement of every state buffer); this script is how a machine with a GPU checks them.

    python benchmarks/cuda_check.py            # needs torch with CUDA and a GPU

Prints one line per case: `cuda==cpu` (the engine agrees with itself across devices:
the claim this script checks; exit 1 if not) and `==hf` (against the installed
transformers' implementation of the family, which may differ by version from the
one the CPU suite pins).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROMPTS_SEED = 7
NEW_TOKENS = 12
OFFLOAD_LEN = 160


def generate(model_dir: Path, device: str, prompts: list[list[int]], one_at_a_time: bool,
             **options: object) -> tuple[list[list[int]], object]:
    from hybridserve import LLM, SamplingParams
    from hybridserve.config import EngineConfig

    def make(**opts: object) -> LLM:
        return LLM(config=EngineConfig(model=str(model_dir), device=device, dtype="float32", **opts),
                   progress=False)

    try:
        llm = make(**options)
    except Exception as e:  # a pool sized for another family: take the smallest that works
        m = re.search(r"smallest num_blocks that works is (\d+)", str(e))
        if m is None:
            raise
        llm = make(**{**options, "num_blocks": int(m.group(1))})
    params = SamplingParams(max_tokens=NEW_TOKENS)
    try:
        if one_at_a_time:
            outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.parts.engine.scheduler.make_stats()
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs], stats


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    import torch
    import transformers

    from tests.helpers import hf_tiny, hf_tiny_mamba

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {name}")
    prompts = hf_tiny.random_prompts(3, 40, 120, seed=PROMPTS_SEED)
    families = [(k, hf_tiny) for k in ("llama", "mistral", "qwen2", "gemma2", "gemma3", "olmo3", "cohere2",
                                       "exaone4", "llama4", "gpt_oss")]
    families += [(k, hf_tiny_mamba) for k in ("mamba2", "bamba", "granite", "nemotron_h", "falcon_h1",
                                              "qwen3_next", "lfm2", "jamba")]
    cases = [(k, h, {"async_scheduling": a, "max_model_len": 256}, False) for k, h in families for a in (False, True)]
    offload = {"num_blocks": 12, "max_num_seqs": 1, "kv_offload_memory": "1MiB", "enable_prefix_caching": True,
               "max_model_len": OFFLOAD_LEN}
    cases += [(k, h, {**offload, "async_scheduling": a}, True)
              for k, h in ((("llama", hf_tiny), ("gemma3", hf_tiny), ("bamba", hf_tiny_mamba))) for a in (False, True)]
    disagree = 0
    for kind, helper, options, one_at_a_time in cases:
        t0 = time.perf_counter()
        model_dir = helper.tiny_model_dir(kind)
        batch = prompts + prompts[:1] if one_at_a_time else prompts
        hf = [helper.oracle(kind, q, NEW_TOKENS)[0] for q in batch]
        on_device, stats = generate(model_dir, args.device, batch, one_at_a_time, **options)
        on_cpu, _ = generate(model_dir, "cpu", batch, one_at_a_time, **options)
        disagree += on_device != on_cpu
        loads = (f", offloaded {stats.num_offloaded_blocks} loaded {stats.num_offload_loaded_blocks} blocks"
                 if one_at_a_time else "")
        print(f"{kind:11s} {'async' if options['async_scheduling'] else 'sync '}"
              f"{' offload' if one_at_a_time else '        '}  {args.device}==cpu {on_device == on_cpu!s:5s}"
              f"  ==hf {on_device == hf!s:5s}  {time.perf_counter() - t0:.1f} s{loads}", flush=True)
    print(f"{disagree} of {len(cases)} cases differ between {args.device} and cpu")
    return 1 if disagree else 0


if __name__ == "__main__":
    sys.exit(main())
