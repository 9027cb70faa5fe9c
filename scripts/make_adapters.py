"""Write N random PEFT LoRA adapters of mixed ranks and target projections for a base model.

What the many-adapter tests and benchmarks serve (S-LoRA's 1,000 adapters): folders DIR/a0000,
DIR/a0001, ... each with adapter_config.json and adapter_model.safetensors, loadable by asyncserve
and by PEFT. Adapter i takes a rank and a target set at random (seeded) from --ranks and --targets.

    # 1,000 adapters for the default model (SmolLM2), ranks 8..64, attention-only or all projections
    python scripts/make_adapters.py 1000 /tmp/adapters --model default
    # for an HF folder; or --model tiny: the shapes of the tests' tiny Llama (tests/reference.py)
    python scripts/make_adapters.py 20 /tmp/tiny-adapters --model tiny --ranks 1 4 8 --targets q_proj,v_proj all
    # named lora0, lora1, ...: what scripts/bench_serving.py --workload slora asks for
    python scripts/make_adapters.py 1000 /tmp/adapters --prefix lora
    # DoRA adapters, their magnitudes as PEFT initializes them (the adapted rows' norms, read from the
    # base weights): the same tokens as the plain LoRA adapters of the same seed, DoRA's work on top
    python scripts/make_adapters.py 4 /tmp/dora-adapters --dora
    # a mixture of experts: "experts" adds every routed expert's gate/up/down_proj, as PEFT named them on
    # transformers v4's per-expert modules (mlp.experts.{e}.gate_proj; what llama.cpp's converter reads)
    python scripts/make_adapters.py 4 /tmp/moe-adapters --model /tmp/moe --ranks 16 --targets q_proj,v_proj,experts
"""
from __future__ import annotations

import argparse
import json
import random
import re
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALPHA_PER_RANK = 2          # lora_alpha = 2 r: every adapter's scaling s is 2
# tests/reference.py save_tiny_llama's defaults: hidden 64, 2 layers, 4 heads (16 wide), 2 KV heads, 128
TINY = {"num_layers": 2, "shapes": {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
                                    "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}}


def model_shapes(model: str) -> tuple[str, int, dict[str, tuple[int, int]]]:
    """(name, layers, {projection: (in, out)}) of 'tiny', 'default', an HF folder or a GGUF file."""
    if model == "tiny":
        return "tiny-llama", TINY["num_layers"], TINY["shapes"]
    folder = Path(model)
    if (folder / "config.json").is_file():          # the config alone, no weights read
        from asyncserve.model.loader_hf import model_config
        config = model_config(json.loads((folder / "config.json").read_text()), name=folder.name)
    else:
        from asyncserve.model.loader import load_model
        config = load_model(None if model == "default" else model).config
    return config.name, config.num_layers, config.projection_shapes()


def write_adapter(folder: Path, base_name: str, num_layers: int, shapes: dict[str, tuple[int, int]], r: int,
                  targets: tuple[str, ...], generator: torch.Generator, dtype: torch.dtype,
                  base_weights: dict | None = None) -> None:
    """One PEFT LoRA folder; B random too (not PEFT's zero init), at a scale where it changes tokens.
    base_weights (the base model's, by HF name): a DoRA adapter, each magnitude ||W + s·B·A|| per row."""
    tensors = {}
    for layer in range(num_layers):
        for module in targets:
            fan_in, fan_out = shapes[module]
            container = "mlp" if module in MLP or module.startswith("experts.") else "self_attn"
            name = f"model.layers.{layer}.{container}.{module}"
            key = f"base_model.model.{name}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(r, fan_in, generator=generator) * fan_in ** -0.5).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, r, generator=generator) * 0.3 / r ** 0.5).to(dtype)
            if base_weights is not None:
                tensors[f"{key}.lora_magnitude_vector"] = dora_magnitude(
                    base_weights[f"{name}.weight"], tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"],
                    ALPHA_PER_RANK).to(dtype)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": ALPHA_PER_RANK * r,
              "target_modules": list(dict.fromkeys(t.rpartition(".")[2] for t in targets)), "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
              "use_dora": base_weights is not None, "base_model_name_or_path": base_name}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=1) + "\n")


def dora_magnitude(weight, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """DoRA's magnitude as PEFT initializes it: ||W + s·B·A|| per output row, float32 [out]. weight: the
    base's [out, in] (a tensor, or GGUF blocks that dequantize)."""
    w = (weight.dequantize() if hasattr(weight, "dequantize") else weight).float()
    return torch.linalg.norm(w + scaling * (b.float() @ a.float()), dim=1)


_A_KEY = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_A\.weight$")


def dora_copy(source: Path, out: Path, base_weights: dict) -> None:
    """The PEFT LoRA folder ``source`` as a DoRA adapter in ``out``: the same A and B, magnitudes as PEFT
    initializes them, so the same tokens with DoRA's work on top (scripts/bench_offline.py's ours-dora)."""
    config = json.loads((source / "adapter_config.json").read_text())
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"{source}: rank or alpha patterns are not copied as DoRA")
    r = config["r"]
    scaling = config["lora_alpha"] / (r ** 0.5 if config.get("use_rslora") else r)
    tensors = load_file(str(source / "adapter_model.safetensors"))
    for key in [k for k in tensors if _A_KEY.search(k)]:
        layer, kind, module = _A_KEY.search(key).groups()
        prefix = key[:-len(".lora_A.weight")]
        tensors[f"{prefix}.lora_magnitude_vector"] = dora_magnitude(
            base_weights[f"model.layers.{layer}.{kind}.{module}.weight"], tensors[key],
            tensors[f"{prefix}.lora_B.weight"], scaling).to(tensors[key].dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}, indent=1) + "\n")


