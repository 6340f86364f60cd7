"""`hybridserve generate`: stream completions of prompts to stdout.

    hybridserve generate "The capital of France is" --max-tokens 32
    cat prompts.txt | hybridserve generate --model ./my-model --temperature 0.8 --seed 1

Prompts come from the arguments, else from stdin (one prompt per non-empty line); with
neither (a terminal, or an empty stdin) a few built-in example prompts run, echoed, so
`hybridserve generate` alone shows the default model at work. All prompts run as one batch; their texts are printed in input order, the current one
streaming as it is generated, each followed by a newline (a blank line between
prompts). Loading messages and --stats go to stderr, so stdout holds only text.
Without --model the default model runs (the gemma extra); without it, one line says
how to get it and the exit code is 2, like every other user error.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, TextIO

from hybridserve.core.request import SamplingParams
from hybridserve.entrypoints.command import FlagError, one_line_errors, run_guarded, standalone_main
from hybridserve.entrypoints.engine_flags import add_engine_arguments, engine_config_from_args

PROG = "hybridserve generate"
DESCRIPTION = "Generate text for prompts and stream it to stdout."


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="*", help="prompts (default: one per line of stdin, else built-in examples)")
    s = p.add_argument_group("sampling")
    # A generate run shows more text than a request's default max_tokens; the filters
    # default to SamplingParams' own (off), greedy included.
    s.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (default: %(default)s)")
    s.add_argument("--temperature", type=float, default=SamplingParams.temperature,
                   help="0 is greedy (default: %(default)s)")
    s.add_argument("--top-p", type=float, default=SamplingParams.top_p, help="nucleus sampling: keep the most likely "
                   "tokens whose probabilities add up to P, in (0, 1]; 1 is off (default: %(default)s)")
    s.add_argument("--top-k", type=int, default=SamplingParams.top_k,
                   help="keep only the K most likely tokens; 0 is off (default: %(default)s)")
    s.add_argument("--min-p", type=float, default=SamplingParams.min_p, help="drop tokens less likely than P x the "
                   "most likely one, in [0, 1]; 0 is off (default: %(default)s)")
    s.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable; default: none)")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    o = p.add_argument_group("output")
    o.add_argument("--chat", action="store_true", help="send each prompt as a user message (chat template)")
    o.add_argument("--echo", action="store_true", help="print each prompt before its completion")
    o.add_argument("--stats", action="store_true", help="print tokens/s to stderr at the end")
    o.add_argument("--quiet", action="store_true", help="no loading messages on stderr")
    add_engine_arguments(p)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="generate text for prompts (streams to stdout)",
                              description=DESCRIPTION)
    one_line_errors(p, PROG)
    _add_arguments(p)
    return p


EXAMPLE_PROMPTS = ("The capital of France is", "The three primary colors are", "Once upon a time, in a small village,")


def read_prompts(args: argparse.Namespace, stdin: TextIO) -> tuple[list[str], bool]:
    """(prompts, whether they are the built-in examples)."""
    if args.prompt:
        return list(args.prompt), False
    prompts = [] if stdin.isatty() else [line.rstrip("\r\n") for line in stdin if line.strip()]
    if prompts:
        return prompts, False
    return list(EXAMPLE_PROMPTS), True


class OrderedPrinter:
    """Prints streams of several prompts in input order: the current prompt's text as it
    arrives, later prompts' text buffered until their turn."""

    def __init__(self, out: TextIO, prompts: list[str], echo: bool) -> None:
        self.out = out
        self.prompts = prompts
        self.echo = echo
        self.current = 0
        self.buffers: list[list[str]] = [[] for _ in prompts]
        self.done = [False] * len(prompts)
        self._start(0)

    def _start(self, i: int) -> None:
        if i >= len(self.prompts):
            return
        if i > 0:
            self.out.write("\n")
        if self.echo:
            self.out.write(self.prompts[i])
        self.out.write("".join(self.buffers[i]))
        self.buffers[i].clear()

    def add(self, i: int, text: str, finished: bool) -> None:
        if i == self.current:
            self.out.write(text)
        else:
            self.buffers[i].append(text)
        self.done[i] = self.done[i] or finished
        while self.current < len(self.prompts) and self.done[self.current]:
            self.out.write("\n")
            self.current += 1
            self._start(self.current)
        self.out.flush()


def run(args: argparse.Namespace) -> int:
    return run_guarded(PROG, lambda: _run(args))


def _run(a: argparse.Namespace) -> int:
    from hybridserve.engine.llm import LLM

    prompts, examples = read_prompts(a, sys.stdin)
    if examples and not a.quiet:
        sys.stderr.write(f"{PROG}: no prompt given (arguments or stdin); running {len(prompts)} example prompts\n")
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            min_p=a.min_p, seed=a.seed, stop=tuple(a.stop), ignore_eos=a.ignore_eos)
    config = engine_config_from_args(a)
    # Plain prompts are encoded before the weights load, and the run keeps only what
    # decoding needs of the tokenizer (engine/frontend.build_engine_parts): ~100 MB less
    # for the default model (benchmarks/results/memory_peak.md). Chat prompts are rendered
    # through the template first, so they keep the whole tokenizer.
    llm = LLM(config=config, progress=not a.quiet, encode_first=() if a.chat else prompts)
    try:
        if llm.tokenizer is None:
            raise FlagError(f"the model at {llm.parts.model_path} has no tokenizer; pass --tokenizer PATH")
        printer = OrderedPrinter(sys.stdout, prompts, a.echo or examples)
        start, generated = time.monotonic(), 0
        for i, out in llm.stream(prompts, params, chat=a.chat):
            c = out.outputs[0]
            generated += len(c.delta_token_ids)
            printer.add(i, c.delta_text, out.finished)
        elapsed = time.monotonic() - start
        if a.stats:
            sys.stderr.write(f"{PROG}: {len(prompts)} prompt(s), {generated} tokens in {elapsed:.2f} s "
                             f"({generated / max(elapsed, 1e-9):.1f} tok/s)\n")
    finally:
        llm.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    return standalone_main(PROG, DESCRIPTION, _add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
