"""Decode steps and a 1024-token prefill of the default model with models/layers/rms_norm.py's
in-place RMSNorm against the allocating one it replaced, alternated in one process.

    python benchmarks/rms_norm_inplace_ab.py --rounds 4 --threads 2
    python benchmarks/rms_norm_inplace_ab.py --calls-only      # the call alone, [R, 640] bf16

The in-place form scales its own float32 copy of a half-precision input, and applies the
weight in place, instead of allocating two more float32 tensors per call: the same values
bit for bit (tests/models/test_rms_norm.py), one float32 [T, hidden] per call where there
were three, which a large prefill's heap keeps resident (benchmarks/results/memory_peak.md).
The arms swap the function the decoder calls (models/arch/decoder.rms_norm), so both run
the same engine, prompts and steps. A decode step is (34-token run - 2-token run) / 32 (as
quantization_step_ab.py); the prefill is 16 prompts of 64 random ids, one token each.
A fixed thread count (--threads) keeps the thread governor from switching counts between
arms (another count sums the GEMMs in another order: other tokens, other times).
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

import torch  # noqa: E402

from hybridserve import LLM, SamplingParams  # noqa: E402
from hybridserve.models.arch import decoder  # noqa: E402
from hybridserve.models.layers.rms_norm import rms_norm as in_place  # noqa: E402


def allocating(x: torch.Tensor, weight: torch.Tensor | None, eps: torch.Tensor, inv_dim: float) -> torch.Tensor:
    """The RMSNorm before the change (three float32 temporaries per half-precision call)."""
    if x.dtype != torch.float32:
        w32 = None if weight is None else weight.float()
        return allocating(x.float(), w32, eps.float(), inv_dim).to(x.dtype)
    n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    out = x * torch.addcmul(eps, n, n, value=inv_dim).rsqrt_()
    return out if weight is None else out * weight


def time_calls(arms: dict, threads: int) -> None:
    """Each arm's call on Gemma 3 270M's [R, 640] bf16 rows, blocks of calls alternated, medians."""
    torch.set_num_threads(threads)
    eps = torch.tensor(1e-6, dtype=torch.bfloat16)
    for rows, reps in ((1, 400), (16, 400), (64, 200), (1024, 40)):
        gen = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, 640, generator=gen).to(torch.bfloat16)
        w = torch.randn(640, generator=gen).to(torch.bfloat16)
        us: dict[str, list[float]] = {name: [] for name in arms}
        for r in range(10):
            for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
                start = time.perf_counter()
                for _ in range(reps):
                    arms[name](x, w, eps, 1.0 / 640)
                us[name].append((time.perf_counter() - start) / reps * 1e6)
        a_us, b_us = (statistics.median(v) for v in us.values())
        print(f"call, {rows} rows: in-place {a_us:.1f} us, allocating {b_us:.1f} us, ratio {a_us / b_us:.3f}")


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)


def timed(llm: LLM, prompts: list[list[int]], n: int) -> float:
    start = time.perf_counter()
    llm.generate(prompts, params(n), use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--rows", default="1,16,64")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls-only", action="store_true", help="time the call alone, not the engine's steps")
    a = p.parse_args()
    arms = {"in-place": in_place, "allocating": allocating}
    time_calls(arms, a.threads)
    if a.calls_only:
        return
    llm = LLM(None, progress=False, enable_prefix_caching=False, num_threads=a.threads)
    vocab = llm.parts.model_config.vocab_size
    rows_list = [int(r) for r in a.rows.split(",")]
    times: dict[tuple[str, str], list[float]] = {}
    tokens: dict[str, list] = {}
    for r in range(a.rounds):
        for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            decoder.rms_norm = arms[name]
            for rows in rows_list:
                rng = random.Random(rows)
                prompts = [[rng.randrange(5, vocab) for _ in range(16)] for _ in range(rows)]
                llm.generate(prompts, params(3), use_tqdm=False)  # warm
                step = (timed(llm, prompts, 34) - timed(llm, prompts, 2)) / 32
                times.setdefault((name, f"decode {rows} rows"), []).append(step)
                out = llm.generate(prompts, params(8), use_tqdm=False)
                tokens.setdefault(name, []).append([o.outputs[0].token_ids for o in out])
            rng = random.Random(0)
            prefill = [[rng.randrange(5, vocab) for _ in range(64)] for _ in range(16)]
            times.setdefault((name, "prefill 16 x 64"), []).append(timed(llm, prefill, 1))
    decoder.rms_norm = in_place
    print(f"# {torch.__version__}, threads {torch.get_num_threads()}; same tokens: "
          f"{tokens['in-place'] == tokens['allocating']}")
    for kind in dict.fromkeys(k for _, k in times):
        a_ms = statistics.median(times[("in-place", kind)]) * 1000
        b_ms = statistics.median(times[("allocating", kind)]) * 1000
        print(f"{kind}: in-place {a_ms:.1f} ms, allocating {b_ms:.1f} ms, in-place / allocating {a_ms / b_ms:.3f}")
    llm.shutdown()


if __name__ == "__main__":
    main()
