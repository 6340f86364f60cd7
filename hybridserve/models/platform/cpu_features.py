"""What the CPU multiplies natively, and the serving dtype and weight quantization that follow.

Pure Python over a set of /proc/cpuinfo flag names, so tests pass flag sets in and the
engine decides before importing torch or loading weights.

Why these rules (figures: benchmarks/results/cpu_kernels.md and cpu_peers.md):
- bfloat16 halves the bytes every decode step reads (weights and KV); with AVX512-BF16 or
  AMX-BF16 the dot products run natively, so bf16 is faster than float32. Without either,
  bf16 is converted in software and can be slower: float32 stays the default there (a
  bf16 model named there runs its linears as float32 kernels: models/layers/linear.py).
- At decode batches of 16-64 the matmuls are compute-bound, and without AMX int8 dot
  products (VNNI) do twice the multiply-adds of bf16 ones per instruction; at one row int8
  reads half bf16's bytes. `--quantization int8` runs every linear as int8 x int8
  (models/layers/int8.py): the output head (most of a large-vocabulary model) and the
  decoder's linears, whose activations are smoothed first (models/layers/smoothing.py).
  Accuracy decides the default, measured against float32 (benchmarks/kl_accuracy.py,
  benchmarks/quant_accuracy.py) and bounded in tests/models/test_accuracy.py: int8
  decoder linears cost five times the next-token KL divergence llama.cpp has on the same
  GGUF, the smoothed int8 x int8 head about half of it. So where bf16 is native `auto` is
  `int8-head`: the decoder in bf16, the head int8 x int8 (one stream pays for the decoder's
  bytes; batches of 16+ run about as fast as with every linear int8). `none` quantizes
  nothing. A float32 model named by the user (`--dtype float32`) keeps its exact linears:
  it is the reference that equals HF token for token.
- A GGUF's decoder is already int8 groups (Q8_0, Q5_0, Q6_K, Q4_K blocks): `gguf-groups`
  multiplies those values as the file stores them (models/layers/int8_groups.py), about
  1.1 bytes a weight instead of bf16's 2, the head int8 as in int8-head. With AMX its
  kernels beat the bf16 decoder from one row to 64 (one stream 1.27x, 16 x 64 1.10x, 64 x
  128 even; prefill 1.09x slower: benchmarks/results/group_int8_kernels.md) at the same
  KL divergence, in less memory; with AVX512-BF16 alone (measured with AMX hidden) its
  decoder matmuls take 0.50-0.95x bf16's at 1-8 rows and 1.03-1.11x at 16-1024. So where
  bf16 is native `auto` takes it when the model is such a GGUF (`groups_servable`) and
  the kernel is built.
- On AVX2 alone (no native bf16, no VNNI) activations are float32 and the int8 x int8
  GEMM takes weights in 63 levels, so that AVX2's int16 pair sums cannot saturate
  (models/layers/int8.py). Every linear int8 there is fast (fbgemm) but errs 6.5x llama.cpp's
  KL divergence (0.0174 against 0.00265, as on such a CPU: benchmarks/kl_accuracy.py under
  as_avx2_env); the GGUF's own groups with the int8 head, smoothed for 63 levels, err
  0.0020: the bar is met. Their kernel's int16 dot products there (inputs rounded to 2^-16
  of each group's largest, the same 0.0020), in the float32 decode stack, serve one stream
  1.5x, 16 x 64 1.43x and 64 x 128 0.98x every linear int8 (prefill's matmuls take 1.3x
  int8's time: benchmarks/results/cpu_peers.md, group_int8_kernels.md). So `auto` takes
  gguf-groups there too where the model is such a GGUF, and int8 for other models, whose
  alternative is float32 kernels (four times the bytes). Weight-only int8 (PyTorch's
  kernel) re-reads the weight per row, slower than bf16 at decode batches: not chosen
  automatically.
"""

from __future__ import annotations

