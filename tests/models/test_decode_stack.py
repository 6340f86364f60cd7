"""The decode stack (models/arch/decode_stack.py): a decode step's decoder layers in one native
call, the fast path beside DecoderLM.forward's loop, which it must equal bit for bit in bf16
and to float32 rounding in float32 (the kernels' float32 forms sum the norms' squares
exactly and compute the activation, where the loop takes ATen's).

A tiny Gemma 3 GGUF (tests/helpers/tiny_gguf.py: sandwich and q/k norms, layer 0 sliding
over 16 positions, layer 1 full) served as its own int8 groups in bf16 and in float32, its linears of
mixed types (Q8_0, Q4_K, Q6_K, Q5_0: group sizes 32 and 16, with and without offsets). Batches
of 1, 3 and 40 rows take the group kernel's vector, exact and folded paths where the CPU
has them (AMX: 3+ and 32+ rows); prompts of up to 60 tokens in blocks of 16 make the
sliding layer read a moving window over several blocks. A float32 model keeps its cache in
bf16 by default (quantized weights: models/kv_specs.resolve_kv_dtype) or in float32 when
asked: the stack writes and reads either as the loop does."""

from __future__ import annotations

import random
import types
import weakref
from pathlib import Path

import pytest

pytest.importorskip("numpy")
pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hybridserve import LLM, SamplingParams  # noqa: E402
from hybridserve.models.arch.decode_stack import DecodeStack  # noqa: E402
from hybridserve.models.layers.head import GROUP_LAYERS  # noqa: E402
from hybridserve.models.layers.int8_groups import group_kernel  # noqa: E402

from tests.helpers.tiny_gguf import TOKENS, mixed_linear_types, write_tiny_gemma3, write_tiny_llama  # noqa: E402

HIDDEN, INTERMEDIATE = 256, 512
# float32: the stack's final hidden states within this fraction of the loop's largest value,
# above what the i16 path (CPUs without native bf16) leaves: its inputs round to 2^-16 of
# their group's largest, so a last-bit difference can move an input a whole step.
FLOAT32_STEP = 2.0**-12

needs_kernels = pytest.mark.skipif(group_kernel() is None, reason="no C compiler: the native kernels are not built")


def _write(writer, path: Path) -> Path:  # type: ignore[no-untyped-def]
    writer(path, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, linear_types=mixed_linear_types())
    return path


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(write_tiny_gemma3, tmp_path_factory.mktemp("stack") / "gemma3.gguf")


# (model dtype, KV cache dtype): bf16, then float32 over the default bf16 cache and over a float32 one
DTYPES = [("bfloat16", "bfloat16"), ("float32", "bfloat16"), ("float32", "float32")]


def _llm(path: Path, dtype: str = "bfloat16", kv_cache_dtype: str = "auto") -> LLM:
    return LLM(str(path), quantization=GROUP_LAYERS, dtype=dtype, kv_cache_dtype=kv_cache_dtype, max_model_len=256,
               progress=False, enable_prefix_caching=False)


def _model(llm: LLM):  # type: ignore[no-untyped-def]
    return llm.parts.engine.executor.runner.model


def _batch(rows: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, len(TOKENS)) for _ in range(rng.randrange(5, 61))] for _ in range(rows)]


def _same(dtype: str, stack: torch.Tensor, loop: torch.Tensor) -> bool:
    """bf16: bit for bit. float32: within FLOAT32_STEP of the largest final hidden value (the
    loop's norms and GELU differ from the kernels' in their last bits; a wrong slot, head or
    formula is off by the values' own size)."""
    if dtype == "bfloat16":
        return torch.equal(stack, loop)
    return bool((stack - loop).abs().max() <= FLOAT32_STEP * loop.abs().max())


@needs_kernels
@pytest.mark.parametrize("dtype, kv_dtype", DTYPES)
def test_every_decode_step_gives_the_loops_hidden_states(gemma: Path, dtype: str, kv_dtype: str) -> None:
    """Each step is computed twice, by forward as it is (the stack where it takes the step)
    and by the loop alone (decode_stack None), on the same inputs and KV cache: the final
    hidden states are the same (_same), and the stack took every pure decode step."""
    llm = _llm(gemma, dtype, kv_dtype)
    assert llm.parts.engine.executor.kv_dtype == kv_dtype
    model = _model(llm)
    stack = model.decode_stack
    assert isinstance(stack, DecodeStack)
    assert stack.final_normed  # one stage: the final norm is the stack's too, compared below
    forward = type(model).forward
    taken, steps, differing = [0], [], []

    def counted(*args):  # type: ignore[no-untyped-def]
        out = DecodeStack.__call__(stack, *args)
        taken[0] += out is not None
        return out

    counted.final_normed = stack.final_normed  # type: ignore[attr-defined]

    def both(self, input_ids, positions, max_position, backend, hidden_in=None):  # type: ignore[no-untyped-def]
        out = forward(self, input_ids, positions, max_position, backend, hidden_in)
        self.decode_stack = None
        try:
            loop = forward(self, input_ids, positions, max_position, backend, hidden_in)
        finally:
            self.decode_stack = counted
        steps.append(input_ids.shape[0])
        if not _same(dtype, out, loop):
            differing.append(input_ids.shape[0])
        return out

    model.decode_stack = counted
    model.forward = types.MethodType(both, model)
    try:
        for rows, seed in ((1, 0), (3, 1), (40, 2)):
            out = llm.generate(_batch(rows, seed), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)
            assert all(len(o.outputs[0].token_ids) == 6 for o in out)
    finally:
        llm.shutdown()
    assert not differing
    # Each batch: one prefill step (the prompts fit one step), then 5 decode steps of its rows.
    assert steps.count(1) == 5 and steps.count(3) == 5 and steps.count(40) == 5
    assert taken[0] == 15


