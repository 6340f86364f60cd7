"""How far a reduced-precision mode (bf16, int8 or int4 head) drifts from the float32 reference.

Both runs are greedy over the same prompts and record each chosen token's logprob. Per
prompt, the streams agree up to their first differing token; over that common prefix the
two runs saw the same context and chose the same token, so their logprobs for it are
directly comparable. Reported:

- token agreement: common-prefix tokens / all reference tokens (1.0: identical streams);
- identical streams: how many prompts produced exactly the reference's tokens;
- mean and max |logprob difference| of the chosen tokens over the common prefixes.

Pure Python, so it is tested on hand-made streams; benchmarks/quant_accuracy.py and the
Gemma accuracy test run the engine to produce the streams. teacher_forced_logits gives the
full next-token logits along fixed sequences instead (models/kl_divergence.py compares
them: benchmarks/kl_accuracy.py and the same test).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

Stream = tuple[Sequence[int], Sequence[float]]  # (token ids, logprob of each)


@dataclass(frozen=True)
class Drift:
    token_agreement: float
    identical_streams: int
    num_streams: int
    mean_abs_logprob_diff: float
    max_abs_logprob_diff: float

    def row(self) -> str:
        return (f"agreement {self.token_agreement:.3f}, identical {self.identical_streams}/{self.num_streams}, "
                f"|dlogprob| mean {self.mean_abs_logprob_diff:.4f} max {self.max_abs_logprob_diff:.4f}")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def drift(reference: Sequence[Stream], candidate: Sequence[Stream]) -> Drift:
    if len(reference) != len(candidate) or not reference:
        raise ValueError(f"need the same, non-zero number of streams, got {len(reference)} and {len(candidate)}")
    agreed = total = identical = 0
    diffs: list[float] = []
    for (ref_ids, ref_lps), (ids, lps) in zip(reference, candidate):
        n = common_prefix(ref_ids, ids)
        agreed += n
        total += len(ref_ids)
        identical += list(ref_ids) == list(ids)
        diffs += [abs(a - b) for a, b in zip(ref_lps[:n], lps[:n])]
    return Drift(
        token_agreement=agreed / total if total else 1.0,
        identical_streams=identical,
        num_streams=len(reference),
        mean_abs_logprob_diff=sum(diffs) / len(diffs) if diffs else 0.0,
        max_abs_logprob_diff=max(diffs, default=0.0),
    )


def greedy_streams(llm: Any, prompts: Sequence[str | Sequence[int]], max_tokens: int) -> list[Stream]:
    """Each prompt's greedy tokens and their logprobs from a hybridserve LLM (EOS ignored, so
    every stream has max_tokens tokens)."""
    from hybridserve.core.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate([p if isinstance(p, str) else list(p) for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


def teacher_forced_logits(llm: Any, sequences: Sequence[Sequence[int]], scored: Sequence[tuple[int, int]]
                          ) -> Iterator[Any]:
    """Per sequence, float32 numpy logits [stop - start, vocab] of the rows [start, stop)
    (`scored`) of the whole sequence run as one prompt: row i predicts token i + 1.

    The logits are read where the engine computes prompt logprobs (`prompt_logprobs=0` calls
    the model's `logits` on the prompt's rows): the loaded model's method is wrapped to keep
    a copy, and nothing the engine computes changes. Give the LLM prefix caching off, so
    every row is computed."""
    import numpy as np

    from hybridserve.core.request import SamplingParams

    model = llm.parts.engine.executor.model
    compute_logits = model.logits
    kept: list[Any] = []

    def keeping(hidden):  # type: ignore[no-untyped-def]
        out = compute_logits(hidden)
        kept.append(out.float().cpu().numpy().copy())
        return out

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    model.logits = keeping  # an instance attribute over the class's method, deleted below
    try:
        for ids, (start, stop) in zip(sequences, scored):
            kept.clear()
            llm.generate([list(ids)], params, use_tqdm=False)
            logits = np.concatenate(kept)
            if len(logits) != len(ids) - 1:
                raise RuntimeError(f"got logits for {len(logits)} positions, expected {len(ids) - 1} (one per "
                                   "prompt token that has a successor)")
            yield logits[start:stop]
    finally:
        del model.logits
