"""Loading a llama.cpp GGUF file: metadata, weights in HF naming (dequantized to float32, or with
keep_quantized the projections of the types the CPU kernels run kept as their blocks), tokenizer."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from asyncserve.model.checkpoint import LoadedModel, select_weights
from asyncserve.model.config import ModelConfig, ModelLoadError
from asyncserve.model.linear import QuantizedWeight
from asyncserve.model.tokenizer import Tokenizer

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_REQUIRED = object()
# what kernels/cpu/quant.h runs: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K (everything a Q4_K_M, Q5_K_M or Q8_0 file holds)
KEPT_QUANTIZED = {gguf.GGMLQuantizationType(t) for t in (2, 3, 8, 12, 13, 14)}


def load_gguf_file(path: Path, keep_quantized: bool = False) -> LoadedModel:
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:       # the reader raises ValueError, struct errors, ... on a bad file
        raise ModelLoadError(f"cannot read {path} as a GGUF file: {e}") from None
    fields = reader.fields
    architecture = _value(fields, "general.architecture", path)
    if architecture != "llama":
        raise ModelLoadError(f"{path} holds a {architecture!r} model; asyncserve serves Llama-family GGUF files "
                             "(general.architecture 'llama')")
    by_name = {tensor.name: tensor for tensor in reader.tensors}
    if "rope_freqs.weight" in by_name:
        raise ModelLoadError(f"{path} stores per-frequency RoPE factors (rope_freqs, Llama 3.1-style scaling), whose "
                             "parameters a GGUF does not record; serve the model's HF folder instead")
    if "token_embd.weight" not in by_name:
        raise ModelLoadError(f"{path} is missing tensor token_embd.weight")
    hf_names = {name: _hf_name(name, path) for name in by_name}     # refuse unknown tensors before dequantizing

    config = _model_config(fields, path, vocab_size=int(by_name["token_embd.weight"].shape[1]),
                           tied="output.weight" not in by_name)
    tokenizer = Tokenizer.from_gguf(fields)
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_ids = tokenizer.eos_token_ids

    tensors = {hf_names[name]: _quantized(tensor, config) if keep_quantized and _keeps(tensor)
               else _dequantize(tensor, config, path) for name, tensor in by_name.items()}
    return LoadedModel(config, select_weights(config, tensors, str(path)), tokenizer, str(path))


def _model_config(fields: dict[str, Any], path: Path, vocab_size: int, tied: bool) -> ModelConfig:
    def llama(key: str, default: Any = _REQUIRED) -> Any:
        return _value(fields, f"llama.{key}", path, default)

    hidden, heads = llama("embedding_length"), llama("attention.head_count")
    head_dim = llama("attention.key_length", hidden // heads)
    rope_dim = llama("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ModelLoadError(f"{path} rotates {rope_dim} of {head_dim} head dimensions (partial RoPE), "
                             "which the Llama architecture does not do")
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=llama("feed_forward_length"),
        num_layers=llama("block_count"),
        num_heads=heads,
        num_kv_heads=llama("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=llama("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=llama("rope.freq_base", 10000.0),
        rope_scaling=_rope_scaling(llama),
        max_position=llama("context_length", ModelConfig.max_position),
        tie_word_embeddings=tied,
        name=path.stem,          # an id clients can type; general.name is free text with spaces
    )


def _rope_scaling(llama) -> dict | None:
    """HF-style rope_scaling from llama.rope.scaling.* (or the older llama.rope.scale_linear)."""
    kind, factor = llama("rope.scaling.type", None), llama("rope.scaling.factor", None)
    if kind is None and llama("rope.scale_linear", None) is not None:
        kind, factor = "linear", llama("rope.scale_linear")
    if kind in (None, "none") or factor in (None, 1.0):
        return None
    scaling = {"rope_type": kind, "factor": factor}
    original_context = llama("rope.scaling.original_context_length", None)
    if original_context is not None:
        scaling["original_max_position_embeddings"] = original_context
    return scaling


def _hf_name(gguf_name: str, path: Path) -> str:
    """token_embd.weight -> model.embed_tokens.weight, blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight"""
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in _GLOBAL_TENSORS and parts[1] == "weight":
        return f"{_GLOBAL_TENSORS[parts[0]]}.weight"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.weight"
    raise ModelLoadError(f"{path} has tensor {gguf_name}, which is not part of the Llama architecture asyncserve "
                         "implements (no biases, no extra projections)")


def _dequantize(tensor: gguf.ReaderTensor, config: ModelConfig, path: Path) -> torch.Tensor:
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ModelLoadError(f"{path}: tensor {tensor.name} is stored as {tensor.tensor_type.name}, which the gguf "
                             "package cannot dequantize; use a file quantized with another type") from None
    # float tensors come back as read-only views of the memory-mapped file: copy those
    weight = torch.from_numpy(np.require(values, np.float32, ["C", "W"]))
    weight = weight.reshape([int(d) for d in reversed(tensor.shape)])   # ggml lists dimensions innermost first
    # llama.cpp's converter interleaves the rotary halves of each Q/K head; undo it for HF's rotate_half layout
    if tensor.name.endswith("attn_q.weight"):
        weight = _unpermute(weight, config.num_heads)
    elif tensor.name.endswith("attn_k.weight"):
        weight = _unpermute(weight, config.num_kv_heads)
    return weight


def _keeps(tensor: gguf.ReaderTensor) -> bool:
    """Projections and the output head of a kernel type; the embeddings are looked up, not multiplied."""
    return tensor.tensor_type in KEPT_QUANTIZED and len(tensor.shape) == 2 and tensor.name != "token_embd.weight"


def _quantized(tensor: gguf.ReaderTensor, config: ModelConfig) -> QuantizedWeight:
    """The tensor's blocks copied out of the mapped file, one row of blocks per output: [out, bytes per row]."""
    fan_in, out = (int(d) for d in tensor.shape)
    blocks = tensor.data.reshape(out, -1)          # a view of the mapped file
    # whole rows move, so undoing the converter's Q/K interleave permutes rows of blocks as it does rows of floats
    if tensor.name.endswith("attn_q.weight"):
        blocks = _unpermute(blocks, config.num_heads)
    elif tensor.name.endswith("attn_k.weight"):
        blocks = _unpermute(blocks, config.num_kv_heads)
    # copied out of the mapping (which closes with the reader)
    return QuantizedWeight([(torch.from_numpy(np.array(blocks, dtype=np.uint8)), int(tensor.tensor_type))], fan_in)


def _unpermute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, -1).swapaxes(1, 2).reshape(weight.shape)


def _value(fields: dict[str, Any], key: str, path: Path, default: Any = _REQUIRED) -> Any:
    field = fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise ModelLoadError(f"{path} has no {key} in its metadata")
        return default
    return field.contents()
