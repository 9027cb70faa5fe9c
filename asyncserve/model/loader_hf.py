"""Loading an HF model folder: config.json, safetensors weights (single or sharded), tokenizer files."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open

from asyncserve.model.checkpoint import LoadedModel, ProgressCallback, expert_names, select_weights, split_fused
from asyncserve.model.config import (FAMILIES, Family, LinearAttention, ModelConfig, ModelLoadError, MoeConfig,
                                     check_rope, read_json, rope_context)
from asyncserve.model.shard import Shard, shard_config, shard_ranges
from asyncserve.model.tokenizer import Tokenizer


def load_hf_folder(folder: Path, progress: ProgressCallback | None = None, shard: Shard | None = None) -> LoadedModel:
    """shard: a tensor-parallel rank's slices only (model/shard.py), read as slices of the files; the
    config stays the whole model's. A multimodal checkpoint (MULTIMODAL) serves its language model:
    the vision encoder's and projector's tensors are never read."""
    config_json = read_json(folder / "config.json")
    generation_file = folder / "generation_config.json"
    generation = read_json(generation_file) if generation_file.is_file() else {}
    text_json, wrapper = language_model_config(config_json, folder.name)
    config = model_config(text_json, name=folder.name)
    weight_files = _safetensors_files(folder)     # refuse a pickle-only checkpoint before any slow work
    names = None
    if wrapper:
        names = _text_weight_names(weight_files)
        # tied where the checkpoint has no head of its own, as transformers ties (and unties) composite models
        config.tie_word_embeddings = "lm_head.weight" not in names.values()
        config.towers = TOWERS

    # generation stops at any eos the model declares: generation_config.json's and config.json's
    eos_ids = list(dict.fromkeys(_ids(generation.get("eos_token_id")) + _ids(config_json.get("eos_token_id"))
                                 + (_ids(text_json.get("eos_token_id")) if wrapper else [])))
    tokenizer = Tokenizer.from_hf_folder(folder, generation_eos_ids=eos_ids)
    config.eos_token_ids = tokenizer.eos_token_ids
    config.bos_token_id = next((i for i in (config_json.get("bos_token_id"), generation.get("bos_token_id"),
                                            tokenizer.bos_token_id) if isinstance(i, int)), None)

    shard = shard or Shard(0, 1)
    local = shard_config(config, shard.world)
    tensors = _read_safetensors(weight_files, progress, lambda name: shard_ranges(name, config, shard), names)
    if config.family.fused_projections:
        split_fused(local, tensors)
    if config.moe is not None:
        expert_names(config, tensors, str(folder))
    weights = select_weights(local, tensors, str(folder))
    if not shard.head:
        weights.pop("lm_head.weight", None)
    return LoadedModel(config, weights, tokenizer, str(folder))


# Multimodal checkpoints whose language model is a family served here, served for text as vLLM serves
# them text-only requests: architecture -> (the language model's model_type where the config does not
# name it, whether the wrapper ties the head by default, and transformers' defaults for what a text_config
# of that model_type may leave out: transformers writes a composite's text_config as its difference from them).
# RoPE bases are given as rope_theta (Gemma 3's sliding layers': rope_local_base_freq), so that a
# text_config's own rope_scaling or rope_parameters is read as it stands.
MULTIMODAL: dict[str, tuple[str, bool, dict[str, Any]]] = {
    "Gemma3ForConditionalGeneration": ("gemma3_text", True, dict(
        vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, query_pre_attn_scalar=256,
        sliding_window=4096, sliding_window_pattern=6, attn_logit_softcapping=None, final_logit_softcapping=None)),
    "Mistral3ForConditionalGeneration": ("mistral", True, dict(
        vocab_size=131072, hidden_size=5120, intermediate_size=32768, num_hidden_layers=40, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=1_000_000_000.0, sliding_window=None)),
    "LlavaForConditionalGeneration": ("llama", False, dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, head_dim=128, hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6,
        rope_theta=10000.0)),
    **{architecture: (text_type, False, dict(
        vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-5,
        rope_theta=1_000_000.0, sliding_window=None, use_sliding_window=False, max_window_layers=80))
       for architecture, text_type in (("Qwen2VLForConditionalGeneration", "qwen2_vl_text"),
                                       ("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl_text"))},
    "Qwen3_5ForConditionalGeneration": ("qwen3_5_text", False, dict(
        vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
        num_key_value_heads=4, head_dim=256, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=10000.0, partial_rotary_factor=0.25, linear_conv_kernel_dim=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32)),
    "Qwen3VLForConditionalGeneration": ("qwen3_vl_text", False, dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, head_dim=128, hidden_act="silu", max_position_embeddings=128000, rms_norm_eps=1e-6,
        rope_theta=500_000.0)),
}
# a multimodal checkpoint's modules outside its language model (vision encoders, projectors), at the
# root or under "model." as checkpoints and PEFT adapters name them
TOWERS = ("vision_tower", "multi_modal_projector", "visual")


def language_model_config(cfg: dict[str, Any], name: str) -> tuple[dict[str, Any], str | None]:
    """(the language model's config, the MULTIMODAL architecture it comes from or None): config.json
    itself, or a multimodal config's text_config over its wrapper's defaults (Qwen2-VL's and Qwen2.5-VL's
    configs before transformers 4.53 keep the language model's keys at the top)."""
    wrapper = next((a for a in cfg.get("architectures") or [] if a in MULTIMODAL), None)
    if wrapper is None:
        return cfg, None
    model_type, tied, defaults = MULTIMODAL[wrapper]
    text = cfg.get("text_config")
    if text is None:
        text = {key: value for key, value in cfg.items() if key not in ("model_type", "vision_config")}
    if not isinstance(text, dict):
        raise ModelLoadError(f"model {name}: config.json's text_config should be an object")
    # the defaults are those of the wrapper's own text model (Llava's text may be any family's)
    merged = {**(defaults if text.get("model_type", model_type) == model_type else {}), **text,
              "model_type": text.get("model_type", model_type)}
    merged.pop("architectures", None)
    merged["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", tied) or text.get("tie_word_embeddings"))
    return merged, wrapper


def text_weight_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor under the language model's own names (model.*, lm_head.*), or
    None for a tower's: transformers saves model.language_model.* (Qwen3-VL), language_model.model.* and
    language_model.lm_head.* (Gemma 3, Mistral 3, Llava, as their Hub checkpoints), or model.* (Qwen2.5-VL)."""
    root = name.removeprefix("model.")
    if root.split(".", 1)[0] in TOWERS:
        return None
    for prefix, to in (("model.language_model.", "model."), ("language_model.model.", "model."),
                       ("language_model.", "")):
        if name.startswith(prefix):
            return to + name[len(prefix):]
    return name


def _text_weight_names(files: list[Path]) -> dict[str, str]:
    """A multimodal checkpoint's tensors of the language model: stored name -> text_weight_name."""
    names = {}
    for path in files:
        with _safetensors_call(path, lambda: safe_open(path, "pt")) as f:
            names.update({stored: text for stored in f.keys() if (text := text_weight_name(stored)) is not None})
    return names


def family_of(cfg: dict[str, Any], name: str) -> Family:
    """The family config.json names, by its architectures (or, lacking them, its model_type)."""
    architectures = cfg.get("architectures") or []
    for family in FAMILIES:
        if any(a in family.architectures for a in architectures) or (
                not architectures and cfg.get("model_type") in family.model_types):
            return family
    supported = ", ".join(a for f in FAMILIES for a in f.architectures)
    raise ModelLoadError(f"model {name}: architecture {', '.join(architectures) or '(none given)'} is not "
                         f"supported; asyncserve serves {supported}, and the language models of "
                         f"{', '.join(MULTIMODAL)}")


def model_config(cfg: dict[str, Any], name: str) -> ModelConfig:
    """ModelConfig from a config.json, refusing what the forward pass does not implement."""
    family = family_of(cfg, name)
    _refuse_unsupported_features(cfg, family, name)

    def required(key: str) -> Any:
        if cfg.get(key) is None:
            raise ModelLoadError(f"model {name}: config.json has no {key!r}")
        return cfg[key]

    hidden, heads = required("hidden_size"), required("num_attention_heads")
    num_layers = required("num_hidden_layers")
    head_dim = cfg.get("head_dim") or hidden // heads
    rope_theta, rope_scaling, local_theta = _rope(cfg, family, name)
    gemma = family.name.startswith("gemma")
    moe = _moe(cfg, family, name)
    return ModelConfig(
        vocab_size=required("vocab_size"),
        hidden_size=hidden,
        intermediate_size=(moe.shared_size or moe.expert_size) if moe else required("intermediate_size"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rotary_dim=_rotary_dim(cfg, family, head_dim, name),
        nope_layers=_nope_layers(cfg, family, num_layers, name),
        **(_granite_multipliers(cfg, name) if family.name == "granite" else {}),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position=rope_context(rope_scaling, cfg.get("max_position_embeddings") or ModelConfig.max_position),
        # Gemma's configs tie by default (transformers writes the key only when it differs)
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        name=name,
        family=family,
        attn_scale=_attention_scale(cfg, family),
        attn_softcap=cfg.get("attn_logit_softcapping") if family.name == "gemma2" else None,
        final_softcap=cfg.get("final_logit_softcapping") if gemma else None,
        layer_windows=_layer_windows(cfg, family, num_layers, name),
        rope_local_theta=local_theta,
        moe=moe,
        **_linear_attention(cfg, family, num_layers, name),
    )


def _moe(cfg: dict[str, Any], family: Family, name: str) -> MoeConfig | None:
    """The mixture of experts of a Mixtral, Qwen2-MoE or Qwen3-MoE config.json; None for the dense families."""
    def count(key: str) -> int:
        if not isinstance(cfg.get(key), int) or isinstance(cfg[key], bool) or cfg[key] < 1:
            raise ModelLoadError(f"model {name}: config.json's {key!r} should be a positive integer, not "
                                 f"{cfg.get(key)!r}")
        return cfg[key]

    if family.name == "mixtral":
        return MoeConfig(num_experts=count("num_local_experts"), top_k=count("num_experts_per_tok"),
                         expert_size=count("intermediate_size"), normalize=True)
    if not family.name.endswith("_moe"):
        return None
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ModelLoadError(f"model {name} mixes dense and mixture-of-experts layers (mlp_only_layers "
                             f"{cfg.get('mlp_only_layers')}, decoder_sparse_step {cfg.get('decoder_sparse_step', 1)}"
                             "), which asyncserve does not implement: it serves experts in every layer")
    shared = cfg.get("shared_expert_intermediate_size") or 0
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (its attribute map)
    experts = "num_experts" if "num_experts" in cfg else "num_local_experts"
    return MoeConfig(num_experts=count(experts), top_k=count("num_experts_per_tok"),
                     expert_size=count("moe_intermediate_size"), normalize=bool(cfg.get("norm_topk_prob", False)),
                     shared_size=count("shared_expert_intermediate_size") if shared else 0)


def _layer_windows(cfg: dict[str, Any], family: Family, num_layers: int, name: str) -> list[int | None]:
    """Per layer its sliding window or None, from layer_types where config.json lists them, else by the
    family's rule; [] when no layer slides (or the window covers the whole context)."""
    window = cfg.get("sliding_window")
    if family.sliding_layers in ("from_max_window_layers", "nope_layers") and not cfg.get("use_sliding_window"):
        window = None
    if not window or window >= (cfg.get("max_position_embeddings") or ModelConfig.max_position):
        return []
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
            raise ModelLoadError(f"config.json's layer_types {types} should list sliding_attention or "
                                 f"full_attention for each of the {num_layers} layers")
        sliding = [t == "sliding_attention" for t in types]
    elif family.sliding_layers == "every_other":
        sliding = [(i + 1) % 2 == 1 for i in range(num_layers)]
    elif family.sliding_layers == "pattern":
        pattern = cfg.get("sliding_window_pattern", family.window_pattern)
        sliding = [(i + 1) % pattern != 0 for i in range(num_layers)]
    elif family.sliding_layers == "from_max_window_layers":
        sliding = [i >= cfg.get("max_window_layers", num_layers) for i in range(num_layers)]
    elif family.sliding_layers == "nope_layers":
        sliding = _nope_layers(cfg, family, num_layers, name)
    else:
        sliding = [True] * num_layers
    return [window if s else None for s in sliding] if any(sliding) else []


def _refuse_unsupported_features(cfg: dict[str, Any], family: Family, name: str) -> None:
    flags = ("mlp_bias",) if family.qkv_bias else ("attention_bias", "mlp_bias")
    for flag in flags:
        if cfg.get(flag):
            raise ModelLoadError(f"model {name} has {flag}: true; asyncserve's {family.name} has no such bias terms")
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    want = {"silu": ("silu",), "gelu_tanh": ("gelu_pytorch_tanh", "gelu_tanh")}[family.activation]
    if family.name == "gemma":      # Gemma's released configs say "gelu", meaning the tanh form (as transformers reads it)
        want += ("gelu",)
    if activation not in want:
        raise ModelLoadError(f"model {name} uses activation {activation!r}; asyncserve's {family.name} "
                             f"implements {want[0]}")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(f"model {name} uses bidirectional attention; asyncserve serves causal decoders")
    if _rotary_fraction(cfg, family) != 1.0 and not family.partial_rope:
        raise ModelLoadError(f"model {name} rotates part of each head (partial_rotary_factor), which "
                             f"asyncserve implements for Phi-3, Phi-4-mini and Qwen3.5 only, as transformers does")
    quantization = cfg.get("quantization_config")
    if quantization:
        raise ModelLoadError(f"model {name} is a quantized checkpoint ({quantization.get('quant_method', '?')}); "
                             "asyncserve loads float safetensors checkpoints or GGUF files")


def _rope(cfg: dict[str, Any], family: Family, name: str) -> tuple[float, dict | None, float | None]:
    """rope_theta, the scaling dict and (Gemma 3, OLMo 3) the sliding layers' base, from the older
    rope_theta/rope_scaling keys or transformers 5's rope_parameters (per layer type for Gemma 3 and OLMo 3);
    scaling is normalised to have `rope_type`, and None for plain RoPE."""
    parameters = dict(cfg.get("rope_parameters") or {})
    local = {}
    if family.local_rope_base:
        local = parameters.pop("sliding_attention", None) or {}
        parameters = dict(parameters.pop("full_attention", None) or parameters)
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError(f"model {name}: {local['rope_type']!r} RoPE on the sliding layers is not supported")
    theta = parameters.pop("rope_theta", cfg.get("rope_theta", 1e6 if family.name == "gemma3" else 10000.0))
    # Gemma 3's sliding layers default to a base of their own, OLMo 3's to the global layers'
    local_theta = float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0) if family.name == "gemma3"
                                  else theta)) if family.local_rope_base else None
    scaling = {**(cfg.get("rope_scaling") or {}), **parameters}
    scaling.pop("partial_rotary_factor", None)
    if "type" in scaling:             # the pre-4.45 spelling of rope_type
        scaling.setdefault("rope_type", scaling.pop("type"))
    if scaling.get("rope_type") == "mrope" and str(cfg.get("model_type")).endswith("_vl_text"):
        # Qwen2-VL's and Qwen2.5-VL's multimodal RoPE: on text alone its three position ids are equal,
        # which rotates as plain RoPE (transformers reads it as "default")
        scaling["rope_type"] = "default"
    if scaling.get("rope_type") == "su" or (family.name == "phi3" and scaling.get("rope_type") == "yarn"):
        scaling["rope_type"] = "longrope"          # Phi-3's older names for it, as transformers reads them
    if scaling.get("rope_type", "default") == "default":
        return float(theta), None, local_theta
    if "original_max_position_embeddings" in cfg:  # Phi-3 keeps it beside rope_scaling
        scaling.setdefault("original_max_position_embeddings", cfg["original_max_position_embeddings"])
    if scaling["rope_type"] in ("llama3", "yarn", "longrope"):    # the pretraining context, as transformers reads it
        scaling.setdefault("original_max_position_embeddings",
                           cfg.get("max_position_embeddings") or ModelConfig.max_position)
    if scaling["rope_type"] == "longrope" and "factor" not in scaling and "original_max_position_embeddings" in scaling:
        scaling["factor"] = (cfg.get("max_position_embeddings") or ModelConfig.max_position) / \
            scaling["original_max_position_embeddings"]
    check_rope(scaling, name)
    return float(theta), scaling, local_theta


