"""decoder_chains: a model-dtype decoder's element-wise work compiled for large steps gives the
eager loop's hidden states bit for bit (tiny families, bf16) and its greedy tokens (Gemma 3
270M), serves only the layers it covers and only large steps, and any failure to build or
run it leaves the model eager (models/arch/decoder_chains.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hybridserve.models.arch import decoder as decoder_module  # noqa: E402
from hybridserve.models.arch import decoder_chains  # noqa: E402
from hybridserve.models.arch.compiled_chains import DEFAULT_MIN_ROWS  # noqa: E402
from hybridserve.models.layers.rms_norm import rms_norm  # noqa: E402
from hybridserve.models.loaders.loader import load_model  # noqa: E402
from hybridserve.models.platform.cpu_features import as_avx2_env, read_cpu_flags  # noqa: E402
from tests.helpers import hf_tiny  # noqa: E402
from tests.helpers.int8_gemma3 import LENGTHS, prefill  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _compiled_chains_only(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """These tests are about the compiled chains: the native kernels that take their work
    where they are built (so that nothing is compiled: test_act_mul.py) are turned off."""
    for name in _NATIVE_KERNELS:
        monkeypatch.setattr(decoder_module, name, lambda: None)


_NATIVE_KERNELS = ("act_mul_kernel", "residual_norms_kernel", "qk_norm_rope_kernel")


def _model(kind: str, compile: bool = True):  # type: ignore[no-untyped-def]
    return load_model(hf_tiny.tiny_model_dir(kind), "cpu", torch.bfloat16, "none", compile=compile)


def test_exact_sums_normalise_alike_in_any_order() -> None:
    # What lets a compiled norm (its own summation order) equal the eager one bit for bit:
    # the float64 sum of float32 squares rounds to one float32 whatever the order (float32
    # sums of the same columns permuted change a few of these values).
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4096, 640, generator=g) * 4).to(torch.bfloat16)
    w = torch.randn(640, generator=g).to(torch.bfloat16)
    eps = torch.tensor(1e-6, dtype=torch.bfloat16)
    for seed in range(4):
        perm = torch.randperm(640, generator=torch.Generator().manual_seed(seed))
        got = rms_norm(x[:, perm], w[perm], eps, 1 / 640, exact_sums=True)
        assert torch.equal(got, rms_norm(x, w, eps, 1 / 640, exact_sums=True)[:, perm])
    # and they are the float32 norm of the exact mean square (HF's arithmetic, up to rounding)
    want = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()).to(torch.bfloat16)
    assert float((rms_norm(x, w, eps, 1 / 640, exact_sums=True).double() - want.double()).abs().max()) <= \
        float(want.double().abs().max()) * 2 ** -7


def test_the_tanh_gelu_by_sigmoid_is_the_tanh_gelu() -> None:
    """Large steps take the tanh GELU, 0.5 x (1 + tanh(y)), as x * sigmoid(2y). Against the
    same function in float64 (written without 1 + tanh's cancellation, which costs ATen's
    float32 tanh form all its digits in the left tail): within 2 float32 eps times
    (1 + |2y|) relative, the rounding of 2y itself, wherever float32 holds the value; the
    far tails -0 and x with no NaN; bf16 values rounded once, within one bf16 unit in the
    last place."""
    import math

    x = torch.cat([torch.linspace(-12, 12, 20001), torch.tensor([-80.0, -30.0, 0.0, 30.0, 80.0])])
    xd = x.double()
    z = 2 * math.sqrt(2 / math.pi) * (xd + 0.044715 * xd ** 3)
    want = xd * torch.sigmoid(z)
    got = decoder_chains.gelu_tanh_by_sigmoid(x)
    assert got.dtype == torch.float32 and not got.isnan().any()
    held = want.abs() > 1e-30
    rel = (got.double() - want).abs()[held] / want.abs()[held]
    assert bool((rel <= 2 * torch.finfo(torch.float32).eps * (1 + z.abs()[held])).all())
    assert got[-5:].tolist() == [0.0, 0.0, 0.0, 30.0, 80.0]
    xb = (torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16)
    xd = xb.double()
    want = xd * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (xd + 0.044715 * xd ** 3))
    ours = decoder_chains.gelu_tanh_by_sigmoid(xb)
    assert ours.dtype == torch.bfloat16
    held = want.abs() > 1e-30
    assert bool(((ours.double() - want).abs() <= torch.finfo(torch.bfloat16).eps * want.abs())[held].all())


# Pre-norm with a sliding window, pre-norm with q/k/v biases, sandwich norms with q/k norms and GELU.
@pytest.mark.parametrize("kind", ["mistral", "qwen2", "gemma3"])
def test_a_large_step_gives_the_eager_hidden_states_bit_for_bit(kind: str) -> None:
    model = _model(kind)
    assert sum(LENGTHS) >= DEFAULT_MIN_ROWS
    compiled = prefill(model, LENGTHS)
    assert model._dtype_chains._compiled is not None  # the step took the compiled chains
    assert torch.equal(compiled, prefill(_model(kind, compile=False), LENGTHS))


def test_layers_the_chains_do_not_cover_stay_eager() -> None:
    model = _model("olmo3")  # post-norms: the MLP reads the residual stream itself
    assert model._dtype_chains is None
    prefill(model, LENGTHS)


def test_small_steps_stay_eager() -> None:
    model = _model("gemma3")
    prefill(model, [20, 30])  # 50 rows: below DEFAULT_MIN_ROWS, nothing is compiled
    assert model._dtype_chains._build is not None and model._dtype_chains._compiled is None


def test_a_build_that_fails_keeps_the_model_eager(monkeypatch, caplog) -> None:
    def no_compiler(fn, options=None):  # type: ignore[no-untyped-def]
        raise RuntimeError("no C++ compiler found\nsecond line")

    monkeypatch.setattr(decoder_chains, "compile_chain", no_compiler)
    model = _model("gemma3")
    with caplog.at_level("WARNING"):
        hidden = prefill(model, LENGTHS)
    assert model._dtype_chains._compiled is None
    lines = [r.getMessage() for r in caplog.records if "element-wise" in r.getMessage()]
    assert lines == ["the decoder's element-wise work stays eager: the compiled chains failed to build "
                     "(RuntimeError: no C++ compiler found)"]
    assert torch.equal(hidden, prefill(_model("gemma3", compile=False), LENGTHS))


def test_a_chain_that_disagrees_runs_eager(monkeypatch, caplog) -> None:
    real = decoder_chains.compile_chain

    def act_off_by_a_bit(fn, options=None):  # type: ignore[no-untyped-def]
        compiled = real(fn, options)
        return (lambda *args: compiled(*args) * 1.02) if fn.__name__ == "act_mul" else compiled

    monkeypatch.setattr(decoder_chains, "compile_chain", act_off_by_a_bit)
    model = _model("gemma3")
    with caplog.at_level("WARNING"):
        prefill(model, LENGTHS)
    chains = model._dtype_chains._compiled
    assert chains is not None and chains._act_mul is decoder_chains.act_mul  # that chain alone runs eager
    assert "the decoder chain act_mul stays eager: compiled, it differs from the eager function" in caplog.text
    assert torch.equal(prefill(model, LENGTHS), prefill(_model("gemma3", compile=False), LENGTHS))


def test_chains_that_fail_on_a_step_turn_the_model_eager(caplog) -> None:
    model = _model("gemma3")
    prefill(model, LENGTHS)
    assert model._dtype_chains._compiled is not None

    def broken(*args):  # type: ignore[no-untyped-def]
        raise RuntimeError("recompile limit reached")

    model._dtype_chains._compiled._act_mul = broken
    with caplog.at_level("WARNING"):
        hidden = prefill(model, LENGTHS)  # computed again by the eager loop, its K/V rewritten
    assert model._dtype_chains._compiled is None
    assert "the decoder chains turn eager: the compiled chains failed (RuntimeError: recompile limit reached)" \
        in caplog.text
    assert torch.equal(hidden, prefill(_model("gemma3", compile=False), LENGTHS))


_GEMMA_STREAMS = """
import json, logging, sys
from hybridserve import LLM, SamplingParams
from hybridserve.models.arch import decoder
logging.basicConfig(level=logging.WARNING)
for name in sys.argv[1:]:  # the native kernels that would take the compiled chains' work
    setattr(decoder, name, lambda: None)