import os
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
CPU_FLAGS_ENV = "HYBRIDSERVE_CPU_FLAGS"
OMP_WAIT_POLICY = "OMP_WAIT_POLICY"
GOMP_SPINCOUNT = "GOMP_SPINCOUNT"
# Busy-wait iterations of an idle OpenMP thread before it sleeps (prefer_short_omp_spin).
SHORT_SPIN_COUNT = 10_000
# Flags (as Linux spells them) of instructions that multiply bf16 in hardware.
AMX_BF16 = "amx_bf16"
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", AMX_BF16})
GGUF_GROUPS = "gguf-groups"  # --quantization: the decoder as the GGUF's own int8 groups (models/layers/head.GROUP_LAYERS)
# Flags of int8 dot-product instructions (u8 x s8 -> s32 without an int16 step that saturates).
NATIVE_INT8_DOT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})
# Prefixes of the flags a CPU with AVX2 alone lacks (as_avx2_env hides them).
NOT_AVX2_PREFIXES = ("avx512", "amx", "avx_vnni", "avx_ne_convert", "avx_ifma")
# The AVX-512 flags of a Skylake-SP class CPU (as_isa_env("avx512") keeps only these).
SKYLAKE_AVX512 = frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})
# Prefixes of the flags a Zen 4 class CPU (AVX512-BF16 and VNNI, no AMX) lacks.
NOT_ZEN4_PREFIXES = ("amx", "avx512_fp16", "avx_vnni", "avx_ne_convert", "avx_ifma")
# The CPU kinds as_isa_env makes a process run as.
ISA_KINDS = ("avx2", "avx512", "avx512-bf16")