def _attention_scale(cfg: dict[str, Any], family: Family) -> float | None:
    """The scores' scale where it is not head_dim ** -0.5: Gemma's query_pre_attn_scalar ** -0.5,
    Granite's attention_multiplier (transformers' default 1.0)."""
    if family.name.startswith("gemma") and cfg.get("query_pre_attn_scalar"):
        return cfg["query_pre_attn_scalar"] ** -0.5
    if family.name == "granite":
        return float(cfg.get("attention_multiplier", 1.0))
    return None


def _granite_multipliers(cfg: dict[str, Any], name: str) -> dict[str, float]:
    """Granite's embedding_multiplier, residual_multiplier and logits_scaling (transformers' defaults 1.0)."""
    values = {key: cfg.get(key, 1.0) for key in ("embedding_multiplier", "residual_multiplier", "logits_scaling")}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value == 0:
            raise ModelLoadError(f"model {name}: config.json's {key} should be a finite non-zero number, not {value!r}")
    return {key: float(value) for key, value in values.items()}


def _nope_layers(cfg: dict[str, Any], family: Family, num_layers: int, name: str) -> list[bool]:
    """SmolLM3's layers without RoPE: where no_rope_layers says 0 (1: RoPE), else every
    no_rope_layer_interval-th layer, as transformers' SmolLM3Config fills it."""
    if not family.nope_interval:
        return []
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = cfg.get("no_rope_layer_interval") or family.nope_interval
        return [(i + 1) % interval == 0 for i in range(num_layers)]
    if not isinstance(flags, list) or len(flags) != num_layers or not set(flags) <= {0, 1}:
        raise ModelLoadError(f"model {name}: config.json's no_rope_layers should hold 1 (RoPE) or 0 (none) for "
                             f"each of its {num_layers} layers, not {flags!r}")
    return [not flag for flag in flags]


