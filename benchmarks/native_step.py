"""Whole decode steps of the default model with each native kernel on and off: what the
kernel buys a step.

    python benchmarks/native_step.py                                  # every kernel, rows 1,16,64
    python benchmarks/native_step.py --kernels qk_norm_rope --rows 64 --rounds 7

Kernels (each one's general path is what runs when it is off):
- paged_decode: decode attention read from the paged cache in place
  (executor/torch/paged_decode.c; off: gather the blocks, then SDPA);
- qk_norm_rope: the q/k heads' RMSNorm and RoPE in one pass (models/layers/qk_norm_rope.c;
  off: the eager chain);
- residual_norms: each residual add with the RMSNorms around it (models/layers/residual_norms.c;
  off: the eager chain);
- act_mul: the MLP's act(gate) * up from a table of the activation's values
  (models/layers/act_mul.c; off: the eager activation and multiply);
- decode_stack: a decode step's layers in one native call (models/arch/decode_stack.c,
  calling the kernels above; off: the decoder's loop calling them from Python).
The four kernels' A/B runs the loop (the stack off on both sides): the stack calls them
from C whatever the module globals say.
For each kernel and row count, R random-id prompts of 8-64 tokens are generated greedily,
on and off alternating within each round; a step's time is (generate N+1 tokens -
generate 1) / N, and the median over rounds is printed with the ratio and how many
requests' tokens the two agree on (the kernels round differently from their general
paths: paged_decode keeps attention's probabilities in float32, the norms' kernels sum
squares exactly). Prints CPU flags, load, commit and threads.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's hybridserve, whatever is installed

from common import torch_header  # noqa: E402
from hybridserve import LLM, SamplingParams  # noqa: E402
from hybridserve.executor.torch import attention  # noqa: E402
from hybridserve.executor.torch.paged_decode import paged_decode  # noqa: E402
from hybridserve.models.arch import decoder  # noqa: E402
from hybridserve.models.layers.act_mul import act_mul_kernel  # noqa: E402
from hybridserve.models.layers.qk_norm_rope import qk_norm_rope_kernel  # noqa: E402
from hybridserve.models.layers.residual_norms import residual_norms_kernel  # noqa: E402

# name -> (module whose global the model's code looks the kernel up in, that global's name, the getter)
KERNELS = {
    "paged_decode": (attention, "paged_decode", paged_decode),
    "qk_norm_rope": (decoder, "qk_norm_rope_kernel", qk_norm_rope_kernel),
    "residual_norms": (decoder, "residual_norms_kernel", residual_norms_kernel),
    "act_mul": (decoder, "act_mul_kernel", act_mul_kernel),
}
STACK = "decode_stack"  # switched on the model (its decode_stack attribute), not by a module global


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernels", default=",".join([*KERNELS, STACK]),
                   help=f"comma-separated, of {', '.join([*KERNELS, STACK])}")
    p.add_argument("--rows", default="1,16,64")
    p.add_argument("--steps", type=int, default=32, help="decode steps per timed generate")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the engine's governor)")
    a = p.parse_args()
    names = a.kernels.split(",")
    if unknown := [n for n in names if n not in KERNELS and n != STACK]:
        print(f"error: unknown kernel {unknown[0]!r}; choose from {', '.join([*KERNELS, STACK])}", file=sys.stderr)
        return 2
    built = {n: KERNELS[n][2]() for n in names if n != STACK}
    if missing := [n for n, k in built.items() if k is None]:
        print(f"error: the {missing[0]} kernel could not be built (no C compiler?)", file=sys.stderr)
        return 2
    print(torch_header(a.threads, ("avx2", "avx512f", "avx512_bf16", "amx")))
    print(f"default model, greedy, {a.steps} decode steps per timed generate, {a.rounds} rounds, on / off alternating")
    print("| kernel | rows | on ms / step | off ms / step | off / on | same tokens |")
    print("|---|---:|---:|---:|---:|---:|")
    llm = LLM(None, progress=False, enable_prefix_caching=False, num_threads=a.threads)
    model = llm.parts.engine.executor.runner.model
    stack = getattr(model, "decode_stack", None)
    if STACK in names and stack is None:
        print("error: the default model has no decode stack here (no C compiler?)", file=sys.stderr)
        llm.shutdown()
        return 2
    try:
        for name in names:
            for rows in (int(r) for r in a.rows.split(",")):
                rng = random.Random(rows)
                batch = [[rng.randrange(5, 262000) for _ in range(rng.randint(8, 64))] for _ in range(rows)]

                def generate(on: bool, tokens: int):  # type: ignore[no-untyped-def]
                    if name == STACK:
                        model.decode_stack = stack if on else None
                    else:
                        model.decode_stack = None
                        module, attr, _ = KERNELS[name]
                        setattr(module, attr, (lambda: built[name]) if on else (lambda: None))
                    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
                    t = time.perf_counter()
                    out = llm.generate(batch, params, use_tqdm=False)
                    return time.perf_counter() - t, [o.outputs[0].token_ids for o in out]

                for on in (True, False):
                    generate(on, 4)  # warm-up: this batch's step sizes
                times: dict[bool, list[float]] = {True: [], False: []}
                tokens = {}
                for _ in range(a.rounds):
                    for on in (True, False):
                        whole, tokens[on] = generate(on, a.steps + 1)
                        first, _ = generate(on, 1)
                        times[on].append((whole - first) / a.steps * 1e3)
                if name != STACK:
                    module, attr, getter = KERNELS[name]
                    setattr(module, attr, getter)
                model.decode_stack = stack
                fast, general = statistics.median(times[True]), statistics.median(times[False])
                same = sum(x == y for x, y in zip(tokens[True], tokens[False]))
                print(f"| {name} | {rows} | {fast:.1f} | {general:.1f} | {general / fast:.2f} | {same} / {rows} |")
    finally:
        llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
