"""int8_chains: the element-wise work between an int8 layer's matmuls quantizes each input
exactly as the matmul's own quantizer would (models/arch/int8_chains.py, decoder.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridserve.models.layers import smoothing  # noqa: E402
from hybridserve.models.layers.int8 import (  # noqa: E402
    FBGEMM,
    PACKED,
    PLAIN,
    QUANTIZERS,
    int8_gemm_available,
    levels_for,
    quantize_rows_float,
)
from hybridserve.models.layers.rms_norm import rms_norm  # noqa: E402
from hybridserve.models.layers.rope import apply_rope_  # noqa: E402
from hybridserve.models.loaders.loader import load_model  # noqa: E402
from tests.helpers import hf_tiny  # noqa: E402

needs_int8_gemm = pytest.mark.skipif(not int8_gemm_available(), reason="no int8 GEMM here (x86 with AVX2 or VNNI)")


def toy_encode(text: str) -> list[int]:
    """A tokenizer for the tiny models (vocabulary 256): BOS, then one id per byte."""
    return [2] + [b % 256 for b in text.encode()]


def test_levels_for_stores_levels_as_each_path_takes_them() -> None:
    # Row 0: largest magnitude 127, so scale 1 and the levels are the values. Row 1: largest
    # 254, scale 2: 1 / 2 = 0.5 rounds to 0 and 3 / 2 = 1.5 to 2 (halves to even).
    x = torch.tensor([[127.0, -63.0, 32.0, 0.0], [254.0, 1.0, 3.0, -254.0]])
    levels, scale = quantize_rows_float(x)
    assert scale.flatten().tolist() == [1.0, 2.0]
    assert levels_for(FBGEMM, levels).tolist() == [[127, -63, 32, 0], [127, 0, 2, -127]]
    assert levels_for(PLAIN, levels).dtype == torch.int8
    assert levels_for(PLAIN, levels).tolist() == [[127, -63, 32, 0], [127, 0, 2, -127]]
    assert levels_for(PACKED, levels).dtype == torch.uint8
    assert levels_for(PACKED, levels).tolist() == [[255, 65, 160, 128], [255, 128, 130, 1]]
    g = torch.Generator().manual_seed(0)
    y = torch.randn(9, 100, generator=g) * 5
    for path in (PACKED, PLAIN, FBGEMM):  # and they are the levels the eager quantizers store
        values, _ = QUANTIZERS[path](y)
        assert torch.equal(levels_for(path, quantize_rows_float(y)[0]), values)


def _reference_hidden(model, ids: torch.Tensor, positions: torch.Tensor, backend) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The int8 layers op by op, each matmul quantizing its own input (W8A8Linear.__call__)."""
    cfg, eps = model.cfg, model._eps
    nq, nkv, hd, T = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, ids.shape[0]
    h = model.stage_input(ids, None).float()
    rope = {t: table.lookup(positions, int(positions.max())) for t, table in model._rope.items()}
    for i, m in zip(model.layer_ids, model._int8):
        qkv = m.qkv(rms_norm(h, m.input_norm, eps, 1 / cfg.hidden_size))
        if m.qkv_bias is not None:
            qkv = qkv + m.qkv_bias
        qk = qkv[:, : (nq + nkv) * hd].view(T, nq + nkv, hd)
        if m.qk_norm is not None:
            qk.copy_(rms_norm(qk, None, eps, 1 / hd) * m.qk_norm)
        apply_rope_(qk, *rope[cfg.layer_types[i]])
        qkv = qkv.to(model.dtype)
        attn = backend.attention(i, qkv[:, : nq * hd].view(T, nq, hd), qkv[:, nq * hd :].view(T, 2, nkv, hd))
        o = m.o(attn)
        h = h + (o if m.o_norm is None else rms_norm(o, m.o_norm, eps, 1 / cfg.hidden_size))
        gate, up = m.gate_up(rms_norm(h, m.ffn_norm, eps, 1 / cfg.hidden_size)).chunk(2, dim=-1)
        down = m.down(model._act(gate) * up)
        h = h + (down if m.down_norm is None else rms_norm(down, m.down_norm, eps, 1 / cfg.hidden_size))
    return model.stage_output(h)


