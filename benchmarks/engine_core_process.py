"""The engine in the server's process (a thread) against the engine in its own process,
and D data-parallel core replicas: `hybridserve bench --url` against `hybridserve serve`
in each layout, rounds interleaved so load drifts hit every layout alike.

    python benchmarks/engine_core_process.py                          # default model, 2 rounds
    python benchmarks/engine_core_process.py --model PATH --layouts thread core dp2 --rounds 3

Prints one line per run (output tokens/s, TTFT and TPOT medians) and the median per
layout. Layouts: thread (--no-engine-core-process), core (the default), dp2
(--data-parallel-size 2, one thread each).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.helpers.server_proc import running_server  # noqa: E402

LAYOUTS = {
    "thread": ("--no-engine-core-process",),
    "core": (),
    "dp2": ("--data-parallel-size", "2", "--num-threads", "1"),
}


def bench(url: str, a: argparse.Namespace) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "hybridserve.entrypoints.cli", "bench", "--url", url,
                        "--num-prompts", str(a.num_prompts), "--input-len", str(a.input_len),
                        "--output-len", str(a.output_len), "--json", out.name],
                       check=True, cwd=REPO, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory or .gguf (default: the default model)")
    p.add_argument("--layouts", nargs="+", default=["thread", "core"], choices=list(LAYOUTS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    a = p.parse_args()
    rows: dict[str, list[dict]] = {name: [] for name in a.layouts}
    for rnd in range(a.rounds):
        for name in a.layouts:
            with running_server(Path(a.model) if a.model else None, *LAYOUTS[name], name="bench") as srv:
                r = bench(srv["url"], a)
            rows[name].append(r)
            print(f"round {rnd} {name:6s} output {r['output_tok_s']:7.1f} tok/s  "
                  f"TTFT median {r['ttft_ms']['median']:7.1f} ms  TPOT median {r['tpot_ms']['median']:6.1f} ms",
                  flush=True)
    for name, runs in rows.items():
        print(f"median {name:6s} output {statistics.median(r['output_tok_s'] for r in runs):7.1f} tok/s  "
              f"TTFT {statistics.median(r['ttft_ms']['median'] for r in runs):7.1f} ms  "
              f"TPOT {statistics.median(r['tpot_ms']['median'] for r in runs):6.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