prompts = json.load(open("benchmarks/prompts16.json"))
out = {}
# A float32 decoder (a CPU without native bf16) keeps a float32 cache here: its compiled chains
# equal the eager loop to float32 rounding, and a bf16 cache's rounding would turn a last-bit
# difference into a bf16 step, enough to flip a near-tied token.
from hybridserve.models.platform.cpu_features import choose_dtype, read_cpu_flags
kv = "float32" if choose_dtype("auto", "cpu", read_cpu_flags()) == "float32" else "auto"
for compile in (True, False):
    # Threads fixed: a bf16 GEMM split over another number of threads sums in another order.
    # The model-dtype decoder on every CPU (`auto` quantization would make the layers int8 where
    # bf16 is not native).
    llm = LLM(compile=compile, quantization="int8-head", kv_cache_dtype=kv, num_threads=2,
              enable_prefix_caching=False, max_model_len=512, progress=False)
    ids = [llm.tokenizer.encode(t) for t in prompts]
    ids += ids[:2]  # past DEFAULT_MIN_ROWS rows in the prefill step
    outs = llm.generate(ids, SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
    out[str(compile)] = {"rows": sum(map(len, ids)), "tokens": [o.token_ids for o in outs],
                         "compiled": llm.parts.engine.executor.model._dtype_chains._compiled is not None}
    llm.shutdown()
print(json.dumps(out))
"""


def _gemma_streams(env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", _GEMMA_STREAMS, *_NATIVE_KERNELS], env=env, capture_output=True, text=True, cwd=REPO,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    return {**json.loads(out.stdout.splitlines()[-1]), "log": out.stderr[-2000:]}


@pytest.mark.gemma
def test_gemma_3_270m_gives_the_eager_greedy_tokens() -> None:
    got = _gemma_streams(dict(os.environ))
    assert got["True"]["rows"] >= DEFAULT_MIN_ROWS and got["True"]["compiled"], got["log"]
    assert got["True"]["tokens"] == got["False"]["tokens"]


@pytest.mark.gemma
@pytest.mark.skipif("avx2" not in read_cpu_flags(), reason="runs as an AVX2 CPU: needs an x86 CPU with AVX2")
def test_gemma_3_270m_gives_the_eager_greedy_tokens_as_an_avx2_cpu() -> None:
    # As on a CPU with AVX2 alone (as_avx2_env): inductor's 256-bit code, ATen's AVX2 kernels.
    got = _gemma_streams({**os.environ, **as_avx2_env(read_cpu_flags())})
    assert got["True"]["compiled"], got["log"]
    assert got["True"]["tokens"] == got["False"]["tokens"]


def test_prepare_large_steps_builds_the_chains_before_any_step() -> None:
    model = _model("gemma3")
    model.prepare_large_steps()  # what a server's engine core does at start-up
    assert model._dtype_chains._compiled is not None and model._dtype_chains._build is None
    assert model.compiles_large_steps
    eager = _model("gemma3", compile=False)  # --no-compile: eager at any size, nothing to prepare
    assert not eager.compiles_large_steps and not eager._dtype_chains.for_rows(10 ** 6)


def test_steps_under_each_prepared_thread_count_compile_nothing() -> None:
    """A compiled graph guards on the thread count and the grad mode: a step under a count
    or mode its chains were not prepared for compiles first (seconds, in the middle of
    serving). Prepared under inference mode (as steps run) at 1 and 2 threads, large steps
    at either count build no new graph, and give the eager hidden states."""
    from torch._dynamo.utils import counters

    model = _model("gemma3")
    before = torch.get_num_threads()
    try:
        with torch.inference_mode():
            for threads in (1, 2):
                torch.set_num_threads(threads)
                model.prepare_large_steps()
        graphs = counters["stats"]["unique_graphs"]
        for threads in (2, 1, 2):
            torch.set_num_threads(threads)
            hidden = prefill(model, LENGTHS)
        assert counters["stats"]["unique_graphs"] == graphs
    finally:
        torch.set_num_threads(before)
    assert model._dtype_chains._compiled is not None
    assert torch.equal(hidden, prefill(_model("gemma3", compile=False), LENGTHS))


def test_chains_that_disagree_under_another_thread_count_run_eager(caplog) -> None:
    model = _model("gemma3")
    model.prepare_large_steps()
    chains = model._dtype_chains._compiled
    assert chains is not None
    compiled_act = chains._act_mul

    def act_off_by_a_bit_on_one_thread(*args):  # type: ignore[no-untyped-def]
        out = compiled_act(*args)
        return out * 1.02 if torch.get_num_threads() == 1 else out

    chains._act_mul = act_off_by_a_bit_on_one_thread
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with caplog.at_level("WARNING"):
            model.prepare_large_steps()  # checked again under 1 thread
    finally:
        torch.set_num_threads(before)
    assert model._dtype_chains._compiled is chains and chains._act_mul is decoder_chains.act_mul
    assert "the decoder chain act_mul stays eager: compiled, it differs from the eager function (1 threads)" \
        in caplog.text


@pytest.mark.parametrize("kind", ["cohere2", "gpt_oss"])
def test_families_with_their_own_forward_build_no_chains(kind: str) -> None:
    # their layers are not forward's loop: nothing to compile, nothing built at a server's start
    assert _model(kind)._dtype_chains is None
