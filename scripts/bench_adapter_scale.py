"""Many adapters against few, interleaved in one process (S-LoRA Table 3: throughput with 1,000
adapters is 0.945 of that with 5; #14's goal is >= 0.95).

bench_cpu_assist.py's modes few and preloaded run one server after the other; on a shared box whose
speed drifts by tens of percent within minutes their ratio says as much about the drift as about the
adapters. Here two engines of the offline API, built as `serve` builds its engine (--adapter-dir,
--preload-adapters, the same pool, host tier and batch limits; no CPU workers), take the same
S-LoRA trace (scripts/workloads.py's slora_synthetic: power-law popularity, lengths uniform over
the ranges, greedy with EOS ignored): "many" over every adapter of --adapters, "few" over the first
--few of them, the few's requests being the same (seed, lengths, prompts) with their adapters drawn
among those few. Arrivals are ignored: every request is queued at once, so both run saturated, as
the served benchmark is meant to. The engines advance --block steps each in turn until both are
done; each one's busy time is the sum of its steps' wall time, its throughput its output tokens over
that. Prints both, the ratio, and the steps each took.

    python scripts/make_adapters.py 1000 /tmp/ca/adapters1k --model default --ranks 8 16 --targets q_proj,v_proj
    python scripts/bench_adapter_scale.py --adapters /tmp/ca/adapters1k --threads 2

--compare-lora-rows-ahead switches on and off, step by step, the native decoder's GEMMs asking for
the next LoRA call's rows (kernels/cpu/decoder.h) and reports both kinds of step of each engine;
--no-lora-rows-ahead keeps it off for a whole run.

On a GPU, with a random checkpoint of Llama-7B's shapes (scripts/random_checkpoint.py) and adapters
made for it. --warmup runs an untimed trace first, so that one-time costs land in neither engine's
time; on the H100, before the engine compiled its Triton kernels at start (TritonLoraBackend.warm_up),
they landed in whichever engine first met each kernel specialization (BENCHMARKS.md, "H100, third
lease"):

    python scripts/bench_adapter_scale.py --adapters /tmp/a7b --model .bench/llama7b --dtype bfloat16 \
        --pool-mem 12GiB --host-adapter-mem 16GiB --warmup
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cluster import linked_adapters  # noqa: E402
from workloads import slora_synthetic  # noqa: E402

import kernels.cpu as cpu_kernels  # noqa: E402
from asyncserve import LLM, SamplingParams  # noqa: E402
from ipc.profile import cpu_model  # noqa: E402


def build(args, adapters: Path) -> LLM:
    return LLM(model=args.model, adapter_dir=str(adapters), preload_adapters=True, dtype=args.dtype,
               device=args.device, lora_backend=args.lora_backend, threads=args.threads,
               pool_mem=args.pool_mem, host_adapter_mem=args.host_adapter_mem, max_running=args.max_running,
               cpu_workers=0)


def queue_trace(llm: LLM, n_adapters: int, args, seed: int) -> int:
    """Queue the trace over adapters lora0..lora{n_adapters - 1}; returns its output tokens."""
    engine = llm.engine
    requests = slora_synthetic(n_adapters, args.alpha, args.rate, 1.0, tuple(args.input_range),
                               tuple(args.output_range), duration_s=args.duration, seed=seed,
                               prompt_vocab_size=engine.vocab_size)
    for r in requests:
        params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
        engine.add(engine.make_sequence(r.prompt_token_ids, params, r.model))
    return sum(r.max_tokens for r in requests)


def run_interleaved(engines: dict[str, LLM], block: int, compare_rows_ahead: bool = False
                    ) -> tuple[dict[str, float], dict[str, int], dict[str, dict[bool, list[float]]]]:
    """Each engine runs ``block`` steps in turn until all are done: (busy seconds, steps, step times by
    whether the GEMMs asked for the next LoRA call's rows) per engine. compare_rows_ahead: each engine's
    steps switch that on and off in the order on, off, off, on (neighbouring steps carry nearly the
    same batch, and the order cancels a trend); else it stays as it is."""
    busy = dict.fromkeys(engines, 0.0)
    steps = dict.fromkeys(engines, 0)
    times = {name: {True: [], False: []} for name in engines}
    ahead = True
    while any(llm.engine.has_unfinished() for llm in engines.values()):
        for name, llm in engines.items():
            engine = llm.engine
            for _ in range(block):
                if not engine.has_unfinished():
                    break
                if compare_rows_ahead:
                    ahead = steps[name] % 4 in (0, 3)
                    cpu_kernels.set_lora_rows_ahead(ahead)
                t = time.perf_counter()
                engine.step()
                seconds = time.perf_counter() - t
                busy[name] += seconds
                times[name][ahead].append(seconds)
                steps[name] += 1
    return busy, steps, times


def report_rows_ahead(times: dict[str, dict[bool, list[float]]]) -> None:
    """Per engine: the median step with the next LoRA call's rows asked for and without, and the median
    difference of the pairs (step 4k against 4k + 1, 4k + 3 against 4k + 2). Not the two kinds' sums:
    where the trace's long steps (prefill chunks) recur every few steps, they fall more on one side
    (at 4 running, where the switch changes nothing, the two sums were 11% apart)."""
    for name, by in times.items():
        n = min(len(by[True]), len(by[False]))
        pairs = [on - off for on, off in zip(by[True][:n], by[False][:n])]
        print(f"{name:5s} rows ahead: median step {statistics.median(by[True]) * 1e3:.2f} ms on against "
              f"{statistics.median(by[False]) * 1e3:.2f} off, median pair difference "
              f"{statistics.median(pairs) * 1e3:+.3f} ms over {n} pairs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=Path, required=True, help="a folder of PEFT adapter folders")
    ap.add_argument("--few", type=int, default=5, help="the few engine's adapters (S-LoRA: 5)")
    ap.add_argument("--block", type=int, default=20, help="steps each engine runs in its turn")
    ap.add_argument("--rate", type=float, default=20.0, help="the trace's requests per second (x --duration)")
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--alpha", type=float, default=1.0, help="power-law exponent of adapter popularity")
    ap.add_argument("--input-range", type=int, nargs=2, default=[8, 256])
    ap.add_argument("--output-range", type=int, nargs=2, default=[8, 128])
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--model", default=None, help="HF folder or GGUF file (default: SmolLM2), e.g. a random "
                    "checkpoint of scripts/random_checkpoint.py")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--lora-backend", default="auto", help="auto | torch | triton")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pool-mem", default="4GiB")
    ap.add_argument("--host-adapter-mem", default="4GiB")
    ap.add_argument("--max-running", type=int, default=32)
    ap.add_argument("--warmup", action="store_true", help="first run a trace of another seed untimed, so that "
                    "one-time costs of the first steps land in neither engine's time")
    ap.add_argument("--no-amx", action="store_true", help="keep the native GEMM on its vdpbf16ps tiles where it "
                    "would run AMX tiles (kernels/cpu/gemm.h), to compare")
    ap.add_argument("--no-lora-rows-ahead", action="store_true", help="the native decoder's GEMMs do not ask for the "
                    "next LoRA call's pool rows as they compute (kernels/cpu/decoder.h), to compare")
    ap.add_argument("--compare-lora-rows-ahead", action="store_true", help="switch that on and off step by step "
                    "(on, off, off, on) and report each engine's steps of either kind")
    args = ap.parse_args()
    if args.no_amx:
        cpu_kernels.set_amx_gemm(False)
    if args.no_lora_rows_ahead:
        cpu_kernels.set_lora_rows_ahead(False)

    amx = cpu_kernels.amx_gemm_available() and not args.no_amx
    gpu = f"{torch.cuda.get_device_name()}, " if args.device != "cpu" and torch.cuda.is_available() else ""
    print(f"# {gpu}{cpu_model()}, {args.threads} threads, GEMM on {'AMX' if amx else 'vdpbf16ps'} tiles where "
          f"native, LoRA backend {args.lora_backend}, load average before {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        folders = {"many": linked_adapters(args.adapters, "lora", Path(tmp), name="many"),
                   "few": linked_adapters(args.adapters, "lora", Path(tmp), count=args.few, name="few")}
        t0 = time.perf_counter()
        engines = {name: build(args, folder) for name, folder in folders.items()}
        print(f"# both engines built, every adapter in their host tiers, in {time.perf_counter() - t0:.1f} s")
        counts = {name: len(llm.engine.pager.registry) for name, llm in engines.items()}
        if args.warmup:
            tokens = {name: queue_trace(llm, counts[name], args, args.seed + 1) for name, llm in engines.items()}
            busy, steps, _ = run_interleaved(engines, args.block)
            rate = {name: tokens[name] / busy[name] for name in engines}
            print(f"# warm-up trace (seed {args.seed + 1}, untimed): many/few {rate['many'] / rate['few']:.3f}, "
                  f"busy {busy['many']:.2f} / {busy['few']:.2f} s")
        tokens = {name: queue_trace(llm, counts[name], args, args.seed) for name, llm in engines.items()}
        busy, steps, times = run_interleaved(engines, args.block, args.compare_lora_rows_ahead)
    rate = {name: tokens[name] / busy[name] for name in engines}
    for name in engines:
        print(f"{name:5s} {counts[name]:5d} adapters  {tokens[name]} output tokens  {steps[name]} steps  "
              f"busy {busy[name]:7.2f} s  {rate[name]:7.1f} tok/s  device loads {engines[name].engine.pager.loads_total}")
    print(f"many/few: {rate['many'] / rate['few']:.3f} (S-LoRA: 0.945; goal >= 0.95)")
    if args.compare_lora_rows_ahead:
        report_rows_ahead(times)


if __name__ == "__main__":
    main()