def read_cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The flags the engine decides with: HYBRIDSERVE_CPU_FLAGS (space-separated) where set,
    to make the choices of another CPU on this one (benchmarks/cpu_peers.py --isa avx2
    limits oneDNN and ATen to AVX2 and sets it so), else those of the first processor in
    `cpuinfo`; empty where the file is missing (non-Linux) or lists no flags (e.g. ARM
    spells them "Features"): treated as no bf16."""
    if CPU_FLAGS_ENV in os.environ:
        return frozenset(os.environ[CPU_FLAGS_ENV].split())
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def as_avx2_env(flags: frozenset[str] | set[str]) -> dict[str, str]:
    """Environment variables that make a process on this x86 CPU run as on one with AVX2
    alone (no AVX-512, AMX or VNNI): oneDNN, fbgemm and ATen limited to AVX2 code, and hybridserve
    choosing from `flags` less what such a CPU lacks. How AVX2 choices are measured and
    tested on the AVX-512 machines we have (benchmarks/cpu_peers.py --isa avx2)."""
    return as_isa_env("avx2", flags)


def as_isa_env(isa: str, flags: frozenset[str] | set[str]) -> dict[str, str]:
    """as_avx2_env for each kind of CPU of ISA_KINDS: "avx2" (AVX2 alone), "avx512"
    (AVX-512 without BF16, VNNI or AMX: Skylake-SP class; oneDNN and fbgemm limited to
    AVX512_CORE code), "avx512-bf16" (AVX512-BF16 and VNNI without AMX: Zen 4 class; oneDNN
    limited to AVX512_CORE_BF16); hybridserve choosing from `flags` less what that CPU
    lacks. How goal-1-style measurements reach every CPU kind from one AMX machine
    (benchmarks/step_share.py --isa)."""
    if isa == "avx2":
        kept = {f for f in flags if not f.startswith(NOT_AVX2_PREFIXES)}
        limits = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2"}
    elif isa == "avx512":
        kept = {f for f in flags if f in SKYLAKE_AVX512 or not f.startswith(NOT_AVX2_PREFIXES)}
        limits = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX512"}
    elif isa == "avx512-bf16":
        kept = {f for f in flags if not f.startswith(NOT_ZEN4_PREFIXES)}
        limits = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
    else:
        raise ValueError(f"unknown CPU kind {isa!r}; use one of {', '.join(ISA_KINDS)}")
    return {**limits, CPU_FLAGS_ENV: " ".join(sorted(kept))}


def has_native_bf16(flags: frozenset[str] | set[str]) -> bool:
    return not NATIVE_BF16_FLAGS.isdisjoint(flags)


def has_int8_dot(flags: frozenset[str] | set[str]) -> bool:
    return not NATIVE_INT8_DOT_FLAGS.isdisjoint(flags)


def choose_dtype(requested: str, device_type: str, flags: frozenset[str] | set[str]) -> str:
    """The dtype to serve in: `requested` unless it is "auto"; "auto" is bfloat16 on a CPU
    with native bf16 and float32 everywhere else (GPUs keep the float32 default)."""
    if requested != "auto":
        return requested
    return "bfloat16" if device_type == "cpu" and has_native_bf16(flags) else "float32"


def has_int8_gemm(flags: frozenset[str] | set[str]) -> bool:
    """Whether oneDNN's u8 x s8 GEMM runs well here: int8 dot products, or AVX2's
    vpmaddubsw with weights narrowed to 63 levels (models/layers/int8.gemm_weight_levels)."""
    return has_int8_dot(flags) or "avx2" in flags


def choose_quantization(requested: str, requested_dtype: str, device_type: str,
                        flags: frozenset[str] | set[str], groups_servable: bool = False) -> str:
    """The quantization to serve with: `requested` unless it is "auto" (the rules and their
    measurements: this module's docstring). "auto" on a CPU with an int8 GEMM
    (has_int8_gemm) is gguf-groups where `groups_servable` (the model is a GGUF whose
    decoder gguf-groups serves, default_model.groups_servable, and its kernel is built) and
    the dtype is auto's or bf16 where it is native;
    otherwise int8-head where bf16 is native and the model is served in bf16, and int8
    elsewhere; "none" on other devices and CPUs, and where the user named float32 as the
    dtype (`requested_dtype`): a float32 model asked for by name is the exact reference
    that equals HF token for token."""
    if requested != "auto":
        return requested
    if device_type != "cpu" or not has_int8_gemm(flags) or requested_dtype == "float32":
        return "none"
    native_bf16 = has_native_bf16(flags) and requested_dtype in ("auto", "bfloat16")
    # the groups' kernels take bf16 or float32 activations: the dtype auto picks, or bf16 named where it is native
    if groups_servable and (native_bf16 or requested_dtype == "auto"):
        return GGUF_GROUPS
    return "int8-head" if native_bf16 else "int8"


def describe(dtype: str, quantization: str, flags: frozenset[str] | set[str]) -> str:
    """The start-up line saying what was chosen and why."""
    native = sorted(NATIVE_BF16_FLAGS & set(flags))
    why = f"native bf16: {', '.join(native)}" if native else "no native bf16 (avx512_bf16 / amx_bf16)"
    if quantization in ("int8", "int8-head", GGUF_GROUPS):  # the last two: an int8 head
        dot = sorted(NATIVE_INT8_DOT_FLAGS & set(flags))
        why += f"; int8 dot products: {', '.join(dot)}" if dot else "; int8 GEMM on AVX2, weights in 63 levels"
    if quantization == GGUF_GROUPS:
        why += "; the decoder's linears as the GGUF's own int8 groups"
        # without native bf16 their kernel's i16 path (models/layers/int8_groups.py)
        why += ", AMX" if AMX_BF16 in flags else "" if native else ", int16 dot products"
    return f"dtype {dtype}, quantization {quantization} ({why})"


def prefer_short_omp_spin() -> None:
    """Make torch's OpenMP threads spin briefly (GOMP_SPINCOUNT = SHORT_SPIN_COUNT) and then
    sleep between parallel regions, unless the user chose a wait policy or spin count.

    Why neither extreme: a decode step is hundreds of small element-wise regions, so
    threads that sleep at once pay a futex wake-up per region, while threads that spin
    long (libgomp's unset default) steal time slices from other busy processes on a shared
    machine; a short spin covers the gap between the ops of one step and then yields
    (benchmarks/results/omp_spin.md; `benchmarks/cpu_peers.py --hs-omp spin,passive,libgomp
    --busy 2` measures it). libgomp reads the variables once, when torch loads it, so the
    entry points call this before they import torch (the lazy names of `hybridserve`, the
    `hybridserve` command); a process that imported torch first keeps its setting. Intel's
    OpenMP (not what torch's wheels link) would ignore them."""
    if OMP_WAIT_POLICY in os.environ or GOMP_SPINCOUNT in os.environ:
        return
    os.environ[GOMP_SPINCOUNT] = str(SHORT_SPIN_COUNT)
