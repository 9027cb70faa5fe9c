"""Decode steps of a model family (#34): the native layer loop, the Python loop over the native kernels
and the eager torch ops, on a random checkpoint with a real model's shapes.

    .venv/bin/python scripts/bench_families.py --shape gemma-2-2b --threads 2
    .venv/bin/python scripts/bench_families.py --shape qwen2.5-0.5b --layers 6 --set vocab_size=38000

The shapes are random_checkpoint.py's (--shape: the real models' configs through transformers' config
classes; Gemma-2-2B: GeGLU, (1 + w) and sandwich norms, windows of 4,096 on every other layer, soft
caps; Qwen2.5-0.5B: q/k/v biases, tied embeddings), with SmolLM2's tokenizer; --layers keeps fewer
layers and --set overrides any key, to fit a small box. W1's load: --decodes
sequences (16) of 64 random prompt tokens decoding together, request i on adapter a{i % 4} (ranks 8,
16, 8, 16 on q, k, v and o, random). Each path (--paths) has its own engine over the same folder
(ASYNCSERVE_NATIVE and ASYNCSERVE_NATIVE_DECODER set around its steps); the engines prefill, then
their decode steps alternate, --steps each; prints the median decode step per path and the ratios
to the eager one; path "base" is the native layer loop with no adapter on any request, against which
the loop's LoRA/base throughput is printed. The tokens such a model writes mean nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from random_checkpoint import SHAPES, parse_override, random_adapters, random_weights, write_skeleton  # noqa: E402

# path -> (ASYNCSERVE_NATIVE, ASYNCSERVE_NATIVE_DECODER); "base" is the loop with no adapter on any request
PATHS = {"loop": ("1", "1"), "ops": ("1", "0"), "eager": ("0", "1"), "base": ("1", "1")}


def write_checkpoint(folder: Path, shape: str, overrides: dict, dtype: torch.dtype) -> dict:
    """random_checkpoint's --shape model (SmolLM2's tokenizer), random weights and W1's 4 adapters; its config."""
    write_skeleton("default", folder, overrides, shape)
    random_weights(folder, dtype, torch.device("cpu"), seed=0)
    random_adapters(folder, 4, [8, 16], ["q_proj", "k_proj", "v_proj", "o_proj"], seed=1)
    return json.loads((folder / "config.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True, help="random_checkpoint.py's real-model shapes")
    ap.add_argument("--layers", type=int, help="keep this many layers (default: the model's)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=JSON", help="config.json overrides")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decodes", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20, help="measured decode steps per path")
    ap.add_argument("--paths", default="loop,ops,eager,base")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    overrides = dict(parse_override(s) for s in args.set)
    if args.layers:
        overrides["num_hidden_layers"] = args.layers
    dtype = getattr(torch, args.dtype)

    from asyncserve import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / args.shape
        config = write_checkpoint(folder, args.shape, overrides, dtype)
        adapters = {p.name: str(p) for p in sorted((folder / "adapters").iterdir())}
        rng = random.Random(0)
        # ids the tokenizer (SmolLM2's, 49,152) has, whatever the model's vocabulary
        prompts = [[rng.randrange(3, min(config["vocab_size"], 49152)) for _ in range(64)] for _ in range(args.decodes)]
        params = SamplingParams(max_tokens=100000, temperature=0.0, ignore_eos=True)
        paths = args.paths.split(",")
        engines, times = {}, {path: [] for path in paths}

        def step(path):
            os.environ["ASYNCSERVE_NATIVE"], os.environ["ASYNCSERVE_NATIVE_DECODER"] = PATHS[path]
            t0 = time.perf_counter()
            engines[path].step()
            return time.perf_counter() - t0

        for path in paths:
            os.environ["ASYNCSERVE_NATIVE"], os.environ["ASYNCSERVE_NATIVE_DECODER"] = PATHS[path]
            engine = LLM(model=str(folder), adapters=adapters, dtype=args.dtype, device="cpu", threads=args.threads,
                         max_running=args.decodes, prefix_caching=False).engine
            for i, ids in enumerate(prompts):
                engine.add(engine.make_sequence(ids, params, None if path == "base" else f"a{i % 4}"))
            engines[path] = engine
            for _ in range(8):          # the prefills, then a few decode steps to warm up
                step(path)
        load = os.getloadavg()[0]
        for _ in range(args.steps):
            for path in paths:
                times[path].append(step(path))
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    shape = ", ".join(f"{k}={config[k]}" for k in ("num_hidden_layers", "hidden_size", "vocab_size"))
    print(f"# {args.shape} ({shape}), {args.dtype}, {args.threads} threads, {args.decodes} decodes, 4 adapters; "
          f"{cpu}; load average {load:.1f}")
    median = {path: statistics.median(times[path]) * 1e3 for path in paths}
    for path in paths:
        ratio = f", {median['eager'] / median[path]:.2f}x eager" if "eager" in median else ""
        print(f"{path:6s} median decode step {median[path]:8.2f} ms{ratio}")
    if "loop" in median and "base" in median:
        print(f"LoRA/base (the loop's throughput with W1's adapters over without): {median['base'] / median['loop']:.3f}")


if __name__ == "__main__":
    main()
