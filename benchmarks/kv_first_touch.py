"""What touching never-used memory costs: page first touch, and prefill steps with prefix caching on and off.

    python benchmarks/kv_first_touch.py pages            # 1 GiB mappings, 2 MB vs 4 KB pages
    python benchmarks/kv_first_touch.py steps --rounds 3 # the default model's 64 x 64 prefill steps

`pages`: for each of --order (1 = MADV_HUGEPAGE, 0 = 4 KB pages), a fresh anonymous 1 GiB
mapping written once per 4 KB; prints ms per MB. Run it twice, and again after the
machine has been idle: a VM whose host backs guest memory on demand shows the cost only
for memory the guest has not used lately.

`steps`: for prefix caching off and on (one engine each, in turn, --rounds prompt sets of
64 x 64 random ids -> 2 tokens at temperature 1), each executor step's milliseconds and
token count. With caching on the block pool hands out never-used blocks first, so the
K/V writes land on pages this process has not touched.
"""

from __future__ import annotations

import argparse
import mmap
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import torch_header  # noqa: E402

GIB = 1 << 30


def pages(order: str) -> None:
    import numpy as np

    for huge in (c == "1" for c in order.split(",")):
        region = mmap.mmap(-1, GIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge:
            region.madvise(mmap.MADV_HUGEPAGE)
        view = np.frombuffer(region, dtype=np.uint8)
        start = time.perf_counter()
        view[::4096] = 1
        ms = (time.perf_counter() - start) * 1e3
        print(f"| {'2 MB (MADV_HUGEPAGE)' if huge else '4 KB'} | {ms / 1024:.2f} ms/MB |", flush=True)
        del view
        region.close()


def steps(rounds: int) -> None:
    from hybridserve import LLM, SamplingParams

    for caching in (False, True):
        llm = LLM(None, progress=False, enable_prefix_caching=caching)
        executor = llm.parts.engine.executor
        executor.prepare_large_steps()
        times: list[tuple[int, float]] = []
        run_step = executor._run_step

        def timed(so, run_step=run_step, times=times):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            out = run_step(so)
            times.append((so.total_num_scheduled_tokens, (time.perf_counter() - start) * 1e3))
            return out

        executor._run_step = timed
        vocab = llm.parts.model_config.vocab_size
        for r in range(rounds):
            rng = random.Random(r)
            prompts = [[rng.randrange(5, vocab) for _ in range(64)] for _ in range(64)]
            times.clear()
            llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True, temperature=1.0), use_tqdm=False)
            shown = ", ".join(f"{ms:.0f} ms / {n} tokens" for n, ms in times)
            print(f"| {'on' if caching else 'off'} | {r} | {shown} |", flush=True)
        llm.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["pages", "steps"])
    p.add_argument("--order", default="0,1,0,1", help="pages: comma list of 1 (2 MB pages) and 0 (4 KB)")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    print(torch_header(None, ("avx", "amx")))
    if a.what == "pages":
        print("\n| pages | first touch |\n|---|---:|")
        pages(a.order)
    else:
        print("\n| prefix caching | round | steps |\n|---|---:|---|")
        steps(a.rounds)


if __name__ == "__main__":
    main()
