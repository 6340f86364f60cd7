"""`hybridserve simulate`: capacity planning for a hybrid model on a GPU you may not own.

Error contract: a bad flag value or a malformed trace line prints one line on stderr
naming the flag or file:line, and exits 2, never a traceback. A violation found by the
race detector in the default (safe) mode is an engine bug: the command exits 1.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Any, NoReturn, Sequence

from hybridserve.core.errors import HybridServeError
from hybridserve.core.kv.spec import DTYPE_BYTES

PROG = "hybridserve simulate"
DESCRIPTION = "Simulate a serving workload for a model layout on a GPU preset (capacity planning)."
WORKLOAD_FLAGS = ("num_requests", "prompt_len", "output_len", "arrival_rate", "prefix_groups", "prefix_len", "trace", "seed")
UNSAFE_WARNING = (
    "WARNING: --unsafe-optimistic-free frees out-of-window KV blocks on the optimistic token count. "
    "Steps still in flight can then read blocks that were freed and reused: this is the race the engine "
    "exists to prevent. Research use only; throughput numbers from this mode are not achievable safely."
)


class FlagError(HybridServeError, ValueError):
    """A flag value is out of range."""


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but errors are one line (no usage block), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {_hint(message)}\n")


def _hint(message: str) -> str:
    # argparse reads `--compare --sync` as two flags; the value must be attached.
    if message.startswith("argument --compare") and "expected one argument" in message:
        return message + " (attach flag values with '=': --compare='--sync')"
    return message


def _add_arguments(p: argparse.ArgumentParser) -> None:
    BOA = argparse.BooleanOptionalAction
    hw = p.add_argument_group("hardware and model")
    hw.add_argument("--gpu", default="H100", help="H100, H200, A100-80GB or L40S (default: %(default)s)")
    hw.add_argument("--model-layout", default="gemma3-27b-like",
                    help="gemma3-27b-like, gpt-oss-120b-like, command-r7b-like, llama4-scout-like, jamba-like "
                         "(its weights need --gpu H200 or --pipeline-parallel-size 2), bamba-9b-like, llama3-8b-like "
                         "(default: %(default)s)")
    hw.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    hw.add_argument("--num-blocks", type=int, default=None, help="override the KV pool size (blocks, null block included)")
    hw.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                    help="share of GPU memory for weights + KV cache, in (0, 1] (default: 0.9)")
    hw.add_argument("--kv-cache-dtype", default="bfloat16", choices=sorted(DTYPE_BYTES),
                    help="KV cache element type (default: bfloat16)")
    hw.add_argument("--pipeline-parallel-size", type=int, default=1,
                    help="pipeline stages: the layers split over this many GPUs, as many steps in flight "
                         "(default: 1)")
    eng = p.add_argument_group("engine")
    eng.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens per step (default: 8192)")
    eng.add_argument("--max-num-seqs", type=int, default=256, help="requests per step (default: 256)")
    eng.add_argument("--max-model-len", type=int, default=None, help="default: longest request, at least 8192")
    mode = eng.add_mutually_exclusive_group()
    mode.add_argument("--async", dest="async_scheduling", action="store_true", default=True,
                      help="schedule one step ahead of the GPU (default)")
    mode.add_argument("--sync", dest="async_scheduling", action="store_false",
                      help="schedule a step only after the previous one returned (default: --async)")
    eng.add_argument("--num-speculative-tokens", type=int, default=0,
                     help="draft tokens per decode step (default: 0, off)")
    eng.add_argument("--acceptance-rate", type=float, default=0.7, help="per-draft acceptance probability (default: 0.7)")
    eng.add_argument("--enable-prefix-caching", action=BOA, default=True, help="(default: on)")
    eng.add_argument("--full-sequence-must-fit", action=BOA, default=False,
                     help="admit a request only if prompt + max_tokens fit by the admission caps (default: off)")
    eng.add_argument("--window-tail", dest="window_tail_allocation", action=BOA, default=None,
                     help="sliding-window groups hold only the window and each chunk's tail (default: on)")
    eng.add_argument("--max-in-flight-tokens", type=int, default=None,
                     help="override the in-flight allowance (default: concurrent batches * max-num-batched-tokens)")
    eng.add_argument("--connector", action=BOA, default=False, help="simulated CPU KV offload connector (default: off)")
    eng.add_argument("--connector-capacity-blocks", type=int, default=4096, help="host-memory blocks of the connector (default: 4096)")
    eng.add_argument("--connector-max-delay-steps", type=int, default=3,
                     help="a connector load/store finishes 0..N steps after it starts (default: 3)")
    eng.add_argument("--connector-failure-rate", type=float, default=0.0, help="probability a loaded block fails (default: 0)")
    eng.add_argument("--detector", action=BOA, default=True, help="shadow-KV race detector (default: on)")
    eng.add_argument("--unsafe-optimistic-free", action=BOA, default=False,
                     help="RESEARCH ONLY: free on the optimistic count (the race the detector catches; default: off)")
    wl = p.add_argument_group("workload")
    wl.add_argument("--num-requests", type=int, default=200, help="requests in the workload (default: 200)")
    # Prompts up to 4x the presets' 1,024-token windows, so the window (and --window-tail) matters.
    wl.add_argument("--prompt-len", default="uniform:512:4096",
                    help="N or fixed:N, uniform:LO:HI or lognormal:MEAN:SIGMA (default: uniform:512:4096)")
    wl.add_argument("--output-len", default="uniform:32:256", help="as --prompt-len (default: uniform:32:256)")
    wl.add_argument("--arrival-rate", type=float, default=None, help="Poisson requests/s (default: all at t=0)")
    wl.add_argument("--prefix-groups", type=int, default=0,
                    help="requests share one of this many prompt prefixes (default: 0, none)")
    wl.add_argument("--prefix-len", type=int, default=0, help="tokens of each shared prefix (default: 0)")
    wl.add_argument("--trace", default=None, metavar="FILE.jsonl",
                    help="JSONL lines {prompt_len, output_len, arrival_time[, prefix_id[, prefix_len]]}")
    wl.add_argument("--seed", type=int, default=0, help="workload random seed (default: 0)")
    out = p.add_argument_group("output")
    out.add_argument("--json", default=None, metavar="OUT.json", help="also write the report as JSON")
    out.add_argument("--plot", default=None, metavar="OUT.png", help="also plot KV usage and throughput over time")
    out.add_argument("--compare", default=None, metavar="'FLAGS'",
                     help="simulate a second configuration (these flags over the first) on the same workload "
                          "and print both with their ratio, e.g. --compare='--sync'")
    out.add_argument("--progress", action=BOA, default=None, help="progress bar (default: when stderr is a terminal)")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `simulate` on the CLI's subparsers; `run(args)` handles the parsed namespace."""
    p = subparsers.add_parser("simulate", help="simulate a serving workload on a GPU preset",
                              description=DESCRIPTION)
    # One-line errors for bad values in this subcommand, whatever parser class the CLI uses.
    p.error = lambda message: _one_line_exit(message)  # type: ignore[method-assign]
    _add_arguments(p)
    p.set_defaults(func=run)
    return p


