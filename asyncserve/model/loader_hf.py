"""Loading an HF model folder: config.json, safetensors weights (single or sharded), tokenizer files."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open

from asyncserve.model.checkpoint import LoadedModel, ProgressCallback, select_weights
from asyncserve.model.config import ModelConfig, ModelLoadError, read_json
from asyncserve.model.tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


def load_hf_folder(folder: Path, progress: ProgressCallback | None = None) -> LoadedModel:
    config_json = read_json(folder / "config.json")
    generation_file = folder / "generation_config.json"
    generation = read_json(generation_file) if generation_file.is_file() else {}
    config = model_config(config_json, name=folder.name)
    weight_files = _safetensors_files(folder)     # refuse a pickle-only checkpoint before any slow work

    # generation stops at any eos the model declares: generation_config.json's and config.json's
    eos_ids = list(dict.fromkeys(_ids(generation.get("eos_token_id")) + _ids(config_json.get("eos_token_id"))))
    tokenizer = Tokenizer.from_hf_folder(folder, generation_eos_ids=eos_ids)
    config.eos_token_ids = tokenizer.eos_token_ids
    config.bos_token_id = next((i for i in (config_json.get("bos_token_id"), generation.get("bos_token_id"),
                                            tokenizer.bos_token_id) if isinstance(i, int)), None)

    weights = select_weights(config, _read_safetensors(weight_files, progress), str(folder))
    return LoadedModel(config, weights, tokenizer, str(folder))


def model_config(cfg: dict[str, Any], name: str) -> ModelConfig:
    """ModelConfig from a config.json, refusing what the Llama forward pass does not implement."""
    architectures = cfg.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in architectures):
        raise ModelLoadError(f"model {name}: architecture {', '.join(architectures) or '(none given)'} is not "
                             f"supported; asyncserve serves {' and '.join(SUPPORTED_ARCHITECTURES)}")
    _refuse_unsupported_features(cfg, name)

    def required(key: str) -> Any:
        if cfg.get(key) is None:
            raise ModelLoadError(f"model {name}: config.json has no {key!r}")
        return cfg[key]

    hidden, heads = required("hidden_size"), required("num_attention_heads")
    rope_theta, rope_scaling = _rope(cfg)
    return ModelConfig(
        vocab_size=required("vocab_size"),
        hidden_size=hidden,
        intermediate_size=required("intermediate_size"),
        num_layers=required("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position=cfg.get("max_position_embeddings") or ModelConfig.max_position,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        name=name,
    )


def _refuse_unsupported_features(cfg: dict[str, Any], name: str) -> None:
    window = cfg.get("sliding_window")
    # a window at least as long as the context never masks anything
    if window is not None and window < (cfg.get("max_position_embeddings") or ModelConfig.max_position):
        raise ModelLoadError(f"model {name} uses sliding-window attention (sliding_window={window}), which "
                             "asyncserve does not implement; only checkpoints with sliding_window null are supported")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise ModelLoadError(f"model {name} has {flag}: true; asyncserve's Llama has no bias terms")
    activation = cfg.get("hidden_act", "silu")
    if activation != "silu":
        raise ModelLoadError(f"model {name} uses activation {activation!r}; asyncserve's Llama implements only silu")
    quantization = cfg.get("quantization_config")
    if quantization:
        raise ModelLoadError(f"model {name} is a quantized checkpoint ({quantization.get('quant_method', '?')}); "
                             "asyncserve loads float safetensors checkpoints or GGUF files")


def _rope(cfg: dict[str, Any]) -> tuple[float, dict | None]:
    """rope_theta and the scaling dict, from the older rope_theta/rope_scaling keys or transformers 5's
    rope_parameters; scaling is normalised to have `rope_type`, and None for plain RoPE."""
    parameters = dict(cfg.get("rope_parameters") or {})
    theta = parameters.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = {**(cfg.get("rope_scaling") or {}), **parameters}
    if "type" in scaling:             # the pre-4.45 spelling of rope_type
        scaling.setdefault("rope_type", scaling.pop("type"))
    if scaling.get("rope_type", "default") == "default":
        return float(theta), None
    return float(theta), scaling


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


def _read_safetensors(files: list[Path], progress: ProgressCallback | None) -> dict[str, torch.Tensor]:
    opened = {path: _safetensors_call(path, lambda: safe_open(path, "pt")) for path in files}
    total = sum(len(f.keys()) for f in opened.values())
    tensors: dict[str, torch.Tensor] = {}
    for path, f in opened.items():
        for name in f.keys():
            tensors[name] = _safetensors_call(path, lambda: f.get_tensor(name))
            if progress is not None:
                progress(len(tensors), total)
    return tensors


def _safetensors_call(path: Path, read: Callable[[], Any]) -> Any:
    try:
        return read()
    except Exception as e:     # safetensors raises its own error types for truncated or corrupt files
        raise ModelLoadError(f"cannot read {path}: {e}") from None
