"""Random-weight Llama checkpoints and PEFT adapters with a real model's shapes, for speed benchmarks.

Throughput does not depend on the weights' values (benchmarks ignore EOS), so a random checkpoint
with a model's exact shapes and tokenizer measures what the real one would, where the real one
cannot go (a GPU box that receives only a small folder) or cannot be downloaded (Llama-7B shapes).
The tokens such a model writes mean nothing: never use it for accuracy.

    # config + tokenizer of the default model (SmolLM2), no weights: a 3 MB folder that travels
    python scripts/random_checkpoint.py --like default --out .bench/smollm2 --no-weights
    # where it runs: random weights for the config.json already in the folder
    python scripts/random_checkpoint.py --out .bench/smollm2
    # Llama-7B shapes with SmolLM2's tokenizer, and 32 adapters of ranks 8..64 on q,k,v,o
    python scripts/random_checkpoint.py --like default --out /tmp/llama7b --set hidden_size=4096 \\
        intermediate_size=11008 num_hidden_layers=32 num_attention_heads=32 num_key_value_heads=32 \\
        tie_word_embeddings=false --adapters 32 --ranks 8 16 32 64
    # another family's model: Gemma-2-2B's config (transformers' Gemma2Config with its dimensions,
    # vocabulary size included) with SmolLM2's tokenizer, so W1's prompts are the same tokens, and W1's
    # four adapters (ranks 8, 16, 8, 16 on q,k,v,o)
    python scripts/random_checkpoint.py --like default --shape gemma-2-2b --out .bench/gemma2-2b \\
        --adapters 4 --ranks 8 16
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# --shape: a real model's config, by transformers' config class and the model's published config.json
SHAPES = {
    "qwen2.5-0.5b": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True)),
    "gemma-2-2b": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, max_position_embeddings=8192, rope_theta=10000.0, rms_norm_eps=1e-6,
        sliding_window=4096, query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
    # a mixture of experts: 128 experts of 768, 8 per token (3.3B of 30.5B parameters active)
    "qwen3-30b-a3b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False)),
}


def write_skeleton(like: str | None, out: Path, overrides: dict, shape: str | None = None) -> None:
    """config.json, tokenizer.json, tokenizer_config.json and generation_config.json of a model
    (shape: a SHAPES config in place of `like`'s, which then gives only the tokenizer)."""
    from asyncserve.model.loader import load_model

    loaded = load_model(None if like == "default" else like)
    c, tok = loaded.config, loaded.tokenizer
    if shape is not None:
        import transformers

        config_class, architecture, dims = SHAPES[shape]
        # overrides go through the config class, so what derives from them follows (Gemma's layer_types)
        config = getattr(transformers, config_class)(**{**dims, **overrides}, bos_token_id=c.bos_token_id,
                                                     eos_token_id=c.eos_token_ids).to_dict()
        config.update({"architectures": [architecture], "torch_dtype": "bfloat16"})
    else:
        config = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "rope_scaling": c.rope_scaling, "max_position_embeddings": c.max_position,
            "tie_word_embeddings": c.tie_word_embeddings, "bos_token_id": c.bos_token_id,
            "eos_token_id": c.eos_token_ids, "torch_dtype": "bfloat16",
        }
        config.update(overrides)
        # head_dim follows the overridden shapes unless given
        config["head_dim"] = overrides.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": c.eos_token_ids}) + "\n")
    tok.backend.save(str(out / "tokenizer.json"))
    tok_config = {name: text for name, text in tok.special_tokens.items() if text is not None}
    if tok.chat_template:
        tok_config["chat_template"] = tok.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1) + "\n")


