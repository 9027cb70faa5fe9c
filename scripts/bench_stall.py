"""How long a large adapter's first step stalls every other stream (issue 12).

    .venv/bin/python scripts/make_adapters.py 1 /tmp/big --ranks 256 --targets all --dtype bfloat16
    .venv/bin/python scripts/bench_stall.py --adapter /tmp/big/a0000

The offline engine (SmolLM2 by default) decodes --streams base-model streams; once they are in their
steady state a request for the large adapter joins them. Prints the median step time before it
joins, and the longest and each step time from its arrival on: the streams wait that long
between two tokens.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapter", required=True, help="a PEFT folder (e.g. rank 256 on all seven projections)")
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--warm-steps", type=int, default=40)
    ap.add_argument("--build-mib-per-step", type=float, default=None,
                    help="the torch LoRA backend's stack-building budget (default: its own; huge: all at once)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from asyncserve import LLM, SamplingParams
    from asyncserve.lora import backend

    if args.build_mib_per_step is not None:
        backend.STACK_BUILD_BYTES_PER_STEP = int(args.build_mib_per_step * 2**20)

    llm = LLM(model=args.model, adapters={"big": args.adapter}, dtype=args.dtype, device="cpu",
              threads=args.threads, prefix_caching=False)
    engine = llm.engine
    long = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    prompt = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    for _ in range(args.streams):
        engine.add(engine.make_sequence(prompt, long, None))

    def timed_step() -> tuple[float, list]:
        t0 = time.perf_counter()
        updates = engine.step()
        return time.perf_counter() - t0, updates

    before = [timed_step()[0] for _ in range(args.warm_steps)]
    big = engine.make_sequence(prompt, SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True), "big")
    engine.add(big)
    during = [timed_step()[0] for _ in range(args.warm_steps)]
    ms = lambda xs: " ".join(f"{1e3 * x:.0f}" for x in xs)  # noqa: E731
    print(f"steady step (median of {len(before)}): {1e3 * statistics.median(before):.1f} ms")
    print(f"the {len(during)} steps from the large adapter's arrival: longest {1e3 * max(during):.0f} ms, "
          f"median {1e3 * statistics.median(during):.0f} ms; all: {ms(during)}")


if __name__ == "__main__":
    main()
