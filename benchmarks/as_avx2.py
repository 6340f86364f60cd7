"""`--isa avx2` for the benchmark scripts: run the script again in a process limited as on a
CPU with AVX2 alone (hybridserve.models.cpu_features.as_avx2_env)."""

from __future__ import annotations

import os
import subprocess
import sys

from hybridserve.models.cpu_features import CPU_FLAGS_ENV, as_avx2_env, read_cpu_flags


def rerun_as_avx2() -> int | None:
    """The exit code of this script run again as on an AVX2 CPU, or None where this process
    already runs so (the variables are set) and should measure."""
    if CPU_FLAGS_ENV in os.environ:
        return None
    if "avx2" not in read_cpu_flags():
        print(f"{os.path.basename(sys.argv[0])}: --isa avx2 needs an x86 CPU with AVX2", file=sys.stderr)
        return 2
    return subprocess.run([sys.executable, *sys.argv], env={**os.environ, **as_avx2_env(read_cpu_flags())}).returncode
