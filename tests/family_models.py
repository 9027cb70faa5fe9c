"""Tiny random checkpoints of each supported family (transformers' own config classes) and two random
PEFT adapters on each family's target names, for tests/test_families.py and the GGUF tests."""
from __future__ import annotations

import math
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from model_io_helpers import backend_vocab, llama_cpp_permute, sentencepiece_model, write_gguf, write_sentencepiece_gguf
from quant_helpers import dequantized, quantize
from reference import (FAMILY_CLASSES, TEST_DEVICE, assert_greedy_matches, make_tiny_tokenizer, save_random_adapter,
                       save_tiny_model)

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# family -> transformers config arguments: hidden 64, GQA, windows shorter than the tests' sequences
FAMILIES = {
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rope_theta=1e6, tie_word_embeddings=False),
    "qwen2_tied": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True),
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=False),
    # Gemma (1): multi-query attention as Gemma 2B, its configs' legacy hidden_act "gelu" (the tanh form)
    "gemma": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=32, max_position_embeddings=512, hidden_act="gelu"),
    "gemma2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, max_position_embeddings=512, sliding_window=8,
                   query_pre_attn_scalar=24, attn_logit_softcapping=3.0, final_logit_softcapping=5.0),
    "gemma3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, max_position_embeddings=512, sliding_window=8,
                   query_pre_attn_scalar=24,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}),
    "phi3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, original_max_position_embeddings=128,
                 pad_token_id=0, tie_word_embeddings=False,
                 rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                               "long_factor": [2.0 + 0.5 * i for i in range(8)]}),
    # Phi-4-mini's shape of Phi-3: RoPE on half of each head (its 0.75 of 128; factors per rotated
    # frequency), tied embeddings
    "phi3_partial": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512, original_max_position_embeddings=128,
                         pad_token_id=0, tie_word_embeddings=True, partial_rotary_factor=0.5,
                         rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.2 * i for i in range(4)],
                                       "long_factor": [2.0 + 0.7 * i for i in range(4)]}),
    # SmolLM3: every 4th layer without RoPE (NoPE), tied embeddings
    "smollm3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512, rope_theta=50000.0, tie_word_embeddings=True,
                    pad_token_id=0),
    # OLMo 2: norms on the attention's and the MLP's outputs only, q and k normed whole
    "olmo2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0),
    # OLMo 3: OLMo 2's layer, three sliding layers (window 8) to one global; YaRN on the global layer only
    "olmo3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0,
                  sliding_window=8,
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 5e5},
                                   "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5,
                                                      "original_max_position_embeddings": 128}}),
    # Granite: its four multipliers away from 1 (embeddings, each residual branch, the scores, the logits)
    "granite": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
                    embedding_multiplier=3.0, residual_multiplier=0.6, attention_multiplier=0.2, logits_scaling=2.5),
}
# mixtures of experts (tests/test_moe.py): 4 or 8 experts, 2 per token; Qwen2-MoE with its shared expert
# and without renormalized top-k probabilities, Qwen3-MoE with them (as its real checkpoints)
MOE_FAMILIES = {
    "mixtral": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=64, shared_expert_intermediate_size=96, norm_topk_prob=False),
    "qwen3_moe": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, max_position_embeddings=512, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True),
}
# hybrids of linear and full attention (tests/test_qwen3_5.py): Qwen3.5, three Gated DeltaNet layers (2 key
# heads grouped over 4 value heads) to one gated attention layer rotating a quarter of each head
HYBRID_FAMILIES = {
    "qwen3_5": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=512,
                    tie_word_embeddings=False),
}
# family -> two adapters: (rank, targets, rsLoRA); the first on every projection
ADAPTERS = {
    "phi3": {"all": (4, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], False),
             "fused": (8, ["qkv_proj", "gate_up_proj"], True)},
}
DEFAULT_ADAPTERS = {"all": (4, ALL, False), "some": (8, ["q_proj", "v_proj", "down_proj"], True)}


# the chat templates of the families whose tokenizers are SentencePiece (Gemma's, Phi-3's), cut short
SPM_CHAT_TEMPLATES = {
    "gemma": ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
              "else m['role'] }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
              "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"),
    "phi3": ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + '\n' + m['content'] + '<|end|>' + '\n' }}"
             "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% else %}{{ eos_token }}{% endif %}"),
}


