"""llama.cpp's side of benchmarks/kl_accuracy.py: full next-token logits along given token
sequences, and greedy streams, from a GGUF through llama-cpp-python's C API.

    $LLAMACPP_VENV/bin/python benchmarks/llamacpp_logits.py REQUEST.json OUT_DIR

Runs with the llama.cpp venv's python (numpy and llama-cpp-python, nothing of hybridserve).
REQUEST.json: {"gguf", "threads", "extra_bufts" (bool), "texts": [str], "sequences": [{"ids":
[int], "rows": [start, stop]}], "prompts": [[int]], "max_tokens": int}. Written to OUT_DIR:
- logits_<i>.npy: float32 [stop - start, n_vocab], the logits at positions start..stop-1 of
  sequence i, all positions decoded in one batch with logits wanted at every scored position
  (what the high-level `Llama(logits_all=True)` keeps in its `scores`);
- result.json: {"engine", "n_vocab", "tokenized" (each text tokenized by llama.cpp with its
  special tokens, BOS included), "vocab" (every token's text as the GGUF stores it), "streams"
  ([[token ids], [logprob of each]] per prompt: max_tokens greedy tokens, EOS ignored, the
  argmax of each step's logits, lowest id on a tie)}.

The weights stay as the file stores them (Q4_K_M's mix of types), the KV cache f16 (llama.cpp's
default). `extra_bufts` false keeps llama.cpp on its plain CPU kernels, as the peer kit's
run_llamacpp.py does by default (its docstring: the AMX buffer type crashed on this model).
"""

import json
import sys
from pathlib import Path

import numpy as np


def main(request_file: str, out_dir: str) -> None:
    import llama_cpp as L

    req = json.loads(Path(request_file).read_text())
    out = Path(out_dir)
    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    mparams.use_extra_bufts = bool(req["extra_bufts"])
    model = L.llama_model_load_from_file(req["gguf"].encode(), mparams)
    if not model:
        sys.exit(f"llamacpp_logits.py: could not load {req['gguf']}")
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    longest = max([len(s["ids"]) for s in req["sequences"]] + [len(p) + req["max_tokens"] for p in req["prompts"]])
    cparams = L.llama_context_default_params()
    cparams.n_ctx = longest + 1
    cparams.n_batch = longest + 1
    cparams.n_seq_max = 1
    cparams.n_threads = cparams.n_threads_batch = req["threads"]
    ctx = L.llama_init_from_model(model, cparams)
    if not ctx:
        sys.exit("llamacpp_logits.py: llama_init_from_model failed")
    mem = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(longest + 1, 0, 1)

    def decode(ids: list[int], first_pos: int, wanted: range) -> None:
        """Decode ids at positions first_pos.., with logits kept for the batch rows in `wanted`."""
        batch.n_tokens = len(ids)
        for i, tok in enumerate(ids):
            batch.token[i] = tok
            batch.pos[i] = first_pos + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i in wanted
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def logits_rows(n_rows: int) -> np.ndarray:
        return np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(n_rows * n_vocab,)).reshape(n_rows, n_vocab).copy()

    for i, seq in enumerate(req["sequences"]):
        start, stop = seq["rows"]
        L.llama_memory_clear(mem, True)
        decode(seq["ids"], 0, range(start, stop))
        np.save(out / f"logits_{i}.npy", logits_rows(stop - start))

    streams = []
    for prompt in req["prompts"]:
        L.llama_memory_clear(mem, True)
        decode(prompt, 0, range(len(prompt) - 1, len(prompt)))
        ids, logprobs = [], []
        for _ in range(req["max_tokens"]):
            row = logits_rows(1)[0].astype(np.float64)
            tok = int(row.argmax())
            shifted = row - row.max()
            logprobs.append(float(shifted[tok] - np.log(np.exp(shifted).sum())))
            ids.append(tok)
            if len(ids) < req["max_tokens"]:
                decode([tok], len(prompt) + len(ids) - 1, range(1))
        streams.append([ids, logprobs])

    def tokenize(text: str) -> list[int]:
        raw = text.encode()
        buf = (L.llama_token * (len(raw) + 8))()
        n = L.llama_tokenize(vocab, raw, len(raw), buf, len(buf), True, False)
        return list(buf[:n])

    result = {
        "engine": f"llama-cpp-python {L.__version__}",
        "n_vocab": n_vocab,
        "tokenized": [tokenize(t) for t in req["texts"]],
        "vocab": [L.llama_vocab_get_text(vocab, t).decode("utf-8", errors="replace") for t in range(n_vocab)],
        "streams": streams,
    }
    (out / "result.json").write_text(json.dumps(result))
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.split("\n\n")[1])
    main(sys.argv[1], sys.argv[2])