@needs_kernels
@pytest.mark.parametrize("dtype, kv_dtype", DTYPES)
def test_the_stack_and_the_loop_give_the_same_tokens(gemma: Path, dtype: str, kv_dtype: str) -> None:
    """Greedy streams of a mixed batch, the stack on and off in one engine: the same tokens."""
    llm = _llm(gemma, dtype, kv_dtype)
    model = _model(llm)
    stack = model.decode_stack
    assert stack is not None
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    try:
        fast = [o.outputs[0].token_ids for o in llm.generate(_batch(7, 3), params, use_tqdm=False)]
        model.decode_stack = None
        loop = [o.outputs[0].token_ids for o in llm.generate(_batch(7, 3), params, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert fast == loop


@needs_kernels
def test_models_the_c_loop_does_not_walk_have_no_stack(gemma: Path, tmp_path: Path) -> None:
    """A pre-norm decoder (the tiny Llama: no sandwich norms) keeps the loop alone."""
    llama = _write(write_tiny_llama, tmp_path / "llama.gguf")
    for path, dtype in ((llama, "bfloat16"), (llama, "float32")):
        llm = _llm(path, dtype)
        try:
            model = _model(llm)
            assert model.decode_stack is None and DecodeStack.build(model) is None
        finally:
            llm.shutdown()


@needs_kernels
def test_layers_whose_linears_take_other_paths_have_no_stack(gemma: Path) -> None:
    """The stack runs one path per role for every layer: a layer whose qkv may not round its
    inputs to int8 where the others may (or whose groups are not whole 4s) would take
    another path there, so such a model keeps the loop."""
    llm = _llm(gemma, "bfloat16")
    try:
        model = _model(llm)
        assert DecodeStack.build(model) is not None
        qkv = model._linears[1].qkv
        packed = qkv.packed
        assert packed.int8_inputs and not model._linears[1].down.packed.int8_inputs  # decoder.EXACT_INPUT_ROLES
        qkv.packed = packed._replace(int8_inputs=False)
        assert DecodeStack.build(model) is None
        qkv.packed = packed
        assert DecodeStack.build(model) is not None
    finally:
        llm.shutdown()


@needs_kernels
def test_the_stack_reads_the_caches_each_step_hands_it(gemma: Path) -> None:
    """The caches' addresses are checked once and reused while every layer's view is the same
    tensor; a new view (another runner's caches) is checked and read anew, one the stack does
    not write is refused, and the stack keeps no cache alive."""
    llm = _llm(gemma)
    try:
        stack = _model(llm).decode_stack
        assert stack is not None
        shape = (4, 16, 2, 1, 256)
        first = [torch.zeros(shape, dtype=torch.bfloat16) for _ in stack.layer_ids]
        found = stack._caches_of(first)
        assert found is not None and stack._caches_of(list(first)) is found
        assert list(found[0]) == [c.data_ptr() for c in first] and found[2:] == (16, torch.bfloat16)
        second = first[:-1] + [torch.zeros(shape, dtype=torch.bfloat16)]
        again = stack._caches_of(second)
        assert again is not None and again[0][len(second) - 1] == second[-1].data_ptr()
        assert stack._caches_of(first[:-1] + [torch.zeros(shape, dtype=torch.bfloat16).transpose(0, 1)]) is None
        assert stack._caches_of(first[:-1] + [torch.zeros(shape, dtype=torch.float16)]) is None
        held = second[-1]
        del second, again, found
        gone = weakref.ref(held)
        del held
        assert gone() is None
    finally:
        llm.shutdown()


@needs_kernels
def test_the_stack_gathers_rope_rows_from_tables_it_grows(gemma: Path, monkeypatch) -> None:
    """The stack reads RoPE rows from the model's tables by position, growing them as their
    lookup does: tables cut to 8 rows, then steps at positions up to ~70, give the loop's
    tokens. A position past the tables (a caller breaking the max_position contract) is
    an IndexError, not a read past them."""
    llm = _llm(gemma)
    model = _model(llm)
    stack = model.decode_stack
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    captured = []
    real = DecodeStack.__call__
    monkeypatch.setattr(DecodeStack, "__call__", lambda self, *a: captured.append(a) or real(self, *a))
    try:
        for table in model._rope.values():
            table._grow(8)
        fast = [o.outputs[0].token_ids for o in llm.generate(_batch(4, 5), params, use_tqdm=False)]
        assert captured and all(t.cos.shape[0] > 60 for t in model._rope.values())
        model.decode_stack = None
        for table in model._rope.values():
            table._grow(8)
        loop = [o.outputs[0].token_ids for o in llm.generate(_batch(4, 5), params, use_tqdm=False)]
        assert fast == loop
        h, positions, max_position, rope, backend, table = captured[-1]
        rows = next(iter(rope.values())).cos.shape[0]
        with pytest.raises(IndexError, match="past the RoPE tables"):
            real(stack, h, torch.full_like(positions, rows + 3), max_position, rope, backend, table)
    finally:
        llm.shutdown()
