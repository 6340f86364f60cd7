"""Where the served time to first token goes: `hybridserve serve` on a model directory under
vllm's serving client (serving_peers.py's workload: 64 x 64 random tokens -> 64, all at
once, temperature 1), a warm-up round then a timed one; prints the client's TTFT/TPOT and
the server's own TTFT histogram (/metrics) for the timed round, so arrival-to-first-token
in the server can be read beside what the client saw. Extra arguments go to the server.

    python benchmarks/served_ttft.py --model-dir DIR --vllm-python PY [-- --max-num-batched-tokens 4096]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving_peers as sp  # noqa: E402

HISTOGRAM = "hybridserve_time_to_first_token_seconds_"


def ttft_histogram(url: str) -> dict[str, float]:
    import httpx

    lines = httpx.get(url + "/metrics").text.splitlines()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in lines if line.startswith(HISTOGRAM))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--vllm-python", required=True)
    p.add_argument("server_args", nargs="*", help="extra `hybridserve serve` arguments (after --)")
    a = argparse.Namespace(**vars(p.parse_args()), input_len=64, output_len=64, num_prompts=64,
                           llamacpp_python=None, gguf=None, hs_args="")
    port = sp.free_port()
    cmd, env = sp.server_command("hybridserve", a, port)
    with tempfile.TemporaryDirectory() as tmp:
        log = open(Path(tmp) / "server.log", "w")
        proc = subprocess.Popen(cmd + a.server_args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp)
        url = f"http://127.0.0.1:{port}"
        try:
            sp.wait_ready(url, proc, 600)
            print("warm-up:", sp.run_client(a, "hybridserve", url, "inf", ["--temperature", "1.0"], Path(tmp), seed=999))
            before = ttft_histogram(url)
            print("timed:", sp.run_client(a, "hybridserve", url, "inf", ["--temperature", "1.0"], Path(tmp), seed=1))
            for key, value in ttft_histogram(url).items():
                if value - before.get(key, 0):
                    print(key, value - before.get(key, 0))
        finally:
            sp.stop_server(proc)
            log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