def vocab_copy(source: Path, out: Path, vocab_size: int, hidden: int, seed: int = 0) -> None:
    """The PEFT LoRA folder ``source`` with LoRA on embed_tokens and lm_head added (random, its rank and
    alpha), as PEFT saves it: lora_embedding_A/B, lm_head's lora_A/B (scripts/bench_offline.py's ours-vocab)."""
    config = json.loads((source / "adapter_config.json").read_text())
    r = config["r"]
    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(str(source / "adapter_model.safetensors"))
    dtype = next(iter(tensors.values())).dtype
    shapes = {"base_model.model.model.embed_tokens.lora_embedding_A": (r, vocab_size),
              "base_model.model.model.embed_tokens.lora_embedding_B": (hidden, r),
              "base_model.model.lm_head.lora_A.weight": (r, hidden),
              "base_model.model.lm_head.lora_B.weight": (vocab_size, r)}
    for key, shape in shapes.items():
        tensors[key] = (torch.randn(shape, generator=generator) * 0.3 / r ** 0.5).to(dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    targets = list(config["target_modules"]) + ["embed_tokens", "lm_head"]
    (out / "adapter_config.json").write_text(json.dumps(config | {"target_modules": targets}, indent=1) + "\n")


def saved_copy(source: Path, out: Path, vocab_size: int, hidden: int, seed: int = 0) -> None:
    """The PEFT LoRA folder ``source`` with embed_tokens and lm_head trained whole (random, the spread of
    a trained embedding), as PEFT saves modules_to_save (scripts/bench_offline.py's ours-saved)."""
    config = json.loads((source / "adapter_config.json").read_text())
    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(str(source / "adapter_model.safetensors"))
    dtype = next(iter(tensors.values())).dtype
    for key in ("base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight"):
        tensors[key] = (torch.randn((vocab_size, hidden), generator=generator) * 0.05).to(dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(config | {"modules_to_save": ["embed_tokens", "lm_head"]},
                                                        indent=1) + "\n")


def parse_targets(spec: str) -> tuple[str, ...]:
    """Projections, "all" (ALL) or "experts" (a mixture's routed experts', expanded by with_experts)."""
    targets = ALL if spec == "all" else tuple(spec.split(","))
    unknown = set(targets) - set(ALL) - {"experts"}
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown projections {sorted(unknown)}; choose from {', '.join(ALL)} "
                                         "or experts")
    return targets


def with_experts(targets: tuple[str, ...], shapes: dict[str, tuple[int, int]]) -> tuple[str, ...]:
    """targets with "experts" replaced by every expert projection the model has (experts.{e}.gate_proj ...)."""
    if "experts" not in targets:
        return targets
    experts = tuple(name for name in shapes if name.startswith("experts."))
    if not experts:
        raise ValueError("--targets experts: the model is not a mixture of experts")
    return tuple(t for t in targets if t != "experts") + experts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("count", type=int)
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="default", help="'tiny', 'default', an HF folder or a GGUF file")
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--targets", type=parse_targets, nargs="+",
                    default=[("q_proj", "k_proj", "v_proj", "o_proj"), ("q_proj", "v_proj"), ALL],
                    help="target sets to draw from: comma-separated projections, or 'all'")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefix", default=None,
                    help="name the folders PREFIX0, PREFIX1, ... (bench_serving.py's --adapter-prefix) instead of "
                         "a0000, a0001, ...")
    ap.add_argument("--dora", action="store_true", help="DoRA adapters (use_dora), magnitudes as PEFT initializes "
                                                        "them: reads the base weights ('tiny' has none)")
    args = ap.parse_args(argv)
    base_name, num_layers, shapes = model_shapes(args.model)
    base_weights = None
    if args.dora:
        if args.model == "tiny":
            ap.error("--dora reads the base weights; 'tiny' names shapes only")
        from asyncserve.model.loader import load_model
        base_weights = load_model(None if args.model == "default" else args.model).weights
    pick = random.Random(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    for i in range(args.count):
        name = f"{args.prefix}{i}" if args.prefix is not None else f"a{i:04d}"
        write_adapter(args.out / name, base_name, num_layers, shapes, pick.choice(args.ranks),
                      with_experts(pick.choice(args.targets), shapes), generator, getattr(torch, args.dtype),
                      base_weights)
    print(f"wrote {args.count} adapters for {base_name} under {args.out} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
