"""load_model: the base model's config, weights and tokenizer, from a GGUF file or an HF folder."""
from __future__ import annotations

from asyncserve.model.checkpoint import LoadedModel, ProgressCallback
from asyncserve.model.config import ModelLoadError
from asyncserve.model.paths import check_model_path, default_model_path
from asyncserve.model.shard import Shard, shard_config, shard_weights

__all__ = ["load_model", "check_model_path", "default_model_path"]


def gguf_k_quants(path: str | None) -> bool:
    """Whether the model is a GGUF file whose weights are mostly K-quants (loader_gguf.mostly_k_quants);
    False for an HF folder."""
    target = check_model_path(path)
    if target.is_dir():
        return False
    from asyncserve.model.loader_gguf import mostly_k_quants
    return mostly_k_quants(target)


def load_model(path: str | None = None, progress: ProgressCallback | None = None,
               keep_quantized: bool = False, quantize: str | None = None, shard: Shard | None = None) -> LoadedModel:
    """A `.gguf` file, an HF folder (config.json + safetensors + tokenizer.json), or None for the default model.
    progress(done, total): called as the weights are read (and dequantized). keep_quantized: a GGUF file's
    projections and embeddings of the types QuantLinear runs stay GGUF blocks (QuantizedWeight). quantize
    (q8_0 | q4_0): an HF folder's projections, embeddings and head quantized to blocks (model/quantize.py).
    shard: a tensor-parallel rank's slices of the weights (model/shard.py; an HF folder's read as slices),
    the config the whole model's."""
    target = check_model_path(path)
    # the loaders import their file-format libraries only when a model of that kind is loaded
    if target.is_dir():
        from asyncserve.model.loader_hf import load_hf_folder
        loaded = load_hf_folder(target, progress, shard)
        if quantize is not None:
            from asyncserve.model.quantize import quantize_weights
            quantize_weights(loaded, quantize)
        return loaded
    if quantize is not None:
        raise ModelLoadError(f"--quantize quantizes an HF folder's weights; {target} is a GGUF file, whose quantized "
                             "tensors stay in their blocks with --keep-quantized")
    from asyncserve.model.loader_gguf import load_gguf_file
    loaded = load_gguf_file(target, progress, keep_quantized)
    if shard is not None:
        shard_config(loaded.config, shard.world)        # refuses a split that cuts a head
        shard_weights(loaded.config, loaded.weights, shard)
    return loaded
