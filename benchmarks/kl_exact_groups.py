"""Next-token KL divergence from float32 of the decoder the GGUF's exact int8 groups would give,
beside the default's, in one run.

    python benchmarks/kl_exact_groups.py --max-tokens 64

benchmarks/group_int8_native.py's kernels multiply bf16 activations by the file's values
exactly, in float32 sums, and round the output to bf16 once. That arithmetic is emulated
here without the kernels: the default model at `bfloat16/int8-head` (bf16 activations
and element-wise work, the int8 x int8 head) with every decoder matmul replaced by the
float32 model's packed float32 linear (the GGUF's values dequantized to float32: the
file's values) on the bf16 input's values, its output (residual add included) rounded to
bf16 once. Scored as benchmarks/kl_accuracy.py scores a mode (the same reference, KL and
greedy agreement; its helpers are used), beside `auto` (bf16 weights) in the same run:
does holding the file's values instead of their bf16 roundings make the default more
accurate, and by how much?
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's hybridserve, whatever is installed

import kl_accuracy  # noqa: E402  (this folder is on sys.path)
from common import checkout_commit  # noqa: E402
from cpu_peers import cpu_description  # noqa: E402
from quant_accuracy import PROMPTS_FILE  # noqa: E402

EXACT = "bfloat16/int8-head + the file's exact decoder values"
_BASE_MODE = "bfloat16/int8-head"


def _rounded(linears: Any) -> Any:  # LayerLinears of a float32 model -> the same taking and giving bf16
    import torch

    from hybridserve.models.layers.linear import LayerLinears

    def plain(f: Callable) -> Callable:
        return lambda x: f(x.float()).to(torch.bfloat16)

    def residual(f: Callable) -> Callable:
        return lambda h, x: f(h.float(), x.float()).to(torch.bfloat16)

    return LayerLinears(*(residual(f) if name.endswith("_residual") else plain(f)
                          for name, f in zip(LayerLinears._fields, linears)))


def _open_exact(open_llm: Callable, opened: list[Any]) -> Any:  # type: ignore[no-untyped-def]
    """The base mode's LLM (opened by kl_accuracy's `open_llm`) with its decoder's matmuls on
    the float32 model's weights (both LLMs kept in `opened` for shutdown)."""
    exact = open_llm("float32/none")
    opened.append(exact)
    llm = open_llm(_BASE_MODE)
    opened.append(llm)
    model, source = llm.parts.engine.executor.model, exact.parts.engine.executor.model
    if getattr(model, "int8_layers", True) or len(model._linears) != len(source._linears):
        raise SystemExit(f"kl_exact_groups: {_BASE_MODE} does not hold a bf16 decoder here")
    model._linears = [_rounded(l32) for l32 in source._linears]
    return llm


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts-file", type=Path, default=PROMPTS_FILE)
    p.add_argument("--max-tokens", type=int, default=128, help="continuation tokens per prompt (scored positions)")
    a = p.parse_args()
    prompts = json.loads(a.prompts_file.read_text())
    open_llm = kl_accuracy.open_llm
    with tempfile.TemporaryDirectory(prefix="kl_exact_groups-") as tmp:
        work = Path(tmp)
        print(f"# commit {checkout_commit()}; {cpu_description()}; {len(prompts)} prompts x {a.max_tokens} "
              f"teacher-forced positions; load {'/'.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
        seqs, reference, _, _ = kl_accuracy.run_reference(prompts, a.max_tokens, work)
        print("| run | mean KL (nats) | max KL | same top token | greedy agreement | identical streams | "
              "mean abs dlogprob | load |")
        print("|---|---:|---:|---:|---:|---:|---:|---|", flush=True)
        for mode in ("auto", EXACT):
            opened: list[Any] = []
            if mode == EXACT:  # run_mode opens its LLM through kl_accuracy.open_llm and shuts it down
                kl_accuracy.open_llm = lambda _mode: _open_exact(open_llm, opened)
            try:
                kl, d, kv_dtype = kl_accuracy.run_mode(mode, seqs, reference, work)
            finally:
                kl_accuracy.open_llm = open_llm
                for llm in opened[:-1]:  # the last is the one run_mode shut down
                    llm.shutdown()
            name = EXACT if mode == EXACT else kl_accuracy.resolved(mode, kv_dtype)
            print(kl_accuracy.table_row(f"hybridserve {name}", kl, d), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