@dataclass
class FamilyModel:
    family: str
    folder: Path
    tokenizer: object
    base: object                   # the transformers model (reference)
    adapters: dict[str, Path]
    sentencepiece: bool = False    # the tokenizer is a SentencePiece vocabulary (else a byte-level BPE)


def sentencepiece_hf_tokenizer(family: str, folder: Path):
    """The families' SentencePiece tokenizer as transformers builds it (from a GGUF holding only the
    vocabulary) and saves it in an HF folder; Phi-3's control tokens strip the whitespace after them,
    as its tokenizer.json says (all but <unk>, <s> and <|endoftext|>)."""
    import json

    from transformers import AutoTokenizer

    gemma = family.startswith("gemma")
    path = write_sentencepiece_gguf(folder / "vocab.gguf", gemma, architecture=family,
                                    chat_template=SPM_CHAT_TEMPLATES["gemma" if gemma else family],
                                    llama={"block_count": 1, "embedding_length": 8, "attention.head_count": 2})
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=path.name)
    path.unlink()
    if family == "phi3":
        tok.save_pretrained(folder)
        config = json.loads((folder / "tokenizer.json").read_text())
        _, tokens, _, types = sentencepiece_model(False)
        strip = {t for t, kind in zip(tokens, types) if kind == 3} - {"<unk>", "<s>", "<|endoftext|>"}
        for added in config["added_tokens"]:
            added["rstrip"] = added["content"] in strip
        (folder / "tokenizer.json").write_text(json.dumps(config))
        tok = AutoTokenizer.from_pretrained(folder)
    return tok


def build_family_model(root: Path, name: str, sentencepiece: bool = False, **overrides) -> FamilyModel:
    """name: a key of FAMILIES or HYBRID_FAMILIES (qwen2_tied: Qwen2 with tied embeddings); sentencepiece: a SentencePiece
    vocabulary as Gemma's and Phi-3's (else a byte-level BPE); overrides: config arguments."""
    family = name if name in FAMILY_CLASSES else name.rsplit("_", 1)[0]
    if sentencepiece:
        (root / "tokenizer").mkdir(parents=True, exist_ok=True)
        tok = sentencepiece_hf_tokenizer(family, root / "tokenizer")
    else:
        tok = make_tiny_tokenizer()
    base = save_tiny_model(root / "base", tok, family, max_shard_size="100KB", random_vectors=True,
                           **{**(FAMILIES.get(name) or HYBRID_FAMILIES[name]), **overrides})
    paths = {}
    for i, (adapter, (r, targets, rslora)) in enumerate(ADAPTERS.get(family, DEFAULT_ADAPTERS).items()):
        paths[adapter] = root / "adapters" / adapter
        save_random_adapter(base, paths[adapter], r=r, targets=targets, rslora=rslora, seed=200 + i)
    return FamilyModel(family, root / "base", tok, base, paths, sentencepiece)


# HF module -> llama.cpp tensor, as its converter names them (Gemma: see _GEMMA_LAYER)
_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GEMMA_LAYER = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}


