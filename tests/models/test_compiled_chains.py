"""compiled_chains: the int8 chains compiled for large steps agree with the eager chains
(floats to rounding, quantized levels at most one apart, the same greedy tokens), and any
failure to build or run them leaves the model eager (models/arch/compiled_chains.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hybridserve.config import EngineConfig  # noqa: E402
from hybridserve.entrypoints.engine_flags import add_engine_arguments, engine_config_from_args  # noqa: E402
from hybridserve.models.arch import compiled_chains  # noqa: E402
from hybridserve.models.arch.compiled_chains import DEFAULT_MIN_ROWS, CompiledChains  # noqa: E402
from hybridserve.models.layers.int8 import FBGEMM, PACKED, PLAIN, int8_gemm_available  # noqa: E402
from hybridserve.models.platform.cpu_features import as_avx2_env, read_cpu_flags  # noqa: E402
from tests.helpers.int8_gemma3 import LENGTHS, int8_model, prefill  # noqa: E402

needs_int8_gemm = pytest.mark.skipif(not int8_gemm_available(), reason="no int8 GEMM here (x86 with AVX2 or VNNI)")
_model, _prefill = int8_model, prefill


def _copied(args: tuple) -> tuple:
    return tuple(a.clone() if k == 0 and a is not None else a for k, a in enumerate(args))


def _last_rows(hidden: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    ends = torch.tensor(lengths).cumsum(0) - 1
    return hidden[ends]


def _assert_levels_close(got: torch.Tensor, want: torch.Tensor) -> None:
    # Not bit for bit: inductor sums a norm's squares in another order than ATen, so a
    # value within rounding of a half-level boundary may land one level away.
    assert got.dtype == want.dtype and got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    assert float(diff.max()) <= 1
    assert float((diff > 0).float().mean()) < 1e-3


@needs_int8_gemm
def test_each_compiled_chain_equals_the_eager_one() -> None:
    # oneDNN's packed path here; each path's own storage of the levels below, fbgemm's
    # whole step in test_the_avx2_path_compiles_and_agrees
    path = PACKED
    model = _model()
    eager = model._chains.eager
    compiled = CompiledChains(eager)
    m = model._int8[0]
    g = torch.Generator().manual_seed(1)
    rows, hidden, inter = 200, model.cfg.hidden_size, model.cfg.intermediate_size
    nq, nkv, hd = eager.nq, eager.nkv, eager.hd
    h, out = torch.randn(rows, hidden, generator=g), torch.randn(rows, hidden, generator=g) * 3
    angles = torch.rand(rows, 1, hd, generator=g) * 6
    qkv = torch.randn(rows, (nq + 2 * nkv) * hd, generator=g)
    scale = torch.rand(rows, 1, generator=g) + 0.5  # the products' activation scale per row
    with torch.inference_mode():
        for args in [(None, None, None, h, None, m.input_norm), (out, scale, m.o_bias, h, m.o_norm, m.ffn_norm),
                     (out, scale, m.down_bias, h, m.down_norm, None)]:
            # a copy of the product for each: the eager chain scales its own in place
            got = compiled.residual(path, *_copied(args))
            want = eager.residual(path, *_copied(args))
            torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-5)
            if want[1] is None:
                assert got[1] is None and got[2] is None
            else:
                _assert_levels_close(got[1], want[1])
                torch.testing.assert_close(got[2], want[2], rtol=1e-6, atol=0.0)
        q, kv = compiled.qkv_out(qkv.clone(), scale, m.qkv_bias, m.qk_norm, angles.cos(), angles.sin())
        want_q, want_kv = eager.qkv_out(qkv.clone(), scale, m.qkv_bias, m.qk_norm, angles.cos(), angles.sin())
        assert q.dtype == torch.bfloat16 and q.shape == (rows, nq, hd) and kv.shape == (rows, 2, nkv, hd)
        # one bfloat16 unit (2^-8 relative) where float32 rounding tips the rounding to bf16;
        # near zero (RoPE's sum cancelling) the float32 rounding of the terms (values ~1)
        torch.testing.assert_close(q, want_q, rtol=2**-7, atol=1e-6)
        torch.testing.assert_close(kv, want_kv, rtol=2**-7, atol=1e-6)
        attn = torch.randn(rows, nq * hd, generator=g).bfloat16()
        got, want = compiled.quant(path, attn), eager.quant(path, attn)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # the same ops, no reduction order
        for other in (PLAIN, FBGEMM):
            got, want = compiled.quant(other, attn), eager.quant(other, attn)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        gate_up = torch.randn(rows, 2 * inter, generator=g) * 2
        got = compiled.act_mul(path, gate_up.clone(), scale, m.gate_up_bias)
        want = eager.act_mul(path, gate_up.clone(), scale, m.gate_up_bias)
        _assert_levels_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=0.0)


@needs_int8_gemm
def test_a_large_prefill_gives_the_eager_greedy_tokens(caplog) -> None:
    model = _model()
    compiled_hidden = _prefill(model, LENGTHS)
    assert model._chains._compiled is not None  # the step took the compiled chains
    eager_hidden = _prefill(_model(compile=False), LENGTHS)
    assert sum(LENGTHS) >= DEFAULT_MIN_ROWS
    torch.testing.assert_close(compiled_hidden, eager_hidden, rtol=0.02, atol=0.02)
    with torch.inference_mode():
        assert (model.greedy_tokens(_last_rows(compiled_hidden, LENGTHS))
                == model.greedy_tokens(_last_rows(eager_hidden, LENGTHS)))

    # and compiled chains that fail on a later step (a shape they cannot take, their
    # recompile limit) turn the model eager for good, the step computed again eager
    def broken(*args):  # type: ignore[no-untyped-def]
        raise RuntimeError("recompile limit reached")

    model._chains._compiled._act_mul = broken
    with caplog.at_level("WARNING"):
        hidden = _prefill(model, LENGTHS)
    assert model._chains._compiled is None
    assert "the int8 chains turn eager: the compiled chains failed (RuntimeError: recompile limit reached)" \
        in caplog.text
    assert torch.equal(hidden, eager_hidden)


@needs_int8_gemm
def test_small_steps_stay_eager() -> None:
    model = _model()
    _prefill(model, [20, 30])  # 50 rows: below DEFAULT_MIN_ROWS, nothing is compiled
    assert model._chains._build is not None and model._chains._compiled is None  # never tried


@needs_int8_gemm
def test_a_build_that_fails_keeps_the_model_eager(monkeypatch, caplog) -> None:
    def no_compiler(fn, options=None):  # type: ignore[no-untyped-def]
        raise RuntimeError("no C++ compiler found\nsecond line")

    monkeypatch.setattr(compiled_chains, "compile_chain", no_compiler)
    model = _model()
    with caplog.at_level("WARNING"):
        hidden = _prefill(model, LENGTHS)
    assert model._chains._compiled is None
    lines = [r.getMessage() for r in caplog.records if "int8 chains" in r.getMessage()]
    assert lines == ["the int8 chains stay eager: the compiled chains failed to build "
                     "(RuntimeError: no C++ compiler found)"]
    assert torch.equal(hidden, _prefill(_model(compile=False), LENGTHS))


@needs_int8_gemm
def test_chains_that_disagree_are_not_used(monkeypatch, caplog) -> None:
    real = compiled_chains._quantized

    def one_level_up(path, x):  # type: ignore[no-untyped-def]
        levels, scale = real(path, x * 1.02)
        return levels, scale

    monkeypatch.setattr(compiled_chains, "_quantized", one_level_up)
    model = _model()
    with caplog.at_level("WARNING"):
        _prefill(model, LENGTHS)
    assert model._chains._compiled is None
    assert "the int8 chains stay eager: the compiled chains differ from the eager chains in" in caplog.text


def test_no_compile_flag_sets_the_config_field() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert EngineConfig().compile is True
    assert engine_config_from_args(parser.parse_args([])).compile is True
    assert engine_config_from_args(parser.parse_args(["--no-compile"])).compile is False
    with pytest.raises(Exception, match="compile must be true or false"):
        EngineConfig(compile="yes")  # type: ignore[arg-type]


_AVX2_CHAINS = """
import json, logging, torch
logging.basicConfig(level=logging.WARNING)
from hybridserve.models.layers.int8 import int8_path
from tests.models.test_compiled_chains import LENGTHS, _last_rows, _model, _prefill
model = _model()
hidden = _prefill(model, LENGTHS)
eager = _prefill(_model(compile=False), LENGTHS)
with torch.inference_mode():
    same = model.greedy_tokens(_last_rows(hidden, LENGTHS)) == model.greedy_tokens(_last_rows(eager, LENGTHS))
