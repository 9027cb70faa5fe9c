"""load_model: the base model's config, weights and tokenizer, from a GGUF file or an HF folder."""
from __future__ import annotations

from asyncserve.model.checkpoint import LoadedModel, ProgressCallback
from asyncserve.model.paths import check_model_path, default_model_path

__all__ = ["load_model", "check_model_path", "default_model_path"]


def load_model(path: str | None = None, progress: ProgressCallback | None = None,
               keep_quantized: bool = False) -> LoadedModel:
    """A `.gguf` file, an HF folder (config.json + safetensors + tokenizer.json), or None for the default model.
    progress(done, total): called as the weights are read (and dequantized). keep_quantized: a GGUF file's
    projections of the types QuantLinear runs stay GGUF blocks (QuantizedWeight)."""
    target = check_model_path(path)
    # the loaders import their file-format libraries only when a model of that kind is loaded
    if target.is_dir():
        from asyncserve.model.loader_hf import load_hf_folder
        return load_hf_folder(target, progress)
    from asyncserve.model.loader_gguf import load_gguf_file
    return load_gguf_file(target, progress, keep_quantized)