# the tokenizer.ggml.pre llama.cpp's converter writes for the real checkpoints of these families
_CONVERTER_PRE = {"llama": "llama-bpe", "smollm3": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2", "qwen3_5": "qwen35"}
# general.architecture where llama.cpp's differs from the family's name
_GGUF_ARCHITECTURE = {"olmo3": "olmo2", "qwen3_5": "qwen35"}


def write_family_gguf(model: FamilyModel, path: Path, projections=None, metadata_changes: dict | None = None,
                      tensor_changes: dict | None = None) -> Path:
    """The model as llama.cpp's convert_hf_to_gguf writes it (float32 tensors): its names, Llama's Q/K
    rows interleaved, Gemma's norms as 1 + w, Phi-3's fused tensors and longrope factors and Llama
    3.1's RoPE divisors as tensors, the family's metadata keys. projections: a
    gguf.GGMLQuantizationType for the layers' projections, whose blocks' values then replace
    model.base's weights (the reference runs the file's weights). metadata_changes (keys after
    "{arch}.") and tensor_changes (a float32 array, or None to leave the tensor out): a bad file."""
    cfg, family = model.base.config, model.family
    gemma = family.startswith("gemma")
    sandwich = family in ("gemma2", "gemma3")       # Gemma 2 and 3: four norms a layer, windows, soft caps
    olmo = family in ("olmo2", "olmo3")
    names = {**_GGUF_LAYER, **(_GEMMA_LAYER if sandwich or olmo else {})}
    tensors = {}
    for name, weight in model.base.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if family == "qwen3_5" and (qwen35 := _qwen35_gguf_tensor(name, weight, cfg)) is not None:
            tensors[qwen35[0]] = (qwen35[1].float().numpy(), None)      # float: the loader dequantizes them
            continue
        if name.startswith("model.layers."):
            _, _, layer, *module, kind = name.split(".")
            gguf_name = f"blk.{layer}.{names['.'.join(module)]}.{kind}"
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]
        if (gemma or family == "qwen3_5") and name.endswith("norm.weight") and ".linear_attn." not in name:
            weight = weight + 1.0
        if family in ("llama", "smollm3", "granite") and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            weight = llama_cpp_permute(weight, heads)
        if projections is not None and name.endswith("proj.weight"):
            blocks = quantize(weight.float().numpy(), projections)
            with torch.no_grad():
                weight.copy_(torch.from_numpy(dequantized(blocks, projections)))
            tensors[gguf_name] = (blocks, projections)
            continue
        tensors[gguf_name] = (weight.float().numpy(), None)
    metadata = {
        "context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
        "block_count": cfg.num_hidden_layers, "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
        "attention.key_length": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
    }
    fraction = (cfg.rope_parameters or {}).get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    metadata["rope.dimension_count"] = int(metadata["attention.key_length"] * fraction)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    metadata["rope.freq_base"] = float(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        metadata.update({"rope.scaling.type": "linear", "rope.scaling.factor": float(rope["factor"])})
    if rope.get("rope_type") == "yarn":
        metadata.update({"rope.scaling.type": "yarn", "rope.scaling.factor": float(rope["factor"]),
                         "rope.scaling.original_context_length": rope["original_max_position_embeddings"]})
        for key, gguf_key in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"),
                              ("attention_factor", "yarn_attn_factor")):
            if rope.get(key) is not None:
                metadata[f"rope.scaling.{gguf_key}"] = float(rope[key])
    if rope.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = (llama3_rope_divisors(rope, metadata["rope.dimension_count"]), None)
    if sandwich:
        metadata["attention.sliding_window"] = cfg.sliding_window
        if cfg.final_logit_softcapping is not None:
            metadata["final_logit_softcapping"] = float(cfg.final_logit_softcapping)
    if family == "gemma2":
        metadata["attn_logit_softcapping"] = float(cfg.attn_logit_softcapping)
    if family == "granite":
        metadata.update({"embedding_scale": cfg.embedding_multiplier, "residual_scale": cfg.residual_multiplier,
                         "attention.scale": cfg.attention_multiplier, "logit_scale": cfg.logits_scaling})
    if family == "olmo3":
        metadata["attention.sliding_window"] = cfg.sliding_window
    if family in ("gemma3", "olmo3"):
        metadata["attention.sliding_window_pattern"] = [t == "sliding_attention" for t in cfg.layer_types]
    if family == "gemma3":
        metadata["rope.freq_base_swa"] = float(cfg.rope_parameters["sliding_attention"]["rope_theta"])
    if family == "qwen3_5":
        metadata.update({"ssm.conv_kernel": cfg.linear_conv_kernel_dim, "ssm.state_size": cfg.linear_key_head_dim,
                         "ssm.group_count": cfg.linear_num_key_heads, "ssm.time_step_rank": cfg.linear_num_value_heads,
                         "ssm.inner_size": cfg.linear_value_head_dim * cfg.linear_num_value_heads,
                         "attention.recurrent_layers": [t == "linear_attention" for t in cfg.layer_types],
                         "full_attention_interval": 4})
    if family == "phi3":
        for kind in ("long", "short"):
            tensors[f"rope_factors_{kind}.weight"] = (np.array(rope[f"{kind}_factor"], dtype=np.float32), None)
        original = rope["original_max_position_embeddings"]
        metadata.update({"rope.scaling.original_context_length": original, "rope.scaling.attn_factor": float(
            np.sqrt(1 + np.log(cfg.max_position_embeddings / original) / np.log(original)))})
    metadata.update(metadata_changes or {})
    for name, values in (tensor_changes or {}).items():
        if values is None:
            tensors.pop(name)
        else:
            tensors[name] = (values, None)
    if model.sentencepiece:
        return write_sentencepiece_gguf(path, gemma, architecture=family, chat_template=model.tokenizer.chat_template,
                                        llama=metadata, tensors=tensors)
    tokens, merges, special = backend_vocab(model.tokenizer.backend_tokenizer)
    return write_gguf(path, architecture=_GGUF_ARCHITECTURE.get(family, family), tokens=tokens, merges=merges, special=special,
                      pre=_CONVERTER_PRE.get(family, "gpt-2"),
                      bos_id=model.tokenizer.bos_token_id, eos_id=model.tokenizer.eos_token_id,
                      chat_template=model.tokenizer.chat_template, llama=metadata, tensors=tensors)


