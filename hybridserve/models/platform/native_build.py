"""Hand-written C kernels, compiled once per machine by the system's C compiler and loaded
with ctypes.

A kernel's source sits beside the Python that calls it (e.g. models/layers/span_summaries.c);
what kernels share (the vector type, bf16 conversions; AMX's tile setup) is native_vectors.h
and amx_tiles.h in this folder, which every build has on its include path.
It is compiled for the instructions `read_cpu_flags` reports (AVX-512, with AVX512-BF16
where the CPU and the compiler have it; or AVX2 + FMA; or the target's baseline), never
`-march=native`: a cache folder shared by machines of different CPUs (a home directory on
NFS) then holds one library per instruction set, and a run that plays another CPU
(HYBRIDSERVE_CPU_FLAGS, benchmarks' `--isa avx2`) gets that CPU's code. The library's name
carries a digest of the source, the flags and the compiler's version, so an edit or another
compiler builds anew. With `-fopenmp` the library uses the OpenMP runtime already in the
process (torch's libgomp, matched by its soname), so its parallel loops share torch's thread
pool.

Anything that goes wrong (no compiler, a failed build, a library that will not load)
raises NativeBuildError with one line saying what; callers keep their general path
(`checked` logs why and gives None).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import uuid
from functools import cache
from pathlib import Path
from typing import Callable, TypeVar

from hybridserve.core.errors import one_line
from hybridserve.models.platform.cache_dir import cache_root
from hybridserve.models.platform.cpu_features import read_cpu_flags

log = logging.getLogger(__name__)
K = TypeVar("K")
CC_ENV = "CC"
INCLUDE_DIR = Path(__file__).parent  # native_vectors.h
BUILD_TIMEOUT_S = 120
BASE_FLAGS = ("-O3", "-fno-math-errno", "-fPIC", "-shared", "-fopenmp")
_X86 = ("x86_64", "amd64", "i686")


class NativeBuildError(RuntimeError):
    """A native kernel could not be built or loaded (the message says why, on one line)."""


def isa_flags(cpu_flags: frozenset[str], machine: str | None = None) -> tuple[str, ...]:
    """The compiler's instruction-set flags for a CPU with `cpu_flags` (Linux's names)."""
    if (machine or platform.machine()).lower() not in _X86:
        return ()
    if {"avx512f", "avx2", "fma"} <= cpu_flags:
        # AVX512-BF16's conversion rounds a float32 vector to bf16 in one instruction
        # (native_vectors.h's round_bf16), where the CPU has it
        bf16 = ("-mavx512bf16",) if {"avx512_bf16", "avx512bw"} <= cpu_flags else ()
        # AVX512-VNNI's u8 x s8 dot product into int32 (int8_quads.c), where the CPU has it
        vnni = ("-mavx512vnni",) if "avx512_vnni" in cpu_flags else ()
        # AVX512-VBMI's byte permutes (int8_groups.c's vnni_quads), where the CPU has them
        vbmi = ("-mavx512vbmi",) if "avx512vbmi" in cpu_flags else ()
        return ("-mavx512f", "-mavx2", "-mfma", *bf16, *vnni, *vbmi)
    if {"avx2", "fma"} <= cpu_flags:
        return ("-mavx2", "-mfma")
    return ()


def _compiler() -> str:
    name = os.environ.get(CC_ENV, "cc")
    path = shutil.which(name)
    if path is None:
        raise NativeBuildError(f"no C compiler: {name!r} is not on PATH (set {CC_ENV})")
    return path


# Flags a compiler may be too old for (GCC 9 and Clang 9 first took -mavx512bf16, GCC 8 and
# Clang 6 -mavx512vnni): dropped where it refuses them, so the kernels still build, with their
# portable code.
OPTIONAL_FLAGS = ("-mavx512bf16", "-mavx512vnni", "-mavx512vbmi")


@cache
def _accepts(cc: str, flag: str) -> bool:
    """Whether the compiler `cc` compiles an empty file with `flag` (asked once per run)."""
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "empty.c"
        source.write_text("int hybridserve_probe;\n")
        try:
            out = subprocess.run([cc, flag, "-c", str(source), "-o", str(Path(tmp) / "empty.o")],
                                 capture_output=True, timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return out.returncode == 0


def _accepted(cc: str, flags: tuple[str, ...]) -> tuple[str, ...]:
    """`flags` without the optional ones the compiler `cc` refuses."""
    return tuple(f for f in flags if f not in OPTIONAL_FLAGS or _accepts(cc, f))


def _compiler_version(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NativeBuildError(f"the C compiler {cc} does not run: {exc}") from None
    return out.stdout.splitlines()[0] if out.stdout else ""


def library_path(name: str, source: Path, flags: tuple[str, ...], compiler_version: str) -> Path:
    """Where the library of `source` built with `flags` by that compiler lives in the cache
    (the shared headers are part of what it is built from)."""
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(INCLUDE_DIR.glob("*.h")):
        digest.update(header.read_bytes())
    digest.update("\0".join((*flags, compiler_version)).encode())
    return cache_root() / "native" / f"{name}-{digest.hexdigest()[:16]}.so"


def build(name: str, source: Path) -> ctypes.CDLL:
    """The loaded library of the C file `source`: from the cache, or compiled into it first
    (written under a temporary name and renamed, so concurrent builds never load a
    half-written file)."""
    cc = _compiler()
    flags = (*BASE_FLAGS, f"-I{INCLUDE_DIR}", *_accepted(cc, isa_flags(read_cpu_flags())))
    target = library_path(name, source, flags, _compiler_version(cc))
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise NativeBuildError(f"cannot create the cache folder {target.parent}: {exc}") from None
        staging = target.parent / f".tmp-{target.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            out = subprocess.run([cc, *flags, str(source), "-o", str(staging)], capture_output=True, text=True,
                                 timeout=BUILD_TIMEOUT_S)
            if out.returncode != 0:
                lines = [line for line in out.stderr.splitlines() if "error" in line] or out.stderr.splitlines()
                raise NativeBuildError(f"{Path(cc).name} failed on {source.name}: "
                                       f"{lines[0].strip() if lines else f'exit {out.returncode}'}")
            os.replace(staging, target)
        except subprocess.TimeoutExpired:
            raise NativeBuildError(f"{Path(cc).name} took over {BUILD_TIMEOUT_S} s on {source.name}") from None
        except OSError as exc:
            raise NativeBuildError(f"building {source.name}: {exc}") from None
        finally:
            staging.unlink(missing_ok=True)
    try:
        return ctypes.CDLL(str(target))
    except OSError as exc:
        raise NativeBuildError(f"cannot load {target.name}: {exc}") from None


def build_for_spans(name: str, source: Path, span: int) -> ctypes.CDLL:
    """build(name, source) for a kernel that reads logits in spans: its `<name>_span()`
    must be `span` (models/layers/span_logits.SPAN), else ValueError."""
    library = build(name, source)
    reads = getattr(library, f"{name}_span")
    reads.restype = ctypes.c_int32
    if (c_span := reads()) != span:
        raise ValueError(f"{source.name} reads spans of {c_span} logits, span_logits uses {span}")
    return library


def checked(make: Callable[[], K], mismatch: Callable[[K], str], general_path: str) -> K | None:
    """make() (which builds a library), then mismatch(kernel) ('' when its output is right):
    the kernel where both succeed, else None and one warning naming `general_path`, what
    runs instead, and why."""
    try:
        kernel = make()
        reason = mismatch(kernel)
    except NativeBuildError as exc:
        reason = str(exc)  # one line already
    except (OSError, ValueError) as exc:
        reason = one_line(exc)
    if not reason:
        return kernel
    log.warning("%s: the native kernel is not used (%s)", general_path, reason)
    return None
