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
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cluster import linked_adapters  # noqa: E402
from workloads import slora_synthetic  # noqa: E402

import kernels.cpu as cpu_kernels  # noqa: E402
from asyncserve import LLM, SamplingParams  # noqa: E402
from ipc.profile import cpu_model  # noqa: E402


def build(args, adapters: Path) -> LLM:
    return LLM(adapter_dir=str(adapters), preload_adapters=True, dtype=args.dtype, threads=args.threads,
               pool_mem=args.pool_mem, host_adapter_mem=args.host_adapter_mem, max_running=args.max_running,
               cpu_workers=0)


def queue_trace(llm: LLM, n_adapters: int, args) -> int:
    """Queue the trace over adapters lora0..lora{n_adapters - 1}; returns its output tokens."""
    engine = llm.engine
    requests = slora_synthetic(n_adapters, args.alpha, args.rate, 1.0, tuple(args.input_range),
                               tuple(args.output_range), duration_s=args.duration, seed=args.seed,
                               prompt_vocab_size=engine.vocab_size)
    for r in requests:
        params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
        engine.add(engine.make_sequence(r.prompt_token_ids, params, r.model))
    return sum(r.max_tokens for r in requests)


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
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pool-mem", default="4GiB")
    ap.add_argument("--host-adapter-mem", default="4GiB")
    ap.add_argument("--max-running", type=int, default=32)
    ap.add_argument("--no-amx", action="store_true", help="keep the native GEMM on its vdpbf16ps tiles where it "
                    "would run AMX tiles (kernels/cpu/gemm.h), to compare")
    args = ap.parse_args()
    if args.no_amx:
        cpu_kernels.set_amx_gemm(False)

    amx = cpu_kernels.amx_gemm_available() and not args.no_amx
    print(f"# {cpu_model()}, {args.threads} threads, GEMM on {'AMX' if amx else 'vdpbf16ps'} tiles where native, "
          f"load average before {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        folders = {"many": linked_adapters(args.adapters, "lora", Path(tmp), name="many"),
                   "few": linked_adapters(args.adapters, "lora", Path(tmp), count=args.few, name="few")}
        t0 = time.perf_counter()
        engines = {name: build(args, folder) for name, folder in folders.items()}
        print(f"# both engines built, every adapter in their host tiers, in {time.perf_counter() - t0:.1f} s")
        counts = {name: len(llm.engine.pager.registry) for name, llm in engines.items()}
        tokens = {name: queue_trace(llm, counts[name], args) for name, llm in engines.items()}
        busy = dict.fromkeys(engines, 0.0)
        steps = dict.fromkeys(engines, 0)
        while any(llm.engine.has_unfinished() for llm in engines.values()):
            for name, llm in engines.items():
                engine = llm.engine
                for _ in range(args.block):
                    if not engine.has_unfinished():
                        break
                    t = time.perf_counter()
                    engine.step()
                    busy[name] += time.perf_counter() - t
                    steps[name] += 1
    rate = {name: tokens[name] / busy[name] for name in engines}
    for name in engines:
        print(f"{name:5s} {counts[name]:5d} adapters  {tokens[name]} output tokens  {steps[name]} steps  "
              f"busy {busy[name]:7.2f} s  {rate[name]:7.1f} tok/s  device loads {engines[name].engine.pager.loads_total}")
    print(f"many/few: {rate['many'] / rate['few']:.3f} (S-LoRA: 0.945; goal >= 0.95)")


if __name__ == "__main__":
    main()