def llama3_rope_divisors(rope: dict, dim: int) -> np.ndarray:
    """Llama 3.1's RoPE scaling as llama.cpp's converter stores it (rope_freqs): per frequency, what its
    inverse frequency is divided by (1 for the fast ones, factor for the slow ones, a blend between)."""
    factor, low, high = rope["factor"], rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    original = rope["original_max_position_embeddings"]
    divisors = []
    for i in range(0, dim, 2):
        wavelength = 2 * math.pi * rope["rope_theta"] ** (i / dim)
        if wavelength < original / high:
            divisors.append(1.0)
        elif wavelength > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


# Qwen3.5's layer tensors as llama.cpp's converter names them (_qwen35_gguf_tensor)
_QWEN35_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
                 "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate",
                 "linear_attn.in_proj_b": "ssm_beta", "linear_attn.in_proj_a": "ssm_alpha",
                 "linear_attn.conv1d": "ssm_conv1d", "linear_attn.norm": "ssm_norm", "linear_attn.out_proj": "ssm_out"}


def _qwen35_gguf_tensor(name: str, weight, cfg):
    """(GGUF name, tensor) of a Qwen3.5 layer tensor the converter writes otherwise than the generic names, as
    it writes it: the value heads tiled (head j of key head i at j * key_heads + i) in the linear-attention
    tensors, -exp(A_log), the conv's taps squeezed; None for the rest."""
    if not name.startswith("model.layers."):
        return None
    _, _, layer, rest = name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    if rest in ("linear_attn.A_log", "linear_attn.dt_bias"):
        module, kind = rest, ""
    k_heads, v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    per_key, v_dim = v_heads // k_heads, cfg.linear_value_head_dim

    def tiled(t, dim, head):
        shape = list(t.shape)
        return t.reshape(*shape[:dim], k_heads, per_key, head, *shape[dim + 1:]).transpose(dim, dim + 1).reshape(shape)

    qk = 2 * k_heads * cfg.linear_key_head_dim
    if module == "linear_attn.A_log":
        return f"blk.{layer}.ssm_a", -tiled(weight.exp(), 0, 1)
    if module == "linear_attn.dt_bias":
        return f"blk.{layer}.ssm_dt.bias", tiled(weight, 0, 1)
    if module in ("linear_attn.in_proj_qkv", "linear_attn.conv1d"):
        weight = weight.reshape(weight.shape[0], -1)
        weight = torch.cat([weight[:qk], tiled(weight[qk:], 0, v_dim)])
    elif module == "linear_attn.in_proj_z":
        weight = tiled(weight, 0, v_dim)
    elif module in ("linear_attn.in_proj_a", "linear_attn.in_proj_b"):
        weight = tiled(weight, 0, 1)
    elif module == "linear_attn.out_proj":
        weight = tiled(weight, 1, v_dim)
    elif module not in _QWEN35_LAYER:
        return None
    if module.endswith("norm") and module != "linear_attn.norm":
        weight = weight + 1.0
    return f"blk.{layer}.{_QWEN35_LAYER[module]}.{kind}", weight


