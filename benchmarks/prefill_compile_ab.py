"""The 64 x 64 prefill (64 prompts of 64 random ids -> 1 token each) with the compiled chains
(the int8 layers' or the bf16 decoder's, as the default mode has it) against eager: two engines in one process, interleaved rounds, after one warm-up
prefill each (the compiled engine builds and checks its chains there: its time is printed).

    python benchmarks/prefill_compile_ab.py [ROUNDS]
"""
import random, sys, time
from hybridserve import LLM, SamplingParams
from hybridserve.config import EngineConfig
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
llms = {c: LLM(config=EngineConfig(enable_prefix_caching=False, compile=c), progress=False) for c in (True, False)}
vocab = llms[True].parts.model_config.vocab_size
p = SamplingParams(max_tokens=1, ignore_eos=True)
def batch(seed):
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(64)] for _ in range(64)]
for c, llm in llms.items():  # warm-up: the compiled one builds its chains here
    t0 = time.perf_counter(); llm.generate(batch(0), p, use_tqdm=False)
    print(f"warm-up compile={c}: {time.perf_counter() - t0:.2f} s", flush=True)
times = {True: [], False: []}
for r in range(rounds):
    for c in ((True, False) if r % 2 == 0 else (False, True)):
        t0 = time.perf_counter(); llms[c].generate(batch(1 + 2 * r + c), p, use_tqdm=False)
        times[c].append(time.perf_counter() - t0)
for c in (True, False):
    print(f"compile={c}: " + ", ".join(f"{t:.3f}" for t in times[c]) + f" s; median {sorted(times[c])[len(times[c]) // 2]:.3f}")
print(f"compiled / eager (medians): {sorted(times[True])[rounds // 2] / sorted(times[False])[rounds // 2]:.3f}")
for llm in llms.values():
    llm.shutdown()