@needs_int8_gemm
@pytest.mark.parametrize(("kind", "dtype"), [("gemma3", torch.bfloat16), ("qwen2", torch.float32)])
def test_int8_layers_quantize_each_input_as_its_linear_would(kind: str, dtype: torch.dtype) -> None:
    # gemma3: sandwich norms, q/k norms, a bfloat16 KV cache; qwen2: pre-norm, a qkv bias.
    # A 3-sequence prefill runs the path for several rows, a single token the one for one.
    model = load_model(hf_tiny.tiny_model_dir(kind), "cpu", dtype, "int8", encode=toy_encode)
    assert model.int8_layers
    for lengths in ([7, 12, 5], [1]):
        g = torch.Generator().manual_seed(len(lengths))
        ids = torch.randint(3, 256, (sum(lengths),), generator=g)
        positions = torch.cat([torch.arange(n) for n in lengths])
        backend = smoothing._SequencesAttention(lengths, model.cfg.attn_scale, model.cfg.attn_softcap,
                                                torch.device("cpu"))
        with torch.inference_mode():
            got = model.forward(ids, positions, int(positions.max()), backend)
            want = _reference_hidden(model, ids, positions, backend)
        assert torch.equal(got, want)


class _RecordingLinear:
    """Wraps a W8A8Linear's `quantized` and records the rows of each call."""

    def __init__(self, inner, rows: list[int]) -> None:  # type: ignore[no-untyped-def]
        self.inner, self.rows, self.path = inner, rows, inner.path

    def quantized(self, path: str, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        self.rows.append(values.shape[0])
        return self.inner.quantized(path, values, scale)


class _StorageRecorder:
    """Wraps a backend and records where each layer's q and kv live (kept alive, so that
    tensors made apart cannot share an address)."""

    def __init__(self, inner) -> None:  # type: ignore[no-untyped-def]
        self.inner = inner
        self.storage: list[tuple[int, int]] = []
        self.kept: list[torch.Tensor] = []

    def attention(self, layer_idx: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        self.storage.append((q.untyped_storage().data_ptr(), kv.untyped_storage().data_ptr()))
        self.kept += [q, kv]
        return self.inner.attention(layer_idx, q, kv)


@needs_int8_gemm
@pytest.mark.parametrize(("kind", "dtype"), [("gemma3", torch.bfloat16), ("qwen2", torch.float32)])
def test_a_step_over_row_chunks_gives_the_same_hidden_with_a_chunk_of_temporaries(kind: str, dtype: torch.dtype
                                                                                  ) -> None:
    # 24 tokens in chunks of at most 5 rows (5, 5, 5, 5, 4): every matmul sees a chunk's rows,
    # never the step's, and the layers' q/k/v share one buffer; the hidden states are the
    # op-by-op reference's, bit for bit (every op but attention is row by row).
    model = load_model(hf_tiny.tiny_model_dir(kind), "cpu", dtype, "int8", encode=toy_encode)
    lengths = [7, 12, 5]
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 256, (sum(lengths),), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])
    inner = smoothing._SequencesAttention(lengths, model.cfg.attn_scale, model.cfg.attn_softcap, torch.device("cpu"))
    with torch.inference_mode():
        want = _reference_hidden(model, ids, positions, inner)
        rows: list[int] = []
        model._int8 = [m._replace(**{n: _RecordingLinear(getattr(m, n), rows) for n in ("qkv", "o", "gate_up", "down")})
                       for m in model._int8]
        model.chunk_rows = 5
        backend = _StorageRecorder(inner)
        got = model.forward(ids, positions, int(positions.max()), backend)
    assert torch.equal(got, want)
    assert len(rows) == 4 * 5 * model.cfg.num_layers and max(rows) == 5 and sum(rows) == 4 * 24 * model.cfg.num_layers
    assert len(backend.storage) == model.cfg.num_layers and len(set(backend.storage)) == 1