def loads_as_the_folder(path: Path, folder: Path):
    """(the GGUF file's LoadedModel, the HF folder's), checked to be the same family with the same
    weights under the same names."""
    import torch

    from asyncserve.model.loader import load_model

    from_gguf, from_folder = load_model(str(path)), load_model(str(folder))
    assert from_gguf.config.family == from_folder.config.family
    assert set(from_gguf.weights) == set(from_folder.weights)
    for name, weight in from_folder.weights.items():
        torch.testing.assert_close(from_gguf.weights[name], weight, rtol=0, atol=1e-6)
    return from_gguf, from_folder


# ---- models with adapters of any kind, and their greedy runs against transformers+PEFT ----------------

GREEDY_TOKENS = 8


def build_with_adapters(root: Path, family: str, adapters: dict) -> FamilyModel:
    """A tiny random ``family`` model (its FAMILIES shape; Qwen2's for llama) with adapters name ->
    (rank, targets, extra save_random_adapter / LoraConfig arguments)."""
    tok = make_tiny_tokenizer()
    shape = FAMILIES.get(family) or MOE_FAMILIES.get(family) or FAMILIES["qwen2"]
    base = save_tiny_model(root / "base", tok, family, random_vectors=True, **shape)
    paths = {}
    for i, (name, (r, targets, extra)) in enumerate(adapters.items()):
        paths[name] = root / "adapters" / name
        save_random_adapter(base, paths[name], r=r, targets=targets, seed=300 + i, **extra)
    return FamilyModel(family, root / "base", tok, base, paths)