def _rotary_fraction(cfg: dict[str, Any], family: Family) -> float:
    return float((cfg.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                          cfg.get("partial_rotary_factor", family.rotary_fraction)))


def _rotary_dim(cfg: dict[str, Any], family: Family, head_dim: int, name: str) -> int | None:
    """The dimensions of each head RoPE rotates (transformers' int(head_dim * partial_rotary_factor)); None: all."""
    fraction = _rotary_fraction(cfg, family)
    if fraction == 1.0:
        return None
    dim = int(head_dim * fraction)
    if not 0 < fraction < 1 or dim % 2:
        raise ModelLoadError(f"model {name}: partial_rotary_factor {fraction} should rotate an even number of "
                             f"each head's {head_dim} dimensions")
    return dim


def _linear_attention(cfg: dict[str, Any], family: Family, num_layers: int, name: str) -> dict[str, Any]:
    """Qwen3.5's linear-attention layers (layer_types, else three of every full_attention_interval) and
    their shape, as ModelConfig fields; {} for the other families."""
    if family.name != "qwen3_5":
        return {}
    types = cfg.get("layer_types")
    if types is None:
        interval = cfg.get("full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or not set(types) <= {"linear_attention",
                                                                                     "full_attention"}:
        raise ModelLoadError(f"model {name}: config.json's layer_types should list linear_attention or "
                             f"full_attention for each of the {num_layers} layers")
    sizes = {}
    for key, default in (("linear_num_key_heads", 16), ("linear_num_value_heads", 32), ("linear_key_head_dim", 128),
                         ("linear_value_head_dim", 128), ("linear_conv_kernel_dim", 4)):
        value = cfg.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelLoadError(f"model {name}: config.json's {key} should be a positive integer, not {value!r}")
        sizes[key] = value
    if sizes["linear_num_value_heads"] % sizes["linear_num_key_heads"]:
        raise ModelLoadError(f"model {name}: {sizes['linear_num_value_heads']} value heads do not group over "
                             f"{sizes['linear_num_key_heads']} key heads")
    return dict(linear_layers=[t == "linear_attention" for t in types], linear_attention=LinearAttention(
        num_k_heads=sizes["linear_num_key_heads"], num_v_heads=sizes["linear_num_value_heads"],
        k_head_dim=sizes["linear_key_head_dim"], v_head_dim=sizes["linear_value_head_dim"],
        conv_kernel=sizes["linear_conv_kernel_dim"]))


