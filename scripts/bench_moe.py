"""Offline decode throughput of a mixture-of-experts model: each layer's experts in one native call
(kernels/cpu/experts.h) against the same experts in torch ops, and a GGUF file's blocks kept against
dequantized to --dtype; W1's first --prompts prompts, 64 greedy tokens each, the variants alternated.

    python scripts/random_checkpoint.py --like default --shape qwen3-30b-a3b --out /tmp/moe \\
        --set num_hidden_layers=8 num_experts=32 vocab_size=49152
    # to GGUF with llama.cpp's convert_hf_to_gguf.py --outtype q8_0 (../shared/bench/README.md), then
    python scripts/bench_moe.py --model /tmp/moe-q8_0.gguf --bench-dir ../shared/bench --rounds 2

The model's tokens mean nothing (random weights); speculative decoding is off so every step decodes
the 16 sequences once.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncserve import LLM, SamplingParams  # noqa: E402
from asyncserve.model import llama  # noqa: E402
from workloads import w1_file  # noqa: E402

native_moe = llama.moe_mlp


def experts_in_torch_ops(x, experts, moe, native, shared=None, lora=None, layer=0):
    return native_moe(x, experts, moe, False, shared, lora, layer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a mixture-of-experts HF folder or GGUF file")
    ap.add_argument("--bench-dir", default="../shared/bench", help="W1's prompts (make_w1.py)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    prompts = json.loads(w1_file(args.bench_dir, "prompts.json").read_text())[:args.prompts]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    settings = dict(dtype=args.dtype, threads=args.threads, prefix_caching=False, speculative_tokens=0)
    engines = {"dense": LLM(model=args.model, keep_quantized=False, **settings)}
    if args.model.endswith(".gguf"):
        engines["kept"] = LLM(model=args.model, keep_quantized=True, **settings)
    variants = [("dense", "native"), ("dense", "torch ops")] + [("kept", "native")] * ("kept" in engines)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    print(f"# {args.model}, {len(prompts)} prompts x 64 tokens, {args.threads} threads; {cpu}")
    try:
        for rnd in range(args.rounds):
            for weights, experts in variants:
                llama.moe_mlp = experts_in_torch_ops if experts == "torch ops" else native_moe
                load = os.getloadavg()[0]
                t0 = time.perf_counter()
                outs = engines[weights].generate(prompts, params)
                rate = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
                print(f"round {rnd} weights {weights:5s} experts {experts:9s}: {rate:6.1f} tok/s (load {load:.2f})",
                      flush=True)
    finally:
        llama.moe_mlp = native_moe


if __name__ == "__main__":
    main()
