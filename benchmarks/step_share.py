"""Where a decode step's time goes: the share outside the weight matmuls, at 1, 16 and 64 rows.

    python benchmarks/step_share.py                       # the default model, 1, 16 and 64 rows
    python benchmarks/step_share.py --rows 16 --steps 24 --threads 2
    python benchmarks/step_share.py --isa avx2            # as on a CPU with AVX2 alone

The goal this answers (issue 40): time outside the matmuls at most 20% of a decode step,
on every CPU. For R rows, R prompts of random ids (--prompt-len each) are generated
greedily (or sampled: --temperature, --top-p), --steps decode steps each; every step runs
R rows, one token each. Steps alternate between two kinds, in the same run, so both see the same machine:
- timed: the engine's whole step (ModelRunner.execute: inputs, the model, attention, KV
  writes, the head, sampling), wall clock;
- traced: the same kind of step run under a dispatch mode that times each weight matmul
  (aten.mm / addmm / _int_mm, oneDNN's and fbgemm's int8 linears, oneDNN's packed linear)
  as it runs, inside the real step: the matmuls alone at the kernels' rates, on the
  activations and caches the step really has. Where the model's decode stack
  (models/arch/decode_stack.py) takes the step, its layers' linears are called from C: the
  stack adds their wall time up itself (DecodeStack.linear_seconds); the native kernels no dispatch mode sees
  (native_matmuls: the int8-group linears of gguf-groups, models/layers/int8_groups.py;
  the AMX int8 products and the head's argmax over them, models/layers/int8_amx.py; the
  head's u8 x s8 products and its argmax over them, models/layers/int8_quads.py) are
  timed per call the same way. Attention's batched products (bmm) are not weight matmuls and count as
  outside; so do a sampled step's span summaries and the stored logits' writes: where
  int8_quads.c makes them as its products come out, a traced step times the product alone
  in the faster of its argmax (the products reduced in cache) and its plain matmul (written
  to a buffer), each the faster on some build, and then runs the real kernel outside. The AMX kernel's span logits are not split so: on an AMX
  host a sampled step's head product counts as outside.
Printed per row count: the medians of the step and of its matmuls (ms), the ops a traced
step dispatches (every aten op, views included: a count that does not move with the
machine's load), the share outside = 1 - matmuls / step from those medians, and the median
of the same share taken per pair of adjacent steps (a timed one and the traced one after
it, ~20-100 ms apart), with its interquartile range: on a host whose speed drifts by
10-25% within seconds the pairs see the same speed, where the two medians may not.
--repeat generates the row count's batch that many times, pooling the steps. A fixed thread count (--threads) keeps the thread governor
from switching counts between the two kinds of steps.
--isa runs the measurement as on another kind of CPU (cpu_features.as_isa_env: avx2,
AVX2 alone; avx512, AVX-512 without BF16 or VNNI; avx512-bf16, BF16 and VNNI without AMX):
the engine then chooses its dtype and kernels as there, and oneDNN / fbgemm run that
CPU's code.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's hybridserve, whatever is installed

from common import rerun_as, torch_header  # noqa: E402

from hybridserve.models.platform.cpu_features import ISA_KINDS  # noqa: E402

# Ops that multiply activations by a weight matrix, by (namespace, op name).
WEIGHT_MATMULS = {
    ("aten", "mm"), ("aten", "addmm"), ("aten", "_int_mm"), ("aten", "linear"),
    ("onednn", "qlinear_pointwise"), ("mkldnn", "_linear_pointwise"),
    ("quantized", "linear_with_input_q_dq_qweight_dq_output_fp32"), ("quantized", "linear_dynamic"),
}


def native_matmuls(group_kernel, amx_kernel, quads_kernel):  # type: ignore[no-untyped-def]
    """The native kernels' weight matmuls (class, method): the int8 groups' linears, the
    AMX int8 products, the head's argmax among them (products whose outputs it reduces),
    and the u8 x s8 head products of int8_quads.c (AVX2 or VNNI), its argmax likewise."""
    return [(group_kernel, "__call__"), (amx_kernel, "__call__"), (amx_kernel, "argmax_chunks"),
            (quads_kernel, "__call__"), (quads_kernel, "argmax")]


def matmul_timer():  # type: ignore[no-untyped-def]
    """A dispatch mode whose `seconds` sums the wall time of the weight matmuls run under it,
    and whose `ops` counts every op dispatched under it (views included)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class MatmulTimer(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seconds = 0.0
            self.calls = 0
            self.ops = 0
            self.in_native = False  # inside a timed native linear: its own torch ops are its work

        def __enter__(self):  # type: ignore[no-untyped-def]
            import torch

            from hybridserve.models.layers.int8_amx import AmxKernel
            from hybridserve.models.layers.int8_groups import GroupKernel
            from hybridserve.models.layers.int8_quads import QuadsKernel

            timer, restores = self, []

            def timed_version(real):  # type: ignore[no-untyped-def]
                def timed(kernel, *args, **kwargs):  # type: ignore[no-untyped-def]
                    start = time.perf_counter()
                    timer.in_native = True
                    try:
                        return real(kernel, *args, **kwargs)
                    finally:
                        timer.in_native = False
                        timer.seconds += time.perf_counter() - start
                        timer.calls += 1
                return timed

            for owner, name in native_matmuls(GroupKernel, AmxKernel, QuadsKernel):
                real = getattr(owner, name)
                setattr(owner, name, timed_version(real))
                restores.append((owner, name, real))
            # A sampled step's head on int8_quads.c summarises its spans as the products come
            # out (QuadsKernel.span_logits), storing them or not: traced, the product is timed
            # alone in the faster of its two forms (its argmax, the products reduced in cache;
            # its matmul, written to a buffer of the step's shape: each is the faster on some
            # build), then the real kernel runs outside (the same logits and summaries)
            real_spans = QuadsKernel.span_logits
            unwrapped = {name: real for owner, name, real in restores if owner is QuadsKernel}  # not timed twice
            real_argmax, real_product = unwrapped["argmax"], unwrapped["__call__"]
            scratch: dict[tuple[int, int], torch.Tensor] = {}

            def product_then_summaries(kernel, x, weight, row_scale, inv_t, exp_floor, out):  # type: ignore[no-untyped-def]
                shape = (x.shape[0], weight.shape[0])
                buffer = scratch.get(shape)
                if buffer is None:  # made once, its pages resident, as the step's logits buffer
                    buffer = scratch[shape] = torch.zeros(shape)
                seconds = []
                for run in (lambda: real_argmax(kernel, x, weight, row_scale), lambda: real_product(kernel, x, weight, buffer)):
                    start = time.perf_counter()
                    run()
                    seconds.append(time.perf_counter() - start)
                timer.seconds += min(seconds)
                timer.calls += 1
                return real_spans(kernel, x, weight, row_scale, inv_t, exp_floor, out)

            QuadsKernel.span_logits = product_then_summaries
            restores.append((QuadsKernel, "span_logits", real_spans))
            self._restore = lambda: [setattr(owner, name, real) for owner, name, real in restores]
            return super().__enter__()

        def __exit__(self, *exc):  # type: ignore[no-untyped-def]
            self._restore()
            return super().__exit__(*exc)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            self.ops += 1
            packet = func._overloadpacket
            if self.in_native or (packet._qualified_op_name.split("::")[0], packet.__name__) not in WEIGHT_MATMULS:
                return func(*args, **kwargs)
            start = time.perf_counter()
            out = func(*args, **kwargs)
            self.seconds += time.perf_counter() - start
            self.calls += 1
            return out

    return MatmulTimer()


class StepRecorder:
    """Wraps a ModelRunner's execute: decode steps of exactly `rows` tokens alternate
    between timed and traced (see the module docstring); other steps run as they are."""

    def __init__(self, runner, rows: int) -> None:  # type: ignore[no-untyped-def]
        self.runner, self.rows = runner, rows
        self.inner = runner.execute
        self.step_seconds: list[float] = []
        self.matmul_seconds: list[float] = []
        self.matmul_calls: list[int] = []
        self.ops: list[int] = []
        self._traced_next = False
        runner.execute = self.execute

    def execute(self, so):  # type: ignore[no-untyped-def]
        if so.total_num_scheduled_tokens != self.rows or len(so.requests) != self.rows:
            return self.inner(so)
        self._traced_next = not self._traced_next
        if self._traced_next:
            start = time.perf_counter()
            out = self.inner(so)
            self.step_seconds.append(time.perf_counter() - start)
            return out
        stack = getattr(self.runner.model, "decode_stack", None)
        in_stack = ctypes.c_double(0.0)
        if stack is not None:
            stack.linear_seconds = in_stack
        try:
            with matmul_timer() as timer:
                out = self.inner(so)
        finally:
            if stack is not None:
                stack.linear_seconds = None
        self.matmul_seconds.append(timer.seconds + in_stack.value)
        # the stack's linears: four a layer, where it took the step
        self.matmul_calls.append(timer.calls + (4 * len(stack.layer_ids) if in_stack.value else 0))
        self.ops.append(timer.ops)
        return out

    def restore(self) -> None:
        self.runner.execute = self.inner


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a model path (default: the embedded Gemma 3 270M)")
    p.add_argument("--rows", default="1,16,64", help="comma list of batch sizes")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=32, help="decode steps per row count (half timed, half traced)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--isa", choices=("native", *ISA_KINDS), default="native", help="run as on this kind of CPU")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample the decode steps at this temperature (0: greedy, the default)")
    p.add_argument("--top-p", type=float, default=1.0, help="and with this top_p (with --temperature > 0)")
    p.add_argument("--repeat", type=int, default=1, help="measured generations per row count (steps pooled)")
    p.add_argument("--json", type=Path, default=None,
                   help="also write the rows as JSON here (cpu_peers.py --share reads them)")
    args = p.parse_args()
    if args.isa != "native" and (code := rerun_as(args.isa)) is not None:
        sys.exit(code)

    from hybridserve import LLM, SamplingParams

    print(torch_header(args.threads, ("avx", "amx")))
    llm = LLM(args.model, progress=False, enable_prefix_caching=False, num_threads=args.threads)
    runner = llm.parts.engine.executor.runner
    vocab = llm.parts.model_config.vocab_size
    sampling = "greedy" if not args.temperature else f"sampled at temperature {args.temperature}, top_p {args.top_p}"
    print(f"# model {args.model or 'default'}; {args.prompt_len}-token prompts; {args.steps} decode steps per row count; "
          f"{sampling}")
    print("\n| rows | step ms (median) | weight matmuls ms | matmul calls | ops dispatched | outside the matmuls | "
          "outside, paired steps (median, IQR) |\n|---:|---:|---:|---:|---:|---:|---:|")
    rng = random.Random(0)
    measured = []
    for rows in [int(r) for r in args.rows.split(",")]:
        batch = [[rng.randrange(5, vocab) for _ in range(args.prompt_len)] for _ in range(rows)]
        params = SamplingParams(max_tokens=args.steps + 1, ignore_eos=True, temperature=args.temperature,
                                top_p=args.top_p, seed=0)
        llm.generate(batch, params, use_tqdm=False)  # warm-up: the same shapes once
        recorder = StepRecorder(runner, rows)
        try:
            for _ in range(args.repeat):
                llm.generate(batch, params, use_tqdm=False)
        finally:
            recorder.restore()
        step = statistics.median(recorder.step_seconds)
        mm = statistics.median(recorder.matmul_seconds)
        # each timed step, then the traced one after it (StepRecorder alternates them)
        paired = [1 - m / s for s, m in zip(recorder.step_seconds, recorder.matmul_seconds)]
        q1, q2, q3 = statistics.quantiles(paired, n=4) if len(paired) > 1 else (paired * 3)
        print(f"| {rows} | {step * 1e3:.1f} | {mm * 1e3:.1f} | {statistics.median(recorder.matmul_calls):.0f} | "
              f"{statistics.median(recorder.ops):.0f} | {1 - mm / step:.0%} | {q2:.0%} ({q1:.0%}-{q3:.0%}) |",
              flush=True)
        measured.append({"rows": rows, "step_ms": step * 1e3, "matmul_ms": mm * 1e3, "outside": 1 - mm / step,
                         "outside_paired": q2})
    llm.shutdown()
    if args.json:
        args.json.write_text(json.dumps(measured))


if __name__ == "__main__":
    main()