print(json.dumps({"path": int8_path(), "compiled": model._chains._compiled is not None, "same_tokens": same,
                  "max_diff": float((hidden.float() - eager.float()).abs().max())}))
"""


@needs_int8_gemm
def test_the_avx2_path_compiles_and_agrees() -> None:
    # As on a CPU with AVX2 alone (as_avx2_env): fbgemm's path, inductor's AVX2 code.
    env = {**os.environ, **as_avx2_env(read_cpu_flags())}
    out = subprocess.run([sys.executable, "-c", _AVX2_CHAINS], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["path"] == FBGEMM
    assert report["compiled"], out.stderr
    assert report["max_diff"] < 0.05 and report["same_tokens"]


def test_prepare_builds_then_checks_again_under_each_call(caplog) -> None:
    """ChainsByRows.prepare: the first call builds; later ones run the check (compiling the
    graphs under the calling thread's count), keep what it keeps, and turn eager for good
    when it finds none or raises."""
    from hybridserve.models.arch.compiled_chains import ChainsByRows

    checks: list[str] = []
    verdicts = iter(["keep", "raise"])

    def check(chains: str) -> str | None:
        checks.append(chains)
        if next(verdicts) == "raise":
            raise RuntimeError("recompile limit reached\nmore")
        return chains + "'"

    by_rows = ChainsByRows("eager", lambda: "compiled", "test chains", min_rows=8, check=check)
    by_rows.prepare()
    assert checks == [] and by_rows.for_rows(8) == "compiled" and by_rows.for_rows(7) == "eager"
    by_rows.prepare()
    assert checks == ["compiled"] and by_rows.for_rows(8) == "compiled'"
    with caplog.at_level("WARNING"):
        by_rows.prepare()
    assert by_rows.for_rows(8) == "eager"
    assert "the test chains turn eager: the compiled chains failed (RuntimeError: recompile limit reached)" \
        in caplog.text
    by_rows.prepare()  # nothing compiled is left to check
    assert checks == ["compiled", "compiled'"]