def cases_of(model: FamilyModel, lengths=(4, 11, 19), adapters=None) -> list:
    """Random prompts of these lengths, each with the base model and every adapter."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, len(model.tokenizer)) for _ in range(n)] for n in lengths]
    return [(ids, a) for ids in prompts for a in [None, *(adapters or model.adapters)]]


def with_references(model: FamilyModel) -> tuple[FamilyModel, list, list]:
    """(the model, cases_of it, transformers+PEFT's greedy runs of them): a test module's fixture."""
    from reference import peft_references

    cases = cases_of(model)
    return model, cases, peft_references(model.base, model.adapters, cases, GREEDY_TOKENS)


STEP_PATHS = ["loop", "ops", "eager", "triton"]


def llm_on_path(model: FamilyModel, path: str, monkeypatch):
    """An LLM of the model and all its adapters in float32 whose steps take ``path``: "loop" the one-call
    native layer loop, "ops" the Python loop over the native kernels, "eager" torch ops, "triton" the
    Triton LoRA kernels (in the interpreter on CPU)."""
    from asyncserve import LLM
    from reference import require_native_kernels

    monkeypatch.setenv("ASYNCSERVE_NATIVE", "0" if path == "eager" else "1")
    monkeypatch.setenv("ASYNCSERVE_NATIVE_DECODER", "0" if path == "ops" else "1")
    if path in ("loop", "ops"):
        require_native_kernels()
    return LLM(model=str(model.folder), adapters={k: str(v) for k, v in model.adapters.items()}, dtype="float32",
               device=TEST_DEVICE, max_step_tokens=16, **({"lora_backend": "triton"} if path == "triton" else {}))


def generate_greedy(model: FamilyModel, cases, adapters=None, **kwargs):
    """(the LLM, each case's greedy tokens) in float32 on the test device, prompts chunked."""
    from asyncserve import LLM

    llm = LLM(model=str(model.folder), adapters={k: str(v) for k, v in (adapters or model.adapters).items()},
              dtype="float32", device=TEST_DEVICE, max_step_tokens=16, **kwargs)
    return llm, greedy_tokens(llm, cases)


def greedy_tokens(llm, cases) -> list[list[int]]:
    """Each case's (prompt ids, adapter or None) GREEDY_TOKENS greedy tokens, all in one generate call."""
    from asyncserve import SamplingParams

    outs = llm.generate([c[0] for c in cases], SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0,
                                                              ignore_eos=True), adapters=[c[1] for c in cases])
    return [o.token_ids for o in outs]


def split_stacked_experts(weights: dict, target_parameters: list[str], experts: int) -> dict:
    """A PEFT adapter's tensors on transformers v5's stacked experts (target_parameters) as v4's per-expert
    ones under Qwen's names (mlp.experts.{e}.gate_proj ...): expert e's A is rows e*r.. of the stacked
    lora_A, its B columns e::experts of lora_B, gate_up_proj's rows split into gate's and up's. Two
    targeted parameters nest, gate_up_proj one "base_layer." deeper. Other tensors pass as they are."""
    import re

    targeted = [p for p in ("gate_up_proj", "down_proj") if any(t.endswith(p) for t in target_parameters)]
    out = {}
    for key in [k for k in weights if ".lora_A." in k]:
        a, b = weights[key], weights[key.replace("lora_A", "lora_B")]
        m = re.fullmatch(r"(.*\.layers\.\d+\.)mlp\.experts\.((?:base_layer\.)*)lora_A\.weight", key)
        if m is None:
            out[key], out[key.replace("lora_A", "lora_B")] = a, b
            continue
        parameter = targeted[len(targeted) - 1 - m.group(2).count(".")]
        r = a.shape[0] // experts
        projs = ["gate_proj", "up_proj"] if parameter == "gate_up_proj" else ["down_proj"]
        for e in range(experts):
            for proj, rows in zip(projs, b[:, e::experts].chunk(len(projs))):
                out[f"{m.group(1)}mlp.experts.{e}.{proj}.lora_A.weight"] = a[e * r:(e + 1) * r].clone()
                out[f"{m.group(1)}mlp.experts.{e}.{proj}.lora_B.weight"] = rows.clone()
    return out


def check_greedy(tokens, cases, refs, label, tie_tol=1e-3) -> None:
    """Every case the reference's tokens (a near-tie may flip one case)."""
    equal = [assert_greedy_matches(ours, ref, tie_tol=tie_tol, label=f"{label} case {i} adapter {case[1]}")
             for i, (ours, ref, case) in enumerate(zip(tokens, refs, cases))]
    assert sum(equal) >= len(cases) - 1, f"{label}: {equal}"


def broken_copy(source: Path, folder: Path, edit_config=None, edit_weights=None) -> Path:
    """A copy of the adapter folder ``source`` with its config (edit_config(dict) -> dict) and its
    tensors (edit_weights(dict), in place) edited."""
    import json

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    if edit_config:
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps(edit_config(config)))
    if edit_weights:
        weights = load_file(folder / "adapter_model.safetensors")
        edit_weights(weights)
        save_file(weights, folder / "adapter_model.safetensors")
    return folder


def renamed(old: str, new: str):
    """An edit for broken_copy: every tensor whose name holds ``old`` renamed with ``new`` in its place."""
    def edit(weights: dict) -> None:
        for key in [k for k in weights if old in k]:
            weights[key.replace(old, new)] = weights.pop(key)
    return edit


def assert_refused_each_alone(model: FamilyModel, cases, refs, source: str, bad: dict, tmp_path: Path) -> None:
    """Each of ``bad`` (label -> (config edit, tensors edit, the reason's pattern)) on a copy of adapter
    ``source`` is refused at load with its reason, alone: the adapters loaded before still give the
    references' tokens."""
    from asyncserve import LLM

    llm = LLM(model=str(model.folder), adapters={k: str(v) for k, v in model.adapters.items()}, dtype="float32",
              device=TEST_DEVICE, max_step_tokens=16)
    paths = {label: (broken_copy(model.adapters[source], tmp_path / f"bad{i}", config, weights), why)
             for i, (label, (config, weights, why)) in enumerate(bad.items())}
    assert_each_refused(llm, paths, cases, refs)


def assert_each_refused(llm, bad: dict, cases, refs) -> None:
    """Loading each of ``bad`` (label -> (adapter path, the reason's pattern)) into ``llm`` is refused with
    its reason and registers nothing; then the adapters loaded before still give the references' tokens."""
    import pytest

    from asyncserve.pager.adapters import AdapterError

    for i, (label, (path, why)) in enumerate(bad.items()):
        with pytest.raises(AdapterError, match=why):
            llm.load_adapter(f"bad{i}", str(path))
        assert f"bad{i}" not in llm.engine.pager.registry, label
    check_greedy(greedy_tokens(llm, cases), cases, refs, "after the refusals")


