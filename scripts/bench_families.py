"""Decode steps of a model family (#34): the native layer loop, the Python loop over the native kernels
and the eager torch ops, on a random checkpoint with a real model's shapes.

    .venv/bin/python scripts/bench_families.py --like gemma2-2b --threads 2
    .venv/bin/python scripts/bench_families.py --like qwen2.5-0.5b --layers 6 --set vocab_size=38000

The presets are the real models' config.json shapes (Gemma-2-2B: GeGLU, (1 + w) and sandwich norms,
windows of 4,096 on every other layer, soft caps; Qwen2.5-0.5B: q/k/v biases, tied embeddings);
--layers keeps fewer layers and --set overrides any key, to fit a small box. W1's load: --decodes
sequences (16) of 64 random prompt tokens decoding together, request i on adapter a{i % 4} (ranks 8,
16, 8, 16 on q, k, v and o, random). Each path (--paths) has its own engine over the same folder
(ASYNCSERVE_NATIVE and ASYNCSERVE_NATIVE_DECODER set around its steps); the engines prefill, then
their decode steps alternate, --steps each; prints the median decode step per path and the ratios
to the eager one. The tokens such a model writes mean nothing.
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

from random_checkpoint import parse_override, random_adapters, random_weights  # noqa: E402

PRESETS = {
    "gemma2-2b": {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 256000,
        "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 8192, "sliding_window": 4096, "query_pre_attn_scalar": 256,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "tie_word_embeddings": True,
        "hidden_activation": "gelu_pytorch_tanh",
    },
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 21, "tie_word_embeddings": True,
        "hidden_act": "silu",
    },
}
# path -> (ASYNCSERVE_NATIVE, ASYNCSERVE_NATIVE_DECODER)
PATHS = {"loop": ("1", "1"), "ops": ("1", "0"), "eager": ("0", "1")}


def write_checkpoint(folder: Path, config: dict, dtype: torch.dtype) -> None:
    """config.json, a word-level tokenizer (the prompts are token ids), random weights and W1's 4 adapters."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**config, "bos_token_id": 1, "eos_token_id": 2}, indent=1))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 256)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    random_weights(folder, dtype, torch.device("cpu"), seed=0)
    random_adapters(folder, 4, [8, 16], ["q_proj", "k_proj", "v_proj", "o_proj"], seed=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--like", choices=list(PRESETS), required=True)
    ap.add_argument("--layers", type=int, help="keep this many layers (default: the model's)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=JSON", help="config.json overrides")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decodes", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20, help="measured decode steps per path")
    ap.add_argument("--paths", default="loop,ops,eager")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    config = dict(PRESETS[args.like])
    if args.layers:
        config["num_hidden_layers"] = args.layers
    config.update(parse_override(s) for s in args.set)
    dtype = getattr(torch, args.dtype)

    from asyncserve import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / args.like
        write_checkpoint(folder, config, dtype)
        adapters = {p.name: str(p) for p in sorted((folder / "adapters").iterdir())}
        rng = random.Random(0)
        prompts = [[rng.randrange(3, config["vocab_size"]) for _ in range(64)] for _ in range(args.decodes)]
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
                engine.add(engine.make_sequence(ids, params, f"a{i % 4}"))
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
    print(f"# {args.like} ({shape}), {args.dtype}, {args.threads} threads, {args.decodes} decodes, 4 adapters; "
          f"{cpu}; load average {load:.1f}")
    median = {path: statistics.median(times[path]) * 1e3 for path in paths}
    for path in paths:
        ratio = f", {median['eager'] / median[path]:.2f}x eager" if "eager" in median else ""
        print(f"{path:6s} median decode step {median[path]:8.2f} ms{ratio}")


if __name__ == "__main__":
    main()
