"""Where a step's time goes, per op class: W1's decode step and two mixed steps, through the engine.

    .venv/bin/python scripts/bench_step_split.py --threads 2            # W1's 4 adapters
    .venv/bin/python scripts/bench_step_split.py --threads 1 --base     # the base model
    .venv/bin/python scripts/bench_step_split.py --threads 1 --cpu-clock   # on a loaded box
    .venv/bin/python scripts/bench_step_split.py --model M-Q4_K_M.gguf --keep-quantized --dtype float32 --base

16 W1 requests decode (--decodes; max_running one more, prefix cache off, stacks packed after 44 warm-up
then, --samples times each, the steps are measured as they come:

    16 dec                  decode steps (contexts ~110-130)
    16 dec + 64@0           a 64-token W1 prompt joins: its whole prefill beside the decodes
    16 dec + 240@240        a 512-token prompt's second chunk, attending to its first chunk's
                            cached pages (chunks of 240, 240 and 32 under the 256-token budget)

Each class is the time inside the functions that make it, exclusive of nested classes (timers
wrapped around them for the run, ~0.3 us per call):

    GEMM        Linear calls over base weights (also those with LoRA's shrink fused in) and lm_head
    LoRA        the backend's begin_step and the rest of LoraHook.project (mask, expand, ...)
    attention   llama.attention (decode and prefill)
    norm        llama._residual_norm (residual add + RMSNorm)
    RoPE+KV     kernels.cpu.rope_write_kv, or llama.apply_rope on the eager path (its KV write: other)
    SiLU*mul    llama.silu_mul
    sampler     the runner's sample()
    prepare     ModelRunner._prepare: the plan as tensors
    other       the rest of engine.step(): schedule, postprocess, the ops and Python between the above

The classes are timed on the layer loop in Python (ASYNCSERVE_NATIVE_DECODER=0): the native loop
(kernels/cpu/decoder.h) runs the same kernels in one call, which no Python timer can split. A last
line gives the decode step both ways, alternated step by step.

Prints one table per run (mean ms per step over each kind's steps), in BENCHMARKS.md's format.
--cpu-clock times the thread's CPU (time.thread_time) instead of the wall: with --threads 1 the
time other processes take the core from it then does not count.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import kernels.cpu as cpu_kernels  # noqa: E402
from asyncserve.model import linear as linear_module, llama  # noqa: E402
from asyncserve.stepper import runner as runner_module  # noqa: E402
from bench_offline import adapter_of, load_w1  # noqa: E402

CLASSES = ("GEMM", "LoRA", "attention", "norm", "RoPE+KV", "SiLU*mul", "sampler", "prepare", "other")


class Timers:
    """Exclusive seconds per class of the wrapped functions: a call's time less that of the wrapped
    calls inside it."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls = 0
        self._inner: list[float] = []          # per open call: seconds of wrapped calls inside it

    def wrap(self, label, fn):
        """label: a class, or a function of the call's arguments giving one."""
        def timed(*args, **kwargs):
            self._inner.append(0.0)
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = self.clock() - t0
                inner = self._inner.pop()
                self.seconds[label(*args) if callable(label) else label] += elapsed - inner
                self.calls += 1
                if self._inner:
                    self._inner[-1] += elapsed
        return timed


def instrument(llm, timers: Timers) -> None:
    """Wrap the functions that make each class (for the life of the process)."""
    runner, lora = llm.engine.runner, llm.engine.runner.lora
    projecting: list = []                      # the base Linear of each open LoraHook.project call

    def linear_class(self, x):
        # a base projection, or one with the stacked shrink appended (same input, more outputs), is a
        # GEMM; a stack's shrink or expand (other inputs or fewer outputs) is LoRA
        base = projecting[-1] if projecting else None
        if base is None or (self.in_features == base.in_features and self.out_features >= base.out_features):
            return "GEMM"
        return "LoRA"

    for cls in (linear_module.Linear, linear_module.OneDnnLinear, linear_module.NativeLinear, linear_module.QuantLinear):
        cls.__call__ = timers.wrap(linear_class, cls.__call__)
    project = timers.wrap("LoRA", lora.project)

    def project_tracked(layer, group, x, base):
        projecting.append(base)
        try:
            return project(layer, group, x, base)
        finally:
            projecting.pop()

    lora.project = project_tracked
    lora.begin_step = timers.wrap("LoRA", lora.begin_step)
    llama.attention = timers.wrap("attention", llama.attention)
    llama._residual_norm = timers.wrap("norm", llama._residual_norm)
    llama.apply_rope = timers.wrap("RoPE+KV", llama.apply_rope)
    cpu_kernels.rope_write_kv = timers.wrap("RoPE+KV", cpu_kernels.rope_write_kv)
    llama.silu_mul = timers.wrap("SiLU*mul", llama.silu_mul)
    runner_module.sample = timers.wrap("sampler", runner_module.sample)
    runner._prepare = timers.wrap("prepare", runner._prepare)