def assert_tensor_parallel_refuses(model: FamilyModel, names: list[str]) -> None:
    """At --tensor-parallel 2, beside the adapter "plain", loading each of ``names`` is refused with the
    reason, and none is registered."""
    import pytest

    from asyncserve import LLM
    from asyncserve.pager.adapters import AdapterError

    llm = LLM(model=str(model.folder), adapters={"plain": str(model.adapters["plain"])}, dtype="float32",
              max_step_tokens=24, tensor_parallel=2)
    try:
        for name in names:
            with pytest.raises(AdapterError, match="not served with --tensor-parallel"):
                llm.load_adapter(name, str(model.adapters[name]))
            assert name not in llm.engine.pager.registry
    finally:
        llm.engine.close()


# ---- multimodal checkpoints (tests/test_multimodal_text.py): tiny towers, the language model as above ----

MULTIMODAL_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2)
SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)
QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
# wrapper -> (config class, model class, the language model's family, config arguments)
WRAPPERS = {
    "gemma3": ("Gemma3Config", "Gemma3ForConditionalGeneration", "gemma3", dict(
        text_config=dict(MULTIMODAL_TEXT, head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
                         layer_types=["sliding_attention", "full_attention"],
                         rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                          "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                             "rope_theta": 1e6}}),
        vision_config=SIGLIP, mm_tokens_per_image=4)),
    "mistral3": ("Mistral3Config", "Mistral3ForConditionalGeneration", "llama", dict(
        text_config=dict(MULTIMODAL_TEXT, model_type="mistral", head_dim=16, tie_word_embeddings=False),
        tie_word_embeddings=False,
        vision_config=dict(SIGLIP, model_type="pixtral", head_dim=16))),
    "llava": ("LlavaConfig", "LlavaForConditionalGeneration", "qwen2", dict(
        text_config=dict(MULTIMODAL_TEXT, model_type="qwen2"),
        vision_config=dict(SIGLIP, model_type="siglip_vision_model"),
        vision_feature_layer=-1)),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", "qwen2", dict(
        text_config=dict(MULTIMODAL_TEXT, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                           "rope_theta": 1e6}),
        vision_config=dict(QWEN_VISION, fullatt_block_indexes=[0]))),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", "qwen3", dict(
        text_config=dict(MULTIMODAL_TEXT, head_dim=16,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True, "rope_theta": 5e6}),
        vision_config=dict(QWEN_VISION, deepstack_visual_indexes=[0]), tie_word_embeddings=True)),
}
# "all-linear": every projection of the language model and the towers; "qv": two of the language model's,
# one layer's v_proj at another rank by its path under the wrapper (PEFT matches rank_pattern keys to the end
# of the module's whole name)
MULTIMODAL_ADAPTERS = {"all": (4, "all-linear", dict(rslora=False)),
            "qv": (8, ["q_proj", "v_proj"],
                   dict(rslora=True, rank_pattern={"language_model.layers.1.self_attn.v_proj": 2}))}


def build_multimodal(root: Path, wrapper: str, text_overrides: dict | None = None) -> FamilyModel:
    """A tiny random multimodal checkpoint (WRAPPERS) and its MULTIMODAL_ADAPTERS."""
    import json

    import transformers

    from reference import save_random_model

    config_class, model_class, family, arguments = WRAPPERS[wrapper]
    tok = make_tiny_tokenizer()
    arguments = json.loads(json.dumps(arguments))
    arguments["text_config"].update(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                    eos_token_id=tok.eos_token_id, **(text_overrides or {}))
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**arguments)).eval()
    save_random_model(root / "base", model, tok, family, random_vectors=True)
    paths = {}
    for i, (name, (r, targets, extra)) in enumerate(MULTIMODAL_ADAPTERS.items()):
        paths[name] = root / "adapters" / name
        save_random_adapter(model, paths[name], r=r, targets=targets, seed=400 + i, **extra)
    return FamilyModel(family, root / "base", tok, model, paths)
