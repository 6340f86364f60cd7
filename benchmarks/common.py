"""What the benchmark scripts share: the header line that says what ran where, `--isa avx2`
(run the script again in a process limited as on a CPU with AVX2 alone), and the median
time of a call."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from hybridserve.models.platform.cpu_features import CPU_FLAGS_ENV, as_isa_env, read_cpu_flags

REPO = Path(__file__).resolve().parents[1]


def median_seconds(f, repeat: int, warmup: int = 1) -> float:  # type: ignore[no-untyped-def]
    """Median seconds of `repeat` calls of f(), after `warmup` untimed ones."""
    for _ in range(warmup):
        f()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def checkout_commit(repo: Path = REPO) -> str:
    """The short commit of a checkout, this one by default (empty outside git)."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=repo).stdout.strip()


def checkout_dir(text: str) -> Path:
    """argparse type: a hybridserve repository root (a checkout to compare)."""
    path = Path(text)
    if not (path / "hybridserve").is_dir():
        raise argparse.ArgumentTypeError(f"not a hybridserve checkout: {text}")
    return path


def torch_header(threads: int | None, flag_prefixes: tuple[str, ...]) -> str:
    """Set torch's thread count (where `threads` is given) and return the script's header:
    commit, threads, the CPU flags starting with `flag_prefixes`, oneDNN's and fbgemm's ISA
    limits, load."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    flags = " ".join(sorted(f for f in read_cpu_flags() if f.startswith(flag_prefixes)))
    return (f"# commit {checkout_commit()}; {torch.get_num_threads()} threads; flags {flags or 'none of ' + '/'.join(flag_prefixes)}; "
            f"{isa_limits()}; load {os.getloadavg()[0]:.1f}")


def isa_limits() -> str:
    """The kernel libraries' ISA limits in force in this process (as_isa_env sets them)."""
    return "; ".join(f"{name}={os.environ.get(name, 'unset')}" for name in ("ONEDNN_MAX_CPU_ISA", "FBGEMM_ENABLE_INSTRUCTIONS"))


def rerun_as_avx2() -> int | None:
    """The exit code of this script run again as on an AVX2 CPU, or None where this process
    already runs so (the variables are set) and should measure."""
    return rerun_as("avx2")


def rerun_as(isa: str) -> int | None:
    """rerun_as_avx2 for any of cpu_features.ISA_KINDS (as_isa_env), from a CPU that has
    what that kind has."""
    if CPU_FLAGS_ENV in os.environ:
        return None
    needed = {"avx2": "avx2", "avx512": "avx512f", "avx512-bf16": "avx512_bf16"}[isa]
    if needed not in read_cpu_flags():
        print(f"{os.path.basename(sys.argv[0])}: --isa {isa} needs an x86 CPU with {needed}", file=sys.stderr)
        return 2
    env = {**os.environ, **as_isa_env(isa, read_cpu_flags())}
    return subprocess.run([sys.executable, *sys.argv], env=env).returncode


def tree_status_kib(pid: int, field: str) -> int:
    """Sum of /proc/PID/status's `field` (VmRSS, VmHWM: kB) over `pid` and its descendants
    still running."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith(field + ":"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total
