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