def random_weights(folder: Path, dtype: torch.dtype, device: torch.device, seed: int) -> int:
    """Random weights for folder/config.json (std 0.02, norms 1) as model.safetensors; returns bytes."""
    from asyncserve.model.checkpoint import expected_weight_shapes
    from asyncserve.model.loader_hf import model_config

    config = model_config(json.loads((folder / "config.json").read_text()), name=folder.name)
    g = torch.Generator(device=device).manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes: list[int] = [0]
    written: list[tuple[Path, list[str]]] = []      # each shard's file, under a temporary name, and its tensors
    for name, shape in expected_weight_shapes(config).items():
        if len(shape) == 1:
            tensor = torch.ones(shape, dtype=dtype)
        else:
            tensor = (torch.randn(shape, generator=g, device=device) * 0.02).to(dtype).cpu()
        nbytes = tensor.numel() * tensor.element_size()
        if shard_bytes[-1] and shard_bytes[-1] + nbytes > SHARD_BYTES:   # written as it fills: an 8B model
            written.append(write_shard(folder, shard, len(written) + 1))   # never sits in memory whole
            shard = {}
            shard_bytes.append(0)
        shard[name] = tensor
        shard_bytes[-1] += nbytes
    if not written:
        save_file(shard, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return shard_bytes[-1]
    written.append(write_shard(folder, shard, len(written) + 1))
    weight_map = {}
    for index, (path, names) in enumerate(written, 1):     # HF's sharded layout, now that the count is known
        final = f"model-{index:05d}-of-{len(written):05d}.safetensors"
        path.rename(folder / final)
        weight_map.update(dict.fromkeys(names, final))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": sum(shard_bytes)}, "weight_map": weight_map}, indent=1) + "\n")
    return sum(shard_bytes)


SHARD_BYTES = 2 << 30


def write_shard(folder: Path, tensors: dict[str, torch.Tensor], index: int) -> tuple[Path, list[str]]:
    path = folder / f"shard-{index}.safetensors.part"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path, list(tensors)


def random_adapters(folder: Path, count: int, ranks: list[int], targets: list[str], seed: int) -> None:
    """count PEFT LoRA folders folder/adapters/a{i} (rank ranks[i % len]), lora_alpha = 2r, float32."""
    from asyncserve.model.loader_hf import model_config

    config = model_config(json.loads((folder / "config.json").read_text()), name=folder.name)
    shapes = config.projection_shapes()
    g = torch.Generator().manual_seed(seed)
    for i in range(count):
        r = ranks[i % len(ranks)]
        tensors = {}
        for layer in range(config.num_layers):
            for module in targets:
                fan_in, fan_out = shapes[module]
                kind = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                key = f"base_model.model.model.layers.{layer}.{kind}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(r, fan_in, generator=g) * fan_in ** -0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, r, generator=g) * 0.01
        target = folder / "adapters" / f"a{i}"
        target.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(target / "adapter_model.safetensors"), metadata={"format": "pt"})
        adapter_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 2 * r,
                          "target_modules": targets, "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
                          "base_model_name_or_path": folder.name}
        (target / "adapter_config.json").write_text(json.dumps(adapter_config, indent=1) + "\n")


def parse_override(item: str) -> tuple[str, object]:
    key, _, value = item.partition("=")
    return key, json.loads(value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--like", help="a model asyncserve loads (GGUF file, HF folder, or 'default') whose config "
                                   "and tokenizer are copied; without it, --out must already hold them")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="another family's config with a real model's dimensions "
                                                          "(--like then gives only the tokenizer)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=JSON", help="config.json overrides")
    ap.add_argument("--no-weights", action="store_true")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--adapters", type=int, default=0, help="how many random PEFT adapters to write")
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--targets", nargs="+", default=["q_proj", "k_proj", "v_proj", "o_proj"], choices=LORA_TARGETS)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.shape and not args.like:
        ap.error("--shape needs --like MODEL for the tokenizer (--like default: SmolLM2's)")
    if args.like:
        write_skeleton(args.like, args.out, dict(parse_override(s) for s in args.set), args.shape)
    elif not (args.out / "config.json").is_file():
        ap.error(f"{args.out} has no config.json: pass --like MODEL")
    t0 = time.perf_counter()
    if not args.no_weights:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        nbytes = random_weights(args.out, getattr(torch, args.dtype), device, args.seed)
        print(f"wrote {nbytes / 2**30:.2f} GiB of random weights in {time.perf_counter() - t0:.1f} s")
    if args.adapters:
        random_adapters(args.out, args.adapters, args.ranks, args.targets, args.seed + 1)
        print(f"wrote {args.adapters} adapters (ranks {args.ranks}) under {args.out / 'adapters'}")


if __name__ == "__main__":
    main()