def _one_line_exit(message: str) -> NoReturn:
    sys.stderr.write(f"{PROG}: error: {_hint(message)}\n")
    raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog=PROG, description=DESCRIPTION)
    _add_arguments(p)
    return p


def _check(ok: bool, flag: str, value: Any, need: str) -> None:
    if not ok:
        raise FlagError(f"argument {flag}: must be {need}, got {value}")


def _validate(a: argparse.Namespace) -> None:
    for flag, v in (("--block-size", a.block_size), ("--max-num-batched-tokens", a.max_num_batched_tokens),
                    ("--max-num-seqs", a.max_num_seqs), ("--pipeline-parallel-size", a.pipeline_parallel_size),
                    ("--num-requests", a.num_requests)):
        _check(v >= 1, flag, v, ">= 1")
    for flag, v in (("--num-speculative-tokens", a.num_speculative_tokens), ("--prefix-groups", a.prefix_groups),
                    ("--prefix-len", a.prefix_len), ("--seed", a.seed),
                    ("--connector-max-delay-steps", a.connector_max_delay_steps),
                    ("--connector-capacity-blocks", a.connector_capacity_blocks)):
        _check(v >= 0, flag, v, ">= 0")
    _check(a.max_in_flight_tokens is None or a.max_in_flight_tokens >= 1, "--max-in-flight-tokens",
           a.max_in_flight_tokens, ">= 1")
    _check(a.num_blocks is None or a.num_blocks >= 2, "--num-blocks", a.num_blocks, ">= 2")
    _check(a.max_model_len is None or a.max_model_len >= 2, "--max-model-len", a.max_model_len, ">= 2")
    _check(0 < a.gpu_memory_utilization <= 1, "--gpu-memory-utilization", a.gpu_memory_utilization, "in (0, 1]")
    _check(0 <= a.acceptance_rate <= 1, "--acceptance-rate", a.acceptance_rate, "in [0, 1]")
    _check(0 <= a.connector_failure_rate <= 1, "--connector-failure-rate", a.connector_failure_rate, "in [0, 1]")
    _check(a.arrival_rate is None or a.arrival_rate > 0, "--arrival-rate", a.arrival_rate, "> 0 requests/s")
    _check(a.num_speculative_tokens < a.max_num_batched_tokens, "--num-speculative-tokens",
           a.num_speculative_tokens, "< --max-num-batched-tokens")


