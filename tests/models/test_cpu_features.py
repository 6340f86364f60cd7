"""models/platform/cpu_features.py: the dtype / quantization choice from given CPU flag sets, and the flags' parsing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridserve.config import EngineConfig
from hybridserve.core.errors import ConfigError
from hybridserve.models.platform.cpu_features import (
    CPU_FLAGS_ENV,
    ISA_KINDS,
    as_avx2_env,
    as_isa_env,
    choose_dtype,
    choose_quantization,
    describe,
    has_native_bf16,
    read_cpu_flags,
)

SAPPHIRE_RAPIDS_NO_AMX = {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16"}
SAPPHIRE_RAPIDS_AMX = {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile"}
AMX_ONLY = {"avx2", "avx512f", "amx_bf16"}
EPYC_AVX2 = {"avx", "avx2", "fma", "f16c"}
ICELAKE_AVX512_NO_BF16 = {"avx2", "avx512f", "avx512_vnni"}


@pytest.mark.parametrize("flags, want", [
    (SAPPHIRE_RAPIDS_NO_AMX, "bfloat16"),
    (SAPPHIRE_RAPIDS_AMX, "bfloat16"),
    (AMX_ONLY, "bfloat16"),
    (EPYC_AVX2, "float32"),
    (ICELAKE_AVX512_NO_BF16, "float32"),  # AVX-512 alone converts bf16 in software
    (set(), "float32"),
])
def test_auto_dtype_on_cpu_follows_native_bf16(flags: set[str], want: str) -> None:
    assert choose_dtype("auto", "cpu", frozenset(flags)) == want


def test_explicit_dtype_and_other_devices() -> None:
    assert choose_dtype("float32", "cpu", frozenset(SAPPHIRE_RAPIDS_AMX)) == "float32"
    assert choose_dtype("bfloat16", "cpu", frozenset(EPYC_AVX2)) == "bfloat16"
    assert choose_dtype("auto", "cuda", frozenset(SAPPHIRE_RAPIDS_AMX)) == "float32"


def test_quantization_choice() -> None:
    vnni = frozenset({"avx512f", "avx512_bf16", "avx512_vnni"})
    # the second argument is the dtype as the user asked for it, "auto" included
    # native bf16: the decoder in bf16, the head int8 x int8 (issue 40's accuracy bar)
    assert choose_quantization("auto", "auto", "cpu", vnni) == "int8-head"
    assert choose_quantization("auto", "bfloat16", "cpu", vnni) == "int8-head"
    assert choose_quantization("auto", "auto", "cpu", frozenset(SAPPHIRE_RAPIDS_AMX)) == "int8-head"
    # a GGUF whose decoder is int8 groups (its kernel built): its own values on every CPU with
    # an int8 GEMM (the accuracy bar: every linear int8 misses it, in 63 levels or 127)
    assert choose_quantization("auto", "auto", "cpu", frozenset(SAPPHIRE_RAPIDS_AMX), True) == "gguf-groups"
    assert choose_quantization("auto", "bfloat16", "cpu", frozenset(SAPPHIRE_RAPIDS_AMX), True) == "gguf-groups"
    assert choose_quantization("auto", "auto", "cpu", vnni, True) == "gguf-groups"  # AVX512-BF16, no AMX
    assert choose_quantization("auto", "auto", "cpu", frozenset({"avx2", "avx_vnni"}), True) == "gguf-groups"
    assert choose_quantization("auto", "auto", "cpu", frozenset(EPYC_AVX2), True) == "gguf-groups"
    assert choose_quantization("auto", "float32", "cpu", frozenset(SAPPHIRE_RAPIDS_AMX), True) == "none"
    assert choose_quantization("auto", "float32", "cpu", frozenset(EPYC_AVX2), True) == "none"
    # the groups' kernels take the dtype auto picks, or bf16 named where it is native
    assert choose_quantization("auto", "float16", "cpu", frozenset(SAPPHIRE_RAPIDS_AMX), True) == "int8"
    assert choose_quantization("auto", "bfloat16", "cpu", frozenset(EPYC_AVX2), True) == "int8"
    # int8 dot products without native bf16: a bf16 decoder would run float32 kernels, so every linear int8
    assert choose_quantization("auto", "bfloat16", "cpu", frozenset({"avx2", "avx_vnni"})) == "int8"
    assert choose_quantization("auto", "auto", "cpu", frozenset({"avx2", "avx512f", "avx512_vnni"})) == "int8"
    # AVX2 alone: oneDNN's int8 GEMM with narrowed weights, float32 activations under --dtype auto
    assert choose_quantization("auto", "auto", "cpu", frozenset(EPYC_AVX2)) == "int8"
    assert choose_quantization("auto", "bfloat16", "cpu", frozenset(EPYC_AVX2)) == "int8"
    # float32 named by the user is the exact reference and stays exact, on every CPU
    assert choose_quantization("auto", "float32", "cpu", vnni) == "none"
    assert choose_quantization("auto", "float32", "cpu", frozenset(EPYC_AVX2)) == "none"
    # no int8 GEMM: AVX alone, an ARM flag set, a GPU
    assert choose_quantization("auto", "auto", "cpu", frozenset({"avx", "fma", "sse4_2"})) == "none"
    assert choose_quantization("auto", "auto", "cpu", frozenset({"fp", "asimd", "asimddp"})) == "none"
    assert choose_quantization("auto", "bfloat16", "cuda", vnni) == "none"
    named = ["none", "int8", "int8-head", "int4", "q4", "gguf-groups"]
    assert [choose_quantization(q, "float32", "cpu", vnni) for q in named] == named


def test_as_avx2_env_hides_what_an_avx2_cpu_lacks() -> None:
    zen5 = frozenset({"fma", "avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx_ifma", "f16c"})
    env = as_avx2_env(zen5)
    assert env == {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
                   CPU_FLAGS_ENV: "avx2 f16c fma"}
    assert choose_dtype("auto", "cpu", frozenset(env[CPU_FLAGS_ENV].split())) == "float32"


def test_as_isa_env_runs_as_each_kind_of_cpu() -> None:
    spr = frozenset({"fma", "avx2", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "avx512_fp16",
                     "avx512_bitalg", "avx_vnni", "amx_bf16", "amx_int8", "amx_tile", "f16c"})
    envs = {isa: as_isa_env(isa, spr) for isa in ISA_KINDS}
    assert envs["avx2"] == as_avx2_env(spr)
    # Skylake-SP: AVX-512's core flags alone, float32 activations (no native bf16)
    assert envs["avx512"] == {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX512",
                              CPU_FLAGS_ENV: "avx2 avx512bw avx512f avx512vl f16c fma"}
    # Zen 4: BF16 and VNNI kept, AMX, FP16 and AVX-VNNI gone, bf16 activations
    assert envs["avx512-bf16"] == {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
                                   CPU_FLAGS_ENV: "avx2 avx512_bf16 avx512_bitalg avx512_vnni avx512bw avx512f avx512vl "
                                                  "f16c fma"}
    dtypes = [choose_dtype("auto", "cpu", frozenset(envs[isa][CPU_FLAGS_ENV].split())) for isa in ISA_KINDS]
    assert dtypes == ["float32", "float32", "bfloat16"]
    with pytest.raises(ValueError, match="unknown CPU kind 'sse4'"):
        as_isa_env("sse4", spr)


def test_describe_names_the_reason() -> None:
    assert describe("bfloat16", "none", frozenset(SAPPHIRE_RAPIDS_AMX)) == \
        "dtype bfloat16, quantization none (native bf16: amx_bf16, avx512_bf16)"
    assert describe("bfloat16", "int8", frozenset(SAPPHIRE_RAPIDS_NO_AMX)) == \
        "dtype bfloat16, quantization int8 (native bf16: avx512_bf16; int8 dot products: avx512_vnni)"
    assert describe("bfloat16", "int8-head", frozenset(SAPPHIRE_RAPIDS_NO_AMX)) == \
        "dtype bfloat16, quantization int8-head (native bf16: avx512_bf16; int8 dot products: avx512_vnni)"
    assert describe("bfloat16", "gguf-groups", frozenset(SAPPHIRE_RAPIDS_NO_AMX)) == \
        "dtype bfloat16, quantization gguf-groups (native bf16: avx512_bf16; int8 dot products: avx512_vnni; " \
        "the decoder's linears as the GGUF's own int8 groups)"
    assert describe("float32", "int8", frozenset(EPYC_AVX2)) == \
        "dtype float32, quantization int8 (no native bf16 (avx512_bf16 / amx_bf16); int8 GEMM on AVX2, " \
        "weights in 63 levels)"
    assert describe("float32", "gguf-groups", frozenset(EPYC_AVX2)) == \
        "dtype float32, quantization gguf-groups (no native bf16 (avx512_bf16 / amx_bf16); int8 GEMM on AVX2, " \
        "weights in 63 levels; the decoder's linears as the GGUF's own int8 groups, int16 dot products)"


def test_read_cpu_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CPU_FLAGS_ENV, raising=False)  # a run as another CPU (--isa avx2) sets it
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu avx2 avx512_bf16\n\n"
                       "processor\t: 1\nflags\t\t: fpu avx2 avx512_bf16\n")
    assert read_cpu_flags(cpuinfo) == frozenset({"fpu", "avx2", "avx512_bf16"})
    assert has_native_bf16(read_cpu_flags(cpuinfo))
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert not has_native_bf16(read_cpu_flags(arm))  # ARM's bf16 is not the x86 flag
    assert read_cpu_flags(tmp_path / "missing") == frozenset()


def test_cpu_flags_from_the_environment_override_cpuinfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16 avx512_vnni\n")
    monkeypatch.setenv("HYBRIDSERVE_CPU_FLAGS", "avx avx2 fma")
    flags = read_cpu_flags(cpuinfo)
    assert flags == frozenset({"avx", "avx2", "fma"})
    assert choose_dtype("auto", "cpu", flags) == "float32"
    assert choose_quantization("auto", "auto", "cpu", flags) == "int8"
    monkeypatch.setenv("HYBRIDSERVE_CPU_FLAGS", "avx fma")
    assert choose_quantization("auto", "auto", "cpu", read_cpu_flags(cpuinfo)) == "none"


def test_config_defaults_and_bad_values() -> None:
    config = EngineConfig()
    assert (config.dtype, config.quantization) == ("auto", "auto")
    with pytest.raises(ConfigError, match=r"quantization must be one of auto, none, int8, int8-head, int4, q4, "
                                          r"gguf-groups, got 'int3'"):
        EngineConfig(quantization="int3")


def test_cli_rejects_unknown_quantization_in_one_line() -> None:
    out = subprocess.run([sys.executable, "-m", "hybridserve.entrypoints.cli", "generate", "--quantization", "fp8",
                          "hi"], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "argument --quantization: invalid choice: 'fp8'" in out.stderr


def test_the_entry_points_set_a_short_openmp_spin_unless_the_user_chose_a_wait() -> None:
    """`import hybridserve` alone changes nothing; reaching the engine through the package's
    names, or the command line, sets the spin before torch loads (torch is loaded by
    neither: the engine loads it later, as the `import torch` here does)."""
    show = "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    repo = Path(__file__).resolve().parents[2]

    def run(code: str, **extra: str) -> str:
        return subprocess.run([sys.executable, "-c", f"import os, sys, hybridserve; {code}; {show}"],
                              env={**env, **extra}, capture_output=True, text=True, cwd=repo).stdout.strip()

    assert run("pass") == "None None False"
    assert run("hybridserve.LLM; import torch") == "10000 None True"
    assert run("hybridserve.LLM; import torch", OMP_WAIT_POLICY="ACTIVE") == "None ACTIVE True"
    assert run("hybridserve.LLM; import torch", GOMP_SPINCOUNT="5") == "5 None True"
    out = subprocess.run([sys.executable, "-c", f"import os, sys\nfrom hybridserve.entrypoints import cli\n"
                          f"try:\n    cli.main(['--version'])\nexcept SystemExit:\n    pass\n{show}"],
                         env=env, capture_output=True, text=True, cwd=repo).stdout.strip().splitlines()[-1]
    assert out.startswith("10000 None")
