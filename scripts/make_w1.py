"""Write W1, the headline CPU workload (BENCHMARKS.md, "Workloads"), into the repository's ignored
.bench/ folder, the same files on every run:

    .venv/bin/python scripts/make_w1.py                 # .bench/w1/prompts.json, .bench/w1/adapters/a0..a3

- prompts.json: 64 prompts of exactly 64 SmolLM2 tokens each (no BOS; sent as raw completion
  prompts), "Story i:" and then words drawn at random (seeded) from workloads.py's list of words that
  are one SmolLM2 token each, so no two share a prefix block.
- adapters/a0..a3: random PEFT LoRA (scripts/make_adapters.py's write_adapter, float32, seeded) on
  q, k, v and o of SmolLM2-135M-Instruct, ranks 8, 16, 8, 16, lora_alpha 2r.

The benchmark scripts read it from .bench/ by default (--bench-dir elsewhere).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_adapters import write_adapter  # noqa: E402
from workloads import COMMON_WORDS, W1_NUM_ADAPTERS, W1_NUM_REQUESTS, W1_PROMPT_TOKENS, adapter_name  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
W1_RANKS = (8, 16, 8, 16)                                   # adapter a{k}'s rank
W1_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
W1_SEED = 2026


def w1_prompts(tokenizer, seed: int = W1_SEED) -> list[str]:
    """W1's prompts: "Story i:" then one-token words up to exactly W1_PROMPT_TOKENS tokens."""
    rng = np.random.default_rng(seed)
    prompts = []
    for i in range(W1_NUM_REQUESTS):
        head = f"Story {i}:"
        words = rng.choice(COMMON_WORDS, size=W1_PROMPT_TOKENS - len(tokenizer.encode(head, add_special_tokens=False)))
        prompt = " ".join([head, *words])
        count = len(tokenizer.encode(prompt, add_special_tokens=False))
        if count != W1_PROMPT_TOKENS:        # a word list or tokenizer that no longer keeps one word one token
            raise RuntimeError(f"W1 prompt {i} is {count} tokens, not {W1_PROMPT_TOKENS}: {prompt!r}")
        prompts.append(prompt)
    return prompts


def write_w1(out: Path, model, seed: int = W1_SEED) -> None:
    """W1 into out/w1 for ``model`` (a LoadedModel: SmolLM2's, for W1 proper)."""
    folder = out / "w1"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prompts.json").write_text(json.dumps(w1_prompts(model.tokenizer, seed), indent=1) + "\n")
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    for k in range(W1_NUM_ADAPTERS):
        write_adapter(folder / "adapters" / adapter_name("a", k), config.name, config.num_layers,
                      config.projection_shapes(), W1_RANKS[k], W1_TARGETS, generator, torch.float32)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / ".bench", help="writes OUT/w1 (default: .bench)")
    ap.add_argument("--model", default=None, help="a GGUF file or HF folder (default: SmolLM2-135M-Instruct, W1's)")
    args = ap.parse_args(argv)
    from asyncserve.model.loader import load_model

    t0 = time.perf_counter()
    write_w1(args.out, load_model(args.model))
    print(f"wrote W1 under {args.out / 'w1'} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
