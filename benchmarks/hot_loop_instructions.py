"""Instructions the scheduler and simulator hot loops execute, start-up excluded (callgrind).

Each loop runs at two sizes, each in a fresh interpreter under `valgrind --tool=callgrind`;
the difference of the two totals is the cost of the extra work alone (imports, start-up
and the fixed part of set-up cancel). Instruction counts do not move with the load of a
shared machine, so this is the measure to compare two commits by (times there vary by
tens of percent between runs):

    python benchmarks/hot_loop_instructions.py                     # all three loops
    python benchmarks/hot_loop_instructions.py --loops scheduler   # one

Loops: "scheduler" is `scheduler_overhead.py`'s (hybrid full + sliding-window model,
async, 2 x max_num_seqs requests of 256 + 256 tokens) at max_num_seqs 128 and 384;
"sim-off" / "sim-on" is `simulate_speed.py`'s simulation (detector off / on) at 128 and
384 requests. Needs valgrind; each loop takes a few minutes.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SIZES = (128, 384)
LOOPS = ("scheduler", "sim-off", "sim-on")


def run_loop(loop: str, size: int) -> None:
    """The loop itself (what runs under callgrind)."""
    sys.path.insert(0, str(REPO))
    if loop == "scheduler":
        from benchmarks.scheduler_overhead import run

        run(size, 128, 256, 256, True, "hybrid-swa")
        return
    from benchmarks.simulate_speed import config
    from hybridserve.sim.simulation import run_simulation
    from hybridserve.sim.workload import WorkloadSpec, generate

    items = generate(WorkloadSpec.from_flags(size, "fixed:512", "fixed:256"), seed=0)
    run_simulation(config(loop == "sim-on"), items, progress=False)


def instructions(loop: str, size: int) -> int:
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, __file__,
         "--run", loop, str(size)],
        capture_output=True, text=True, env=env, cwd=REPO, check=False,
    )
    m = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or m is None:
        raise SystemExit(f"callgrind run of {loop} at {size} failed:\n{done.stderr[-2000:]}")
    return int(m.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loops", nargs="+", choices=LOOPS, default=list(LOOPS))
    p.add_argument("--run", nargs=2, metavar=("LOOP", "SIZE"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.run:
        run_loop(a.run[0], int(a.run[1]))
        return
    print(f"| loop | instructions at {SIZES[0]} | at {SIZES[1]} | difference (the loop's own work) |")
    print("|---|---:|---:|---:|")
    for loop in a.loops:
        small, large = (instructions(loop, n) for n in SIZES)
        print(f"| {loop} | {small:,} | {large:,} | {large - small:,} |", flush=True)


if __name__ == "__main__":
    main()