def sim_config_from_args(a: argparse.Namespace, label: str) -> Any:
    from hybridserve.core.kv.spec import dtype_size
    from hybridserve.sim.presets import get_gpu, get_layout
    from hybridserve.sim.simulation import SimConfig

    _validate(a)
    layout, gpu = get_layout(a.model_layout), get_gpu(a.gpu)
    dtype_size(a.kv_cache_dtype)
    return SimConfig(
        gpu=gpu.name, model_layout=layout.name, block_size=a.block_size, num_blocks=a.num_blocks,
        gpu_memory_utilization=a.gpu_memory_utilization, kv_dtype=a.kv_cache_dtype,
        max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len,
        async_scheduling=a.async_scheduling, pipeline_parallel_size=a.pipeline_parallel_size,
        num_speculative_tokens=a.num_speculative_tokens, acceptance_rate=a.acceptance_rate,
        enable_prefix_caching=a.enable_prefix_caching, full_sequence_must_fit=a.full_sequence_must_fit,
        max_in_flight_tokens=a.max_in_flight_tokens, window_tail_allocation=a.window_tail_allocation,
        connector=a.connector,
        connector_capacity_blocks=a.connector_capacity_blocks, connector_max_delay_steps=a.connector_max_delay_steps,
        connector_failure_rate=a.connector_failure_rate, detector=a.detector,
        unsafe_optimistic_free=a.unsafe_optimistic_free, seed=a.seed, label=label,
    )


def workload_from_args(a: argparse.Namespace) -> list[Any]:
    from hybridserve.sim.workload import WorkloadSpec, generate, load_trace

    if a.trace is not None:
        return load_trace(a.trace, default_prefix_len=a.prefix_len or None)
    spec = WorkloadSpec.from_flags(a.num_requests, a.prompt_len, a.output_len, a.arrival_rate,
                                   a.prefix_groups, a.prefix_len)
    return generate(spec, a.seed)


def compare_args(a: argparse.Namespace) -> argparse.Namespace:
    """The second configuration: the first one's flags with `--compare`'s flags on top."""
    try:
        tokens = shlex.split(a.compare)
    except ValueError as e:
        raise FlagError(f"argument --compare: {e}") from None
    p = _OneLineParser(prog=f"{PROG} --compare", add_help=False)
    _add_arguments(p)
    p.set_defaults(**vars(a))
    b = p.parse_args(tokens)
    changed = [f for f in WORKLOAD_FLAGS if getattr(b, f) != getattr(a, f)]
    if changed:
        flags = ", ".join("--" + f.replace("_", "-") for f in changed)
        raise FlagError(f"argument --compare: {flags} would change the workload; both runs share one workload")
    if b.json != a.json or b.plot != a.plot or b.compare != a.compare:
        raise FlagError("argument --compare: --json, --plot and --compare belong outside the compared flags")
    return b


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except HybridServeError as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: interrupted\n")
        return 130


def _run(a: argparse.Namespace) -> int:
    import json

    from rich.console import Console

    from hybridserve.sim.report import plot, print_summary
    from hybridserve.sim.simulation import run_simulation

    _check_output_path(a.json, "--json")
    _check_output_path(a.plot, "--plot")
    configs = [sim_config_from_args(a, "A" if a.compare else "run")]
    if a.compare:
        configs.append(sim_config_from_args(compare_args(a), "B"))
    err = Console(stderr=True)
    if any(c.unsafe_optimistic_free for c in configs):
        err.print(f"[bold red]{UNSAFE_WARNING}[/bold red]", highlight=False, soft_wrap=True)
    items = workload_from_args(a)
    progress = a.progress if a.progress is not None else sys.stderr.isatty()
    reports = [run_simulation(c, items, progress=progress) for c in configs]
    print_summary(reports)
    if a.compare:
        Console().print(f"B = A with: {a.compare}", highlight=False)
    if a.json:
        body: Any = reports[0].to_dict() if len(reports) == 1 else {"runs": [r.to_dict() for r in reports]}
        _write(a.json, "--json", lambda f: json.dump(body, f, indent=2))
    if a.plot:
        try:
            plot(reports, a.plot)
        except OSError as e:
            raise FlagError(f"argument --plot: cannot write {a.plot} ({e.strerror or e})") from None
    safe_violations = sum(r.violations for r, c in zip(reports, configs) if not c.unsafe_optimistic_free)
    if safe_violations:
        err.print(f"[bold red]{safe_violations} KV race violation(s) in safe mode: this is an engine bug[/bold red]",
                  soft_wrap=True)
        return 1
    return 0


PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def _check_output_path(path: str | None, flag: str) -> None:
    """Fail before a long run, not after it, when an output cannot be written."""
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK) or os.path.isdir(path):
        raise FlagError(f"argument {flag}: cannot write {path} (no writable directory {parent})")
    if flag == "--plot" and not path.lower().endswith(PLOT_SUFFIXES):
        raise FlagError(f"argument --plot: {path} must end in one of {', '.join(PLOT_SUFFIXES)}")


def _write(path: str, flag: str, dump: Any) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            dump(f)
    except OSError as e:
        raise FlagError(f"argument {flag}: cannot write {path} ({e.strerror or e})") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry: `python -m hybridserve.entrypoints.simulate [flags]`."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
