"""A float32 model whose decode steps take the decode stack (Gemma 3's int8 groups on a CPU
without native bf16) computes its large steps with the same native kernels' float32 forms
(decoder.py's _native_chains): to float32 rounding of the eager loop, with --no-compile and
without alike, and nothing compiled, so a server never imports the compiler for them; act *
up lands in place over its product's gate half, or in row blocks, with the same bits.

A tiny Gemma 3 GGUF (tests/helpers/tiny_gguf.py: sandwich and q/k norms, the tanh GELU,
linears of mixed GGUF types) served as its own int8 groups in float32; a step of
sum(LENGTHS) = 150 rows is past DEFAULT_MIN_ROWS, so it is a large step."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("numpy")
pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hybridserve import LLM, SamplingParams  # noqa: E402
from hybridserve.models.arch import decoder_chains  # noqa: E402
from hybridserve.models.arch.compiled_chains import DEFAULT_MIN_ROWS  # noqa: E402
from hybridserve.models.layers.act_mul import ActMul  # noqa: E402
from hybridserve.models.layers.head import GROUP_LAYERS  # noqa: E402
from hybridserve.models.layers.int8_groups import group_kernel  # noqa: E402

from tests.helpers.int8_gemma3 import LENGTHS, prefill  # noqa: E402
from tests.helpers.tiny_gguf import TOKENS, mixed_linear_types, write_tiny_gemma3, write_tiny_llama  # noqa: E402

HIDDEN, INTERMEDIATE = 256, 512
# The final hidden states within this fraction of the loop's largest value: the i16 path
# (CPUs without native bf16) rounds its inputs to 2^-16 of their group's largest, so a
# last-bit difference in a norm or the GELU can move an input one whole step.
FLOAT32_STEP = 2.0**-12
ALL = {"qk_out", "residual", "act_mul"}

needs_kernels = pytest.mark.skipif(group_kernel() is None, reason="no C compiler: the native kernels are not built")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("float32_steps") / "gemma3.gguf"
    write_tiny_gemma3(path, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, linear_types=mixed_linear_types())
    return path


def _llm(path: Path, compile: bool = False) -> LLM:
    return LLM(str(path), quantization=GROUP_LAYERS, dtype="float32", max_model_len=256, progress=False,
               enable_prefix_caching=False, compile=compile)


def _model(llm: LLM):  # type: ignore[no-untyped-def]
    return llm.parts.engine.executor.runner.model


def _computed_calls(monkeypatch) -> list[int]:  # type: ignore[no-untyped-def]
    """Rows of each call of act_mul's float32 form."""
    rows: list[int] = []
    real = ActMul.computed

    def counted(self, gate_up, activation, out=None):  # type: ignore[no-untyped-def]
        rows.append(gate_up.shape[0])
        return real(self, gate_up, activation, out=out)

    monkeypatch.setattr(ActMul, "computed", counted)
    return rows


@needs_kernels
def test_a_large_step_takes_the_float32_kernels_within_rounding_of_the_loop(gemma: Path, monkeypatch) -> None:
    """--no-compile: the large step runs forward's loop, whose chains go to the kernels'
    float32 forms (act * up computed on every layer); with them off the loop is eager. The
    final hidden states agree within FLOAT32_STEP of the largest (a wrong norm weight,
    activation or rotation is off by the values' own size)."""
    assert sum(LENGTHS) >= DEFAULT_MIN_ROWS
    llm = _llm(gemma)
    try:
        model = _model(llm)
        assert model.decode_stack is not None and model._float32_native == ALL
        rows = _computed_calls(monkeypatch)
        native = prefill(model, LENGTHS)
        assert rows and sum(rows) == model.cfg.num_layers * sum(LENGTHS)
        model._float32_native = frozenset()
        rows.clear()
        loop = prefill(model, LENGTHS)
        assert rows == []
    finally:
        llm.shutdown()
    assert native.dtype == torch.float32 and native.shape == loop.shape
    assert float((native - loop).abs().max()) <= FLOAT32_STEP * float(loop.abs().max())