def step_kind(plan) -> str:
    """'16 dec + 240@240': decodes, then each prefill chunk's rows @ its first position."""
    chunks = [f"{c.num_tokens}@{c.seq.num_computed}" for c in plan.prefills]
    return " + ".join([f"{len(plan.decodes)} dec"] + chunks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench-dir", type=Path, default=REPO / ".bench",
                    help="the folder holding w1/ (default: .bench, where scripts/make_w1.py writes it)")
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--base", action="store_true", help="the base model instead of W1's adapters")
    ap.add_argument("--samples", type=int, default=12, help="measured steps of each kind")
    ap.add_argument("--decodes", type=int, default=16, help="sequences decoding in every measured step (1..16)")
    ap.add_argument("--cpu-clock", action="store_true", help="the thread's CPU time instead of the wall (1 thread)")
    ap.add_argument("--keep-quantized", action="store_true", help="a GGUF model's blocks kept quantized (QuantLinear)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    os.environ["ASYNCSERVE_NATIVE_DECODER"] = "0"

    from asyncserve import LLM, SamplingParams

    args.repeat, args.adapter_dir = 1, None
    prompts, adapters = load_w1(args)
    llm = LLM(model=args.model, adapters=adapters, dtype=args.dtype, device="cpu", max_running=args.decodes + 1,
              threads=args.threads, prefix_caching=False, keep_quantized=args.keep_quantized)
    engine, tok = llm.engine, llm.tokenizer
    ids = [tok.encode(p) for p in prompts]
    name = (lambda i: None) if args.base else (lambda i: adapter_of(i, adapters))
    for i in range(args.decodes):
        engine.add(engine.make_sequence(ids[i], SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True),
                                        name(i)))
    for _ in range(44):                        # prefills done, the adapter set's stacks packed and fused
        engine.step()

    clock = time.thread_time if args.cpu_clock else time.perf_counter
    timers = Timers(clock)
    instrument(llm, timers)
    kinds: dict[str, list[dict]] = defaultdict(list)
    run = engine.run
    last_kind = []

    def run_recorded(plan):
        last_kind[:] = [step_kind(plan)]       # before postprocess moves the chunks' positions on
        return run(plan)

    engine.run = run_recorded

    def measured_step():
        timers.seconds.clear()
        calls = timers.calls
        t0 = clock()
        engine.step()
        wall = clock() - t0
        split = dict(timers.seconds)
        split["other"] = wall - sum(split.values())
        kinds[last_kind[0]].append({"wall": wall, "calls": timers.calls - calls, **split})

    one_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for _ in range(args.samples):
        measured_step()
    for j in range(args.samples):
        engine.add(engine.make_sequence(ids[16 + j % 48], one_token, name(16 + j)))
        measured_step()                        # the 64-token prefill beside the decodes
        measured_step()
    for j in range(args.samples):
        long_prompt = [t for k in range(8) for t in ids[(j + k) % 64]]      # 512 tokens
        engine.add(engine.make_sequence(long_prompt, one_token, name(j)))
        for _ in range(3):                     # chunks 240@0, 240@240, 32@480
            measured_step()

    shown = [k for k, steps in kinds.items() if len(steps) >= max(2, args.samples // 2)]
    mean = lambda k, c: statistics.fmean(s.get(c, 0.0) for s in kinds[k]) * 1e3   # noqa: E731
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    print(f"# {cpu}, {args.threads} threads, {args.dtype}{', blocks kept quantized' if args.keep_quantized else ''}, "
          f"{'base model' if args.base else 'W1 4 adapters'}, "
          f"native kernels {'on' if cpu_kernels.enabled_for(llm.engine.runner.weights.embed) else 'off'}, "
          f"{'thread CPU time' if args.cpu_clock else 'wall time'}, load average before {load_before[0]:.2f}")
    print("| class | " + " | ".join(f"{k} (ms, {len(kinds[k])} steps)" for k in shown) + " |")
    print("|---|" + "---:|" * len(shown))
    for c in CLASSES:
        print(f"| {c} | " + " | ".join(f"{mean(k, c):.2f} ({100 * mean(k, c) / mean(k, 'wall'):.0f}%)"
                                        for k in shown) + " |")
    print("| **step** | " + " | ".join(f"**{mean(k, 'wall'):.2f}**" for k in shown) + " |")
    print("timed calls per step: " + ", ".join(f"{k}: {statistics.fmean(s['calls'] for s in kinds[k]):.0f}"
                                               for k in shown))
    loops = {"0": [], "1": []}
    for j in range(4 * args.samples):            # the decodes go on: decode steps, the loop alternated
        mode = "01"[j % 2]
        os.environ["ASYNCSERVE_NATIVE_DECODER"] = mode
        t0 = clock()
        engine.step()
        loops[mode].append(clock() - t0)
    python_loop, native_loop = (statistics.median(loops[m]) * 1e3 for m in "01")
    print(f"{args.decodes} dec, median step: layer loop in Python {python_loop:.2f} ms (timers on), "
          f"native {native_loop:.2f} ms")


if __name__ == "__main__":
    main()