def _ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _safetensors_files(folder: Path) -> list[Path]:
    index_file, single_file = folder / "model.safetensors.index.json", folder / "model.safetensors"
    if index_file.is_file():
        weight_map = read_json(index_file).get("weight_map") or {}
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{folder} is missing {', '.join(missing)} (listed in {index_file.name})")
        return files
    if single_file.is_file():
        return [single_file]
    pickles = sorted(p.name for p in folder.glob("*.bin"))
    if pickles:
        raise ModelLoadError(
            f"{folder} has only PyTorch pickle weights ({', '.join(pickles)}), which asyncserve refuses to load "
            "because unpickling can run arbitrary code; convert them with transformers: "
            "AutoModelForCausalLM.from_pretrained(folder).save_pretrained(folder, safe_serialization=True)")
    raise ModelLoadError(f"{folder} has no model.safetensors or model.safetensors.index.json")


def _read_safetensors(files: list[Path], progress: ProgressCallback | None,
                      ranges: Callable[[str], tuple[int, list[tuple[int, int]]] | None],
                      names: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the files, or where ranges(name) gives (dim, [(start, end), ...]) only those slices
    of it, concatenated (read as slices: the rest of the tensor is never loaded). names: only these
    stored tensors, under these names (a multimodal checkpoint's language model)."""
    opened = {path: _safetensors_call(path, lambda: safe_open(path, "pt")) for path in files}
    total = len(names) if names is not None else sum(len(f.keys()) for f in opened.values())
    tensors: dict[str, torch.Tensor] = {}
    for path, f in opened.items():
        for stored in f.keys():
            name = stored if names is None else names.get(stored)
            if name is None:
                continue
            tensors[name] = _safetensors_call(path, lambda: _read_tensor(f, stored, ranges(name)))
            if progress is not None:
                progress(len(tensors), total)
    return tensors


def _read_tensor(f, name: str, ranges: tuple[int, list[tuple[int, int]]] | None) -> torch.Tensor:
    if ranges is None:
        return f.get_tensor(name)
    dim, spans = ranges
    sliced = f.get_slice(name)
    parts = [sliced[a:b] if dim == 0 else sliced[:, a:b] for a, b in spans]
    return torch.cat(parts, dim) if len(parts) > 1 else parts[0]


def _safetensors_call(path: Path, read: Callable[[], Any]) -> Any:
    try:
        return read()
    except Exception as e:     # safetensors raises its own error types for truncated or corrupt files
        raise ModelLoadError(f"cannot read {path}: {e}") from None