@needs_kernels
def test_the_default_compiles_nothing_and_equals_no_compile(gemma: Path, monkeypatch) -> None:
    """With compile on, the large step takes the native kernels (the chains' object holds
    the eager functions alone) and never calls the compiler: the same bits as
    --no-compile."""
    def no_compiling(fn, options=None):  # type: ignore[no-untyped-def]
        raise AssertionError("compiled a chain")

    monkeypatch.setattr(decoder_chains, "compile_chain", no_compiling)
    hidden = {}
    for compile in (True, False):
        llm = _llm(gemma, compile=compile)
        try:
            model = _model(llm)
            model.prepare_large_steps()
            hidden[compile] = prefill(model, LENGTHS)
            if compile:
                chains = model._dtype_chains._compiled
                assert chains is not None
                assert all(getattr(chains, f"_{n}") is decoder_chains.EAGER[n] for n in decoder_chains.EAGER)
        finally:
            llm.shutdown()
    assert torch.equal(hidden[True], hidden[False])


@needs_kernels
def test_greedy_tokens_of_a_large_prefill_match_the_eager_loop(gemma: Path) -> None:
    """Greedy streams after one 150+-row prefill step, the float32 kernels on and off in one
    engine: the same tokens (this model's logits are not within rounding of a tie)."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, len(TOKENS)) for _ in range(n)] for n in LENGTHS]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm = _llm(gemma)
    try:
        model = _model(llm)
        native = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        model._float32_native = frozenset()
        loop = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert native == loop and all(len(t) == 10 for t in native)


@needs_kernels
def test_models_without_the_decode_stack_keep_the_compiled_chains(gemma: Path, tmp_path: Path) -> None:
    """A pre-norm decoder the stack does not walk (the tiny Llama) and the same Gemma in bf16
    (its own bit-exact kernels) have no float32 kernels in their large steps."""
    llama = tmp_path / "llama.gguf"
    write_tiny_llama(llama, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, linear_types=mixed_linear_types())
    for path, dtype in ((llama, "float32"), (gemma, "bfloat16")):
        llm = LLM(str(path), quantization=GROUP_LAYERS, dtype=dtype, max_model_len=256, progress=False,
                  enable_prefix_caching=False, compile=False)
        try:
            assert _model(llm)._float32_native == frozenset()
        finally:
            llm.shutdown()


@needs_kernels
def test_without_the_activation_kernel_act_mul_stays_with_the_chains(gemma: Path, monkeypatch) -> None:
    monkeypatch.setattr(ActMul, "supports_computed", staticmethod(lambda gate_up, activation: False))
    llm = _llm(gemma)
    try:
        model = _model(llm)
        # No activation kernel: no decode stack either (it calls the same kernel)
        assert model.decode_stack is None and model._float32_native == frozenset()
    finally:
        llm.shutdown()


@needs_kernels
def test_a_large_step_in_row_blocks_gives_the_one_block_bits(gemma: Path, monkeypatch) -> None:
    """One block: act * up written over the product's gate half; blocks of 15 rows: each
    block's into its rows of one result. Rows are independent: the same bits."""
    rows = _computed_calls(monkeypatch)
    llm = _llm(gemma, compile=True)
    try:
        model = _model(llm)
        assert model.dtype_mlp_block_rows >= sum(LENGTHS)
        whole = prefill(model, LENGTHS)
        assert set(rows) == {sum(LENGTHS)}
        rows.clear()
        model.dtype_mlp_block_rows = 16  # 150 rows in 10 blocks of 15
        blocks = prefill(model, LENGTHS)
        assert rows == [15] * 10 * model.cfg.num_layers
    finally:
        llm.shutdown()
    assert torch.equal(blocks, whole)
